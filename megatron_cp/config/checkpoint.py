"""The checkpoint section: where a run saves and what it loads from (the formats and
Megatron-LM's other checkpoint flags are in the flag table, megatron_cp/cli/megatron_flags.py)."""
from dataclasses import dataclass

from megatron_cp.config.setting import setting


@dataclass(kw_only=True)
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
