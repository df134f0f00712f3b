"""Megatron-LM flags beyond the core ones: accepted where they map to something megatron_cp
does, refused with the reason where they do not, in one table.

Kinds of entry:

- ``STORE``: accepted and kept on ``args`` for the code that reads it.
- ``SAME``: accepted; it selects what megatron_cp does anyway, so it changes nothing. A line
  saying so goes to ``args.compat_notes`` (the start-up banner prints it once).
- ``MAP``: a Megatron-LM alias, rewritten to the flag it stands for.
- ``REFUSE``: giving it raises ValueError naming the flag and why.

An entry may also refuse some values only (``refuse={value: why}``), e.g. ``--ckpt-format
zarr``. A flag counts as given when its value differs from its default.
"""
from dataclasses import dataclass, field

STORE, SAME, MAP, REFUSE = "store", "same", "map", "refuse"


@dataclass(frozen=True)
class CompatFlag:
    """One Megatron-LM flag: its kind, the note or reason, and how argparse reads it."""
    flag: str
    kind: str
    why: str
    argparse: dict = field(default_factory=dict)  # type/default/choices/nargs; empty: store_true
    group: str = "compat"  # the argparse group it is listed in
    refuse: dict = field(default_factory=dict)  # value -> reason, for partly supported flags
    sets: tuple = ()  # MAP: (argument name, value)
    needs: tuple = ()  # (argument name, values it must have, why not otherwise): a condition

    @property
    def dest(self):
        return self.flag[2:].replace("-", "_")


_NO_FUSION = "no fused kernel of this kind is used; the plain PyTorch ops run"
_NOT_BUILT = "is not built in this version of megatron_cp; drop the flag"

