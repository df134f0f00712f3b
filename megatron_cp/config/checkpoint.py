"""The checkpoint section: where a run saves and what it loads from (the formats and
Megatron-LM's other checkpoint flags are in the flag table, megatron_cp/cli/megatron_flags.py)."""
from dataclasses import dataclass

from megatron_cp.config.setting import check_choices, setting

CKPT_FORMATS = ("torch", "torch_dist", "fsdp_dtensor")
# Megatron-LM's other formats, each refused with the reason
# Megatron-LM's StrictHandling (megatron/core/dist_checkpointing/validation.py); the return_*
# modes hand the mismatched keys to the caller of dist_checkpointing.load, which the training
# load has no use for
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                        "raise_all", "ignore_all")
REFUSED_STRICTNESS = ("return_unexpected", "return_all")
NOT_BUILT_FORMATS = {
    "torch_dcp": "Megatron-LM's plain-DCP variant is not built; use --ckpt-format torch_dist "
                 "(torch.distributed.checkpoint too)",
    "zarr": "not built; use --ckpt-format torch_dist (same sharded, layout-free checkpoints)",
}


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    save: str | None = setting(None, group="checkpointing and logging",
        help="Checkpoint directory to save to.")
    load: str | None = setting(None, group="checkpointing and logging",
        help="Checkpoint directory to resume from.")
    ckpt_step: int | None = setting(None, group="checkpointing and logging",
        help="Checkpoint step to load model from: the iteration under --load to read instead of "
             "the one latest_checkpointed_iteration.txt names.")
    save_interval: int | None = setting(None,
        aliases=("--persistent-save-interval",), group="checkpointing and logging",
        help="Save every this many iterations.")
    save_retain_interval: int | None = setting(None, group="checkpointing and logging",
        help="Keep only the checkpoints whose iteration is a multiple of this (and the latest): "
             "each save deletes the previous one otherwise. A multiple of --save-interval.")
    verify_integrity: bool = setting(False, group="checkpointing and logging",
        help="With --ckpt-format torch_dist: write a SHA-256 of every checkpoint file "
             "(integrity.json) once a save has finished, and check them before --load reads the "
             "checkpoint; a file changed since is an error naming it.")
    async_save: bool = setting(False, group="checkpointing and logging",
        help="With --ckpt-format torch_dist: copy the state, then write it in the background "
             "while training goes on; the tracker file is written once every rank has finished "
             "writing.")
    no_load_optim: bool = setting(False, group="checkpointing and logging",
        help="Do not load optimizer state.")
    no_load_rng: bool = setting(False, group="checkpointing and logging",
        help="Do not load RNG state.")
    override_opt_param_scheduler: bool = setting(False,
        flag="--override-opt_param-scheduler", aliases=("--override-opt-param-scheduler",),
        group="checkpointing and logging",
        help="On load, take the LR schedule from the arguments, not the checkpoint.")
    use_checkpoint_opt_param_scheduler: bool = setting(False,
        flag="--use-checkpoint-opt_param-scheduler",
        aliases=("--use-checkpoint-opt-param-scheduler",), group="checkpointing and logging",
        help="On load, take the LR schedule from the checkpoint, not the arguments.")
    finetune: bool = setting(False, group="checkpointing and logging",
        help="Load weights only and start from iteration 0.")
    use_checkpoint_args: bool = setting(False, group="checkpointing and logging",
        help="Take the model and tokenizer flags not given on the command line from the "
             "checkpoint under --load.")
    exit_on_missing_checkpoint: bool = setting(False, group="checkpointing and logging",
        help="Exit if --load finds no checkpoint.")
    no_save_optim: bool = setting(False, group="checkpointing and logging", help="Do not save optimizer state.")
    dist_ckpt_strictness: str = setting(
        "assume_ok_unexpected", choices=DIST_CKPT_STRICTNESS + REFUSED_STRICTNESS,
        group="checkpointing and logging",
        help="What a torch_dist --load does when its keys and the checkpoint's differ (Megatron-"
             "LM's names). 'Unexpected': a key this run loads that the checkpoint lacks; "
             "'missing': a key the checkpoint holds that no rank loads. assume_ok_unexpected: "
             "no check, an unexpected key fails the load naming it; log_unexpected / log_all: "
             "warn of the unexpected (and missing) keys and load the rest, the unexpected "
             "keeping their current values; raise_unexpected / raise_all: stop naming them; "
             "ignore_all: load the rest silently.")
    no_save_rng: bool = setting(False, group="checkpointing and logging", help="Do not save RNG state.")
    strict_fsdp_dtensor_load: bool = setting(True,
        flag="--no-strict-fsdp-dtensor-load", arg="strict_fsdp_dtensor_load", store_false=True,
        aliases=("--disable-strict-fsdp-dtensor-load",), group="checkpointing and logging",
        help="A --load of an fsdp_dtensor checkpoint may lack tensors of the optimizer state: "
             "those start afresh (the model's weights must all be there, unless --finetune), "
             "as Megatron-LM's partial load.")
    ckpt_format: str = setting("torch_dist", choices=CKPT_FORMATS + tuple(NOT_BUILT_FORMATS),
        group="checkpointing and logging",
        help="Checkpoint format of --save: torch_dist (the default, as in Megatron-LM: "
             "torch.distributed.checkpoint; every rank writes its shards in parallel and --load "
             "restores it under any TP/PP/CP/DP/EP layout), torch (one file per "
             "model-parallel rank; another layout reshards it on load) or fsdp_dtensor "
             "(Megatron-FSDP's: torch.distributed.checkpoint with Megatron-LM's parameter "
             "names and fp32 weights; with --use-megatron-fsdp). --load reads any of them, "
             "in any layout.")

    def __post_init__(self):
        if self.dist_ckpt_strictness in REFUSED_STRICTNESS:
            raise ValueError(f"--dist-ckpt-strictness {self.dist_ckpt_strictness}: it returns "
                             "the mismatched keys to a caller of dist_checkpointing.load, and "
                             "a training load has none to return them to; use log_unexpected "
                             "or log_all (or raise_unexpected / raise_all)")
        check_choices(self)
        if self.ckpt_format in NOT_BUILT_FORMATS:
            raise ValueError(f"--ckpt-format {self.ckpt_format}: "
                             f"{NOT_BUILT_FORMATS[self.ckpt_format]}")