COMPAT_FLAGS = (
    # --- aliases ---
    CompatFlag("--recompute-activations", MAP, "Same as --recompute-granularity selective.",
               group="training", sets=("recompute_granularity", "selective")),
    CompatFlag("--use-rotary-position-embeddings", MAP, "Same as --position-embedding-type rope.",
               group="model", sets=("position_embedding_type", "rope")),
    # --- accepted, kept on args ---
    CompatFlag("--use-checkpoint-args", STORE, "Take the model and tokenizer flags not given on "
               "the command line from the checkpoint under --load.",
               group="checkpointing and logging"),
    CompatFlag("--exit-on-missing-checkpoint", STORE, "Exit if --load finds no checkpoint.",
               group="checkpointing and logging"),
    CompatFlag("--no-save-optim", STORE, "Do not save optimizer state.",
               group="checkpointing and logging"),
    CompatFlag("--no-save-rng", STORE, "Do not save RNG state.", group="checkpointing and logging"),
    CompatFlag("--ckpt-format", STORE, "Checkpoint format of --save: torch (one file per "
               "model-parallel rank, loads into the same TP/PP layout) or torch_dist "
               "(torch.distributed.checkpoint: every rank writes its shards in parallel and "
               "--load restores it under any TP/PP/CP/DP layout). --load reads either.",
               group="checkpointing and logging",
               argparse=dict(choices=["torch", "torch_dist", "zarr"], default="torch"),
               refuse={"zarr": "not built; use --ckpt-format torch_dist (same sharded, "
                               "layout-free checkpoints)"}),
    CompatFlag("--log-throughput", SAME, "the log line always shows throughput (TFLOP/s per "
               "GPU, tokens per second)"),
    CompatFlag("--log-params-norm", STORE, "Log the norm of the parameters.",
               group="checkpointing and logging"),
    CompatFlag("--tensorboard-log-interval", STORE, "Write tensorboard scalars every this many "
               "iterations.", group="checkpointing and logging", argparse=dict(type=int, default=1)),
    CompatFlag("--log-timers-to-tensorboard", STORE, "Write timers to tensorboard.",
               group="checkpointing and logging"),
    CompatFlag("--log-validation-ppl-to-tensorboard", STORE, "Write validation perplexity to "
               "tensorboard.", group="checkpointing and logging"),
    CompatFlag("--log-memory-to-tensorboard", STORE, "Write memory use to tensorboard.",
               group="checkpointing and logging"),
    CompatFlag("--log-loss-scale-to-tensorboard", STORE, "Write the loss scale to tensorboard.",
               group="checkpointing and logging"),
    CompatFlag("--log-world-size-to-tensorboard", STORE, "Write the world size to tensorboard.",
               group="checkpointing and logging"),
    CompatFlag("--timing-log-level", STORE, "Timer detail: 0 (iteration), 1, 2 (finest).",
               group="checkpointing and logging",
               argparse=dict(type=int, choices=[0, 1, 2], default=0)),
    CompatFlag("--profile", STORE, "Profile iterations --profile-step-start up to (not "
               "including) --profile-step-end on the ranks in --profile-ranks: with "
               "--use-pytorch-profiler a torch.profiler trace under --tensorboard-dir (and a "
               "table of the costliest operators on stdout), else cudaProfilerStart/Stop for an "
               "outside nsys.", group="training"),
    CompatFlag("--use-pytorch-profiler", STORE, "With --profile: use torch.profiler.",
               group="training"),
    CompatFlag("--profile-step-start", STORE, "First profiled iteration (with --profile).",
               group="training", argparse=dict(type=int, default=10)),
    CompatFlag("--profile-step-end", STORE, "Iteration at which profiling stops (with --profile).",
               group="training", argparse=dict(type=int, default=12)),
    CompatFlag("--profile-ranks", STORE, "Global ranks that profile (with --profile).",
               group="training", argparse=dict(type=int, nargs="+", default=[0])),
    CompatFlag("--manual-gc", STORE, "Disable automatic Python garbage collection; collect "
               "every --manual-gc-interval iterations.", group="training"),
    CompatFlag("--manual-gc-interval", STORE, "Iterations between manual garbage collections "
               "(0: only at checkpoints and evaluation).", group="training",
               argparse=dict(type=int, default=0)),
    CompatFlag("--lr-warmup-init", STORE, "Learning rate at the start of the warmup.",
               group="training", argparse=dict(type=float, default=0.0)),
    CompatFlag("--lr-warmup-samples", STORE, "Linear warmup in samples (with --train-samples).",
               group="training", argparse=dict(type=int, default=0)),
    CompatFlag("--lr-decay-samples", STORE, "Decay length in samples (with --train-samples; "
               "default --train-samples).", group="training", argparse=dict(type=int, default=None)),
    CompatFlag("--start-weight-decay", STORE, "Weight decay at the start (with a non-constant "
               "--weight-decay-incr-style).", group="training", argparse=dict(type=float, default=None)),
    CompatFlag("--end-weight-decay", STORE, "Weight decay at the end of training.",
               group="training", argparse=dict(type=float, default=None)),
    CompatFlag("--weight-decay-incr-style", STORE, "How the weight decay moves from "
               "--start-weight-decay to --end-weight-decay over training.", group="training",
               argparse=dict(choices=["constant", "linear", "cosine"], default="constant")),
    CompatFlag("--ddp-bucket-size", STORE, "Gradient elements per data-parallel all-reduce bucket "
               "(default 40 MB of fp32 gradients).", group="training",
               argparse=dict(type=int, default=None)),
    CompatFlag("--optimizer", STORE, "Optimizer.", group="training",
               argparse=dict(choices=["adam", "sgd"], default="adam"),
               refuse={"sgd": "only Adam (AdamW, decoupled weight decay) is built; "
                              "use --optimizer adam"}),
    CompatFlag("--dataloader-type", STORE, "Sampler over the training samples.", group="data",
               argparse=dict(choices=["single", "cyclic", "external"], default="single"),
               refuse={"cyclic": "the cyclic (random, epoch-reshuffled) sampler is not built; "
                                 "use --dataloader-type single",
                       "external": "external data loaders are not built; "
                                   "use --dataloader-type single"}),
    # --- accepted, they select what megatron_cp does anyway ---
    CompatFlag("--accumulate-allreduce-grads-in-fp32", SAME, "gradients always accumulate and "
               "are all-reduced in fp32 buffers"),
    CompatFlag("--attention-softmax-in-fp32", SAME, "the attention softmax always runs in fp32"),
    CompatFlag("--apply-query-key-layer-scaling", SAME, "it does not change the math here: the "
               "scaling only guards an fp16 softmax, and the softmax runs in fp32"),
    CompatFlag("--no-masked-softmax-fusion", SAME, _NO_FUSION),
    CompatFlag("--no-bias-gelu-fusion", SAME, _NO_FUSION),
    CompatFlag("--no-bias-dropout-fusion", SAME, _NO_FUSION),
    CompatFlag("--no-bias-swiglu-fusion", SAME, _NO_FUSION),
    CompatFlag("--no-rope-fusion", SAME, _NO_FUSION),
    CompatFlag("--no-gradient-accumulation-fusion", SAME, "weight gradients accumulate with "
               "plain PyTorch ops into the fp32 gradient buffers"),
    CompatFlag("--no-async-tensor-model-parallel-allreduce", SAME, "tensor-parallel collectives "
               "run synchronously inside their autograd functions"),
    CompatFlag("--no-persist-layer-norm", SAME, "norms come from torch, apex or Transformer "
               "Engine, chosen per device; none is the persistent kernel"),
    CompatFlag("--use-flash-attn", SAME, "attention kernels are chosen per device "
               "(PyTorch flash/SDPA on CUDA)"),
    CompatFlag("--attention-backend", SAME, "attention kernels are chosen per device "
               "(PyTorch flash/SDPA on CUDA)",
               argparse=dict(choices=["auto", "flash", "fused", "unfused", "local"], default="auto")),
    CompatFlag("--transformer-impl", SAME, "layers are megatron_cp's own PyTorch modules; norms "
               "use Transformer Engine when it is installed", argparse=dict(
                   choices=["local", "transformer_engine"], default="local")),
    CompatFlag("--use-mcore-models", SAME, "the model is Megatron-core style already"),
    CompatFlag("--use-cpu-initialization", SAME, "weights are initialised from per-parameter "
               "seeds, identical under every parallel layout, on any device"),
    CompatFlag("--empty-unused-memory-level", SAME, "the caching allocator is not emptied "
               "between steps", argparse=dict(type=int, choices=[0, 1, 2], default=0)),
    CompatFlag("--cross-entropy-loss-fusion", SAME, "the vocab-parallel cross entropy is one "
               "autograd function computed in fp32"),
    CompatFlag("--calculate-per-token-loss", SAME, "the loss is already the token-weighted mean "
               "over the whole global batch (all microbatches and DP x CP ranks)"),
    CompatFlag("--moe-grouped-gemm", SAME, "the local experts always run in one grouped matmul "
               "(torch.nn.functional.grouped_mm) where torch supports the case, else a loop"),
    CompatFlag("--moe-use-legacy-grouped-gemm", SAME, "the local experts always run in one "
               "grouped matmul (torch.nn.functional.grouped_mm) where torch supports the case"),
    CompatFlag("--moe-permute-fusion", SAME, "tokens are permuted with plain index ops; no "
               "fused permute kernel is used"),
    CompatFlag("--moe-router-fusion", SAME, "the router's top-k and softmax/sigmoid are plain "
               "PyTorch ops"),
    CompatFlag("--moe-shared-expert-overlap", SAME, "the shared expert runs after the routed "
               "experts, not overlapped with their dispatch"),
    # --- refused ---
    CompatFlag("--no-position-embedding", SAME, "no learned position table: rotary "
               "embeddings (--position-embedding-type rope) have none",
               needs=("position_embedding_type", ("rope",),
                      "turns the learned position table off, leaving the model no position "
                      "signal; add --position-embedding-type rope (rotary, no learned table)")),
    CompatFlag("--use-legacy-models", REFUSE, "the legacy model " + _NOT_BUILT +
               " (the model is Megatron-core style)"),
    CompatFlag("--vocab-extra-ids", REFUSE, "extra sentinel ids are for T5 span corruption, "
               "which GPT pretraining does not use; pass 0 or drop it",
               argparse=dict(type=int, default=0)),
    CompatFlag("--train-data-path", REFUSE, "separate train/valid/test data paths are not "
               "built; give --data-path with --split", argparse=dict(nargs="*", default=None)),
    CompatFlag("--valid-data-path", REFUSE, "separate train/valid/test data paths are not "
               "built; give --data-path with --split", argparse=dict(nargs="*", default=None)),
    CompatFlag("--test-data-path", REFUSE, "separate train/valid/test data paths are not "
               "built; give --data-path with --split", argparse=dict(nargs="*", default=None)),
    CompatFlag("--rampup-batch-size", REFUSE, "batch-size ramp-up is not built; drop it",
               argparse=dict(nargs=3, default=None)),
    CompatFlag("--wandb-project", REFUSE, "Weights & Biases is not a dependency; use "
               "--tensorboard-dir", argparse=dict(default=None)),
    CompatFlag("--wandb-exp-name", REFUSE, "Weights & Biases is not a dependency; use "
               "--tensorboard-dir", argparse=dict(default=None)),
    CompatFlag("--fp8-format", REFUSE, "FP8 training needs Transformer Engine's fp8 layers, "
               "which are not used; use --bf16", argparse=dict(choices=["e4m3", "hybrid"],
                                                              default=None)),
    CompatFlag("--qk-layernorm", REFUSE, "QK layernorm " + _NOT_BUILT),
    CompatFlag("--tp-comm-overlap", REFUSE, "it needs Transformer Engine userbuffers, which "
               "are not used; drop it"),
    CompatFlag("--fp32-residual-connection", REFUSE, "the residual stream stays in the model "
               "dtype; an fp32 residual " + _NOT_BUILT),
    CompatFlag("--deterministic-mode", REFUSE, "deterministic CUDA kernels are not enforced; "
               "drop it (CPU runs are deterministic)"),
)


def add_compat_flags(groups):
    """Add every table flag to ``groups[entry.group]`` (argparse argument groups by name)."""
    for entry in COMPAT_FLAGS:
        text = {SAME: f"Accepted: {entry.why}.", REFUSE: f"Refused: {entry.why}."}.get(
            entry.kind, entry.why)
        kwargs = dict(entry.argparse) if entry.argparse else {"action": "store_true"}
        groups[entry.group].add_argument(entry.flag, help=text.replace("%", "%%"), **kwargs)


def apply_compat_flags(args, defaults):
    """Refuse, rewrite or note the table flags given in ``args``; returns the notes.

    ``defaults(name)`` is the parser's default of argument ``name`` (``parser.get_default``);
    a flag counts as given when its value differs from its default.
    """
    notes = []
    for entry in COMPAT_FLAGS:
        value = getattr(args, entry.dest, None)
        if value == defaults(entry.dest):
            continue
        shown = entry.flag if value is True else f"{entry.flag} {_show(value)}"
        if entry.needs and getattr(args, entry.needs[0]) not in entry.needs[1]:
            raise ValueError(f"{shown}: {entry.needs[2]}")
        if entry.kind == REFUSE:
            raise ValueError(f"{shown}: {entry.why}")
        if isinstance(value, str) and value in entry.refuse:
            raise ValueError(f"{shown}: {entry.refuse[value]}")
        if entry.kind == SAME:
            notes.append(f"{shown}: {entry.why}")
        elif entry.kind == MAP:
            name, target = entry.sets
            current = getattr(args, name)
            if current not in (defaults(name), target):
                raise ValueError(f"{entry.flag} means --{name.replace('_', '-')} {target}, but "
                                 f"--{name.replace('_', '-')} {current} was given; drop one")
            setattr(args, name, target)
    return notes


def _show(value):
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
