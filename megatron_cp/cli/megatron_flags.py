"""Every Megatron-LM flag that megatron_cp does not declare elsewhere, in one table.

The census (``megatron_lm_flags.json``, written by tools/megatron_flag_census.py from
Megatron-LM's own parser at the commit it records) lists all of Megatron-LM's pretraining
flags. Each one is, in megatron_cp:

- implemented with Megatron's meaning: declared by a field of a typed config section
  (megatron_cp/config/, see setting.py), and read by the code; or
- an entry of this table, of one kind:

  - ``SAME``: accepted; megatron_cp always computes what it selects (a fp32 softmax, an
    unfused kernel, a parallel checkpoint load). Its start-up note says what megatron_cp does.
  - ``IGNORED``: accepted, though it changes something in Megatron-LM that megatron_cp does
    not do: speed, I/O, logging or memory only, never a result. Its start-up note says
    "ignored: in Megatron-LM it <what it does>"; for a memory saving, a WARNING that this run
    does not save it.

  - ``MAP``: a Megatron-LM alias, rewritten to the flag it stands for.
  - ``REFUSE``: giving it is an error naming the flag, why, and what to use instead.

Each SAME / IGNORED entry has an ``effect`` class: what the flag changes in Megatron-LM
(numerics, behaviour, memory, speed, I/O, logging; none where Megatron-LM reads it
nowhere), and ``megatron_flag_sources.json`` (tools/megatron_flag_sources.py) gives the
line where Megatron-LM reads it at the census commit. A numerics or behaviour flag is never
IGNORED: it is built (a config section's field), SAME, or refused.

An entry may also refuse some values only (``refuse={value: why}``), e.g. ``--ckpt-format
zarr``, or need another flag's value (``needs``). A flag counts as given when its value
differs from its default, which is Megatron-LM's: passing a refused flag at Megatron's
default is not refused.

The explicit entries (``COMPAT_FLAGS``) carry their own argparse spec. The grouped ones
(``AS_IS``: kind, effect, text and the flags; ``NOT_BUILT``: a reason and the flags it
covers) take theirs from the census,
so they parse exactly as Megatron-LM's parser does. tests/cli/test_megatron_flag_census.py holds
the table, the census and the parser together.
"""
import argparse
import functools
import os
from dataclasses import dataclass, field

from megatron_cp.config.census import megatron_census

SAME, IGNORED, MAP, REFUSE = "same", "ignored", "map", "refuse"
# what a flag changes in Megatron-LM (its effect class); NONE: Megatron-LM reads it nowhere
NUMERICS, BEHAVIOUR, MEMORY, SPEED, IO, LOGGING, NONE = (
    "numerics", "behaviour", "memory", "speed", "I/O", "logging", "none")
EFFECTS = (NUMERICS, BEHAVIOUR, MEMORY, SPEED, IO, LOGGING, NONE)
# an ignored flag may only change what needs no result to change
IGNORABLE = (MEMORY, SPEED, IO, LOGGING)


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
    aliases: tuple = ()  # Megatron-LM's other spellings of the flag
    effect: str = ""  # SAME / IGNORED: what it changes in Megatron-LM (EFFECTS)

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
    CompatFlag("--no-weight-decay-cond-type", MAP, "Deprecated spelling of "
               "--apply-wd-to-qk-layernorm (its one value).", group="training",
               argparse=dict(choices=["apply_wd_to_qk_layernorm"], default=None),
               sets=("apply_wd_to_qk_layernorm", True)),
    CompatFlag("--log-throughput", SAME, "the log line always shows throughput (TFLOP/s per "
               "GPU, tokens per second)", effect=LOGGING),
    CompatFlag("--timing-log-level", SAME, "level 0: the log line times the whole iteration",
               group="checkpointing and logging",
               argparse=dict(type=int, choices=[0, 1, 2], default=0),
               refuse={1: "per-phase timers (level 1 and 2) are not built; the log line times "
                          "the whole iteration (level 0) and --profile traces the phases",
                       2: "per-phase timers (level 1 and 2) are not built; the log line times "
                          "the whole iteration (level 0) and --profile traces the phases"},
               effect=LOGGING),
    CompatFlag("--dataloader-type", SAME, "samples are read in order by the single sampler",
               group="data",
               argparse=dict(choices=["single", "cyclic", "external"], default="single"),
               refuse={"cyclic": "the cyclic (random, epoch-reshuffled) sampler is not built; "
                                 "use --dataloader-type single",
                       "external": "external data loaders are not built; "
                                   "use --dataloader-type single"}, effect=NUMERICS),
    # --- accepted, they select what megatron_cp does anyway ---
    CompatFlag("--accumulate-allreduce-grads-in-fp32", SAME, "gradients accumulate and are "
               "all-reduced in fp32 buffers (unless --main-grads-dtype bf16, which Megatron-LM "
               "refuses with it, and so do we)", effect=NUMERICS),
    CompatFlag("--use-torch-optimizer-for-cpu-offload", SAME, "with --optimizer adam "
               "Megatron-LM's hybrid optimizer sets its classes back (Transformer Engine's "
               "FusedAdam on the GPU, torch's AdamW on the host) after reading it, so it "
               "changes nothing there; here the host part is torch's AdamW too",
               effect=SPEED),
    CompatFlag("--attention-softmax-in-fp32", SAME, "the attention softmax always runs in fp32",
               effect=NUMERICS),
    CompatFlag("--apply-query-key-layer-scaling", SAME, "it does not change the math here: the "
               "scaling only guards an fp16 softmax, and the softmax runs in fp32",
               effect=NUMERICS),
    CompatFlag("--no-masked-softmax-fusion", SAME, _NO_FUSION, effect=SPEED),
    CompatFlag("--openai-gelu", SAME, "Megatron-LM reads it nowhere at this commit: its GELU is "
               "the bias-GELU fusion's tanh approximation (the default with biases) or the "
               "exact erf one (--no-bias-gelu-fusion, --disable-bias-linear), as here",
               group="model", effect=NONE),
    CompatFlag("--use-te-activation-func", SAME, _NO_FUSION, group="model",
               needs=("swiglu", (True,),
                      "Megatron-LM refuses it with the bias-GELU fusion and with --squared-relu, "
                      "and otherwise computes Transformer Engine's tanh GELU, which is not built; "
                      "drop it (the default bias-GELU fusion computes that tanh GELU)"),
               effect=NUMERICS),
    CompatFlag("--no-bias-dropout-fusion", SAME, _NO_FUSION, effect=SPEED),
    CompatFlag("--no-bias-swiglu-fusion", SAME, _NO_FUSION, effect=SPEED),
    CompatFlag("--no-rope-fusion", SAME, _NO_FUSION, effect=SPEED),
    CompatFlag("--no-gradient-accumulation-fusion", SAME, "weight gradients accumulate with "
               "plain PyTorch ops into the fp32 gradient buffers", effect=SPEED),
    CompatFlag("--no-async-tensor-model-parallel-allreduce", SAME, "tensor-parallel collectives "
               "run synchronously inside their autograd functions", effect=SPEED),
    CompatFlag("--no-persist-layer-norm", SAME, "norms come from torch, apex or Transformer "
               "Engine, chosen per device; none is the persistent kernel", effect=SPEED),
    CompatFlag("--use-flash-attn", SAME, "Megatron-LM reads it nowhere at this commit; "
               "attention kernels are chosen per device (cuDNN or flash SDPA on CUDA)",
               effect=NONE),
    CompatFlag("--attention-backend", IGNORED, "selects the core-attention kernel (flash, fused, "
               "unfused, local; here it is chosen per device; the same attention)",
               argparse=dict(choices=["auto", "flash", "fused", "unfused", "local"], default="auto"),
               effect=SPEED),
    CompatFlag("--transformer-impl", IGNORED, "selects Transformer Engine's or the local layer "
               "implementation (here megatron_cp's own PyTorch layers run either way; norms use "
               "Transformer Engine when it is installed)", argparse=dict(
                   choices=["local", "transformer_engine", "inference_optimized"],
                   default="transformer_engine"),
               refuse={"inference_optimized": "Megatron-LM's inference-only layers are not "
                                              "built; drop it (the same layers generate text: "
                                              "tools/run_text_generation.py)"}, effect=SPEED),
    CompatFlag("--use-mcore-models", SAME, "the model is Megatron-core style already",
               effect=NONE),
    CompatFlag("--use-cpu-initialization", SAME, "weights are initialised from per-parameter "
               "seeds, identical under every parallel layout, on any device", effect=NUMERICS),
    CompatFlag("--cross-entropy-loss-fusion", IGNORED, "fuses the vocab-parallel cross entropy "
               "into one kernel (here the plain fp32 autograd function computes the same loss)",
               effect=SPEED),
    CompatFlag("--moe-grouped-gemm", SAME, "the local experts always run in one grouped matmul "
               "(torch.nn.functional.grouped_mm) where torch supports the case, else a loop",
               effect=SPEED),
    CompatFlag("--moe-use-legacy-grouped-gemm", IGNORED, "runs the local experts through the "
               "legacy GroupedGEMM package instead of Transformer Engine's (here torch grouped_mm "
               "computes the same)", effect=SPEED),
    CompatFlag("--moe-permute-fusion", IGNORED, "permutes tokens to experts with Transformer "
               "Engine's fused kernels (here plain index ops move the same tokens)", effect=SPEED),
    CompatFlag("--moe-router-fusion", IGNORED, "runs the router's top-k and score function as one "
               "fused kernel (here plain PyTorch ops compute the same routing)", effect=SPEED),
    CompatFlag("--moe-shared-expert-overlap", IGNORED, "overlaps the shared expert with the "
               "routed experts' token exchange (here it runs after them)", effect=SPEED),
    # --- refused ---
    CompatFlag("--no-position-embedding", SAME, "no learned position table: rotary "
               "embeddings (--position-embedding-type rope) have none",
               needs=("position_embedding_type", ("rope",),
                      "is Megatron-LM's deprecated spelling, accepted only beside "
                      "--position-embedding-type rope (no learned table to turn off); choose "
                      "the positions with --position-embedding-type and drop it"),
               effect=NUMERICS),
    CompatFlag("--mla-down-proj-fusion", IGNORED, "fuses multi-latent attention's query and "
               "key/value down projections into one matmul (here two plain matmuls compute the "
               "same values)",
               group="model",
               needs=("multi_latent_attention", (True,),
                      "fuses multi-latent attention's down projections; add "
                      "--multi-latent-attention or drop it"), effect=SPEED),
    CompatFlag("--yarn-correction-range-round-to-int", SAME, "YaRN's ramp ends are rounded to "
               "whole channel pairs by default (--no-yarn-correction-range-round-to-int turns "
               "it off)", group="model", argparse=dict(action="store_true", default=None),
               needs=("no_yarn_correction_range_round_to_int", (False,),
                      "contradicts --no-yarn-correction-range-round-to-int; give one"),
               effect=NUMERICS),
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
    CompatFlag("--rampup-batch-size", REFUSE, "Megatron-LM deprecated it and ignores it (the "
               "batch stays --global-batch-size); give the ramp-up as --step-batch-size-schedule "
               "(e.g. '0:16 1M:32 2M:64', thresholds in tokens)",
               argparse=dict(nargs=3, type=int, default=None)),
    CompatFlag("--fp8-interval", SAME, "Megatron-LM passes it only to a Transformer Engine "
               "older than 1.8, which recomputed delayed scales every this many steps; newer "
               "ones ignore it, and scales move every step here as there",
               argparse=dict(type=int, default=1), effect=NUMERICS),
    CompatFlag("--fp32-residual-connection", REFUSE, "the residual stream stays in the model "
               "dtype; an fp32 residual " + _NOT_BUILT),
    CompatFlag("--no-create-attention-mask-in-dataloader", SAME, "no attention-mask tensor "
               "is ever built: attention is causal, and documents are kept apart from their "
               "boundaries only with --reset-attention-mask", group="data",
               needs=("reset_attention_mask", (False,),
                      "Megatron-LM then drops --reset-attention-mask and attends across "
                      "documents, while megatron_cp keeps them apart; drop one of the two"),
               effect=MEMORY),
    # --- Megatron-FSDP's knobs (--use-megatron-fsdp runs on FSDP2 / the distributed
    # optimizer: megatron_cp/distributed/fsdp.py, which also holds their rules) ---
    CompatFlag("--megatron-fsdp-version", SAME, "version 1, Megatron-FSDP's default, is the one "
               "mapped onto megatron_cp's FSDP2 and distributed optimizer",
               argparse=dict(type=int, choices=[1, 2], default=1),
               refuse={2: "Megatron-FSDP v2 (its experimental fully_shard rewrite) is not "
                          "built; drop it (version 1 computes the same)"}, effect=BEHAVIOUR),
    CompatFlag("--fsdp-manual-registration", REFUSE, "it registers Megatron-FSDP's buffers "
               "with NCCL user buffers, which need --use-nccl-ub (not built; Megatron-LM "
               "refuses it without); drop it"),
    CompatFlag("--outer-dp-sharding-strategy", SAME, "it shards over the outer group of "
               "Megatron-FSDP's hybrid sharding (HSDP, --num-distributed-optimizer-instances "
               "> 1), which this run does not have: nothing changes, as in Megatron-LM",
               argparse=dict(choices=["no_shard", "optim"], default="no_shard"), effect=MEMORY),
    CompatFlag("--enable-full-sharding-in-hsdp", SAME, "Megatron-LM reads it nowhere at this "
               "commit (it names full sharding in Megatron-FSDP's hybrid sharding, HSDP)",
               effect=NONE),
    CompatFlag("--fsdp-double-buffer", IGNORED, "double-buffers Megatron-FSDP's communication "
               "memory, reusing its all-gather and reduce-scatter buffers (FSDP2 allocates its "
               "own)", effect=MEMORY),
    CompatFlag("--megatron-fsdp-max-pool-double-buffer", IGNORED, "double-buffers "
               "Megatron-FSDP's communication memory with a pool sized for its largest unit "
               "(FSDP2 allocates its own)", effect=MEMORY),
    CompatFlag("--fsdp-db-use-persist-buf-on-alloc-fail", IGNORED, "keeps a unit's "
               "communication buffer persistent when its double buffer cannot be allocated "
               "(FSDP2 allocates its own)", effect=MEMORY),
    CompatFlag("--suggested-communication-unit-size", IGNORED, "sizes Megatron-FSDP's "
               "communication buckets and its all-gather prefetch (FSDP2 gathers and reduces one "
               "layer at a time, prefetching the next)", argparse=dict(type=int, default=None),
               effect=SPEED),
    CompatFlag("--megatron-fsdp-enable-fine-grained-param-gather", IGNORED, "gathers each "
               "submodule's params apart, to overlap the gathers with compute (FSDP2 gathers "
               "one layer at a time)", effect=SPEED),
    CompatFlag("--keep-fp8-transpose-cache", IGNORED, "keeps FP8 weights' transpose caches "
               "between forward and backward under Megatron FSDP (here each FP8 weight copy is "
               "made in forward and transposed in backward)", effect=SPEED),
    CompatFlag("--megatron-fsdp-main-params-dtype", SAME, "fp32 main params are what the "
               "optimizer steps",
               argparse=dict(choices=["fp32", "bf16", "fp16", "auto"], default="fp32"),
               refuse={d: "the optimizer steps fp32 main params here; main params in the "
                          "model's dtype are not built, drop it" for d in ("bf16", "fp16", "auto")},
               effect=NUMERICS),
    CompatFlag("--megatron-fsdp-main-grads-dtype", SAME, "gradients accumulate in fp32 main "
               "grads (Megatron-FSDP's default, auto, would take the model's dtype)",
               argparse=dict(choices=["fp32", "bf16", "fp16", "auto"], default="auto"),
               refuse={d: "gradients accumulate in fp32 here; bf16/fp16 main grads are not "
                          "built, drop it" for d in ("bf16", "fp16")}, effect=NUMERICS),
    CompatFlag("--megatron-fsdp-grad-comm-dtype", SAME, "gradients are reduced in fp32 "
               "(Megatron-FSDP's default, auto, would take the main grads' dtype)",
               argparse=dict(choices=["fp32", "fp16", "bf16", "auto"], default="auto"),
               refuse={d: "gradients are reduced in fp32 here; a bf16/fp16 reduction is not "
                          "built, drop it" for d in ("bf16", "fp16")}, effect=NUMERICS),
)


# ----- the rest of Megatron-LM's flags, grouped by reason -----------------------------------
# Each flag's argparse spec comes from the census. A flag here that changes what is computed,
# logged or saved is refused until it is built; AS_IS holds only flags that change none of it.

AS_IS = (  # (kind, effect, text, flags): SAME (text: what megatron_cp does, which is what the
    # flag selects) or IGNORED (text: what the flag does in Megatron-LM, which this run does not)
    (IGNORED, SPEED, "selects and tunes the flex dispatcher's token-exchange kernels (DeepEP, "
     "HybridEP, NCCL EP: GPU libraries); megatron_cp's all-to-all dispatcher exchanges the same "
     "tokens",
     ("--moe-enable-deepep", "--moe-flex-dispatcher-backend",
      "--moe-permute-fusion-into-hybridep", "--moe-hybridep-pad-uneven-dispatch-inputs",
      "--moe-flex-dispatcher-num-sms", "--moe-deepep-num-sms", "--moe-hybridep-num-sms",
      "--moe-hybridep-num-blocks-permute", "--moe-hybridep-num-blocks-unpermute",
      "--moe-hybridep-num-sms-preprocessing",)),
    (IGNORED, SPEED, "turns on experimental code paths, in training the MoE dispatchers' fused "
     "(Triton) permutation kernels, which compute what plain index ops compute",
     ("--enable-experimental",)),
    (SAME, NONE, "Megatron-LM reads it nowhere at this commit; Muon's Newton-Schulz Gram "
     "matrix X X^T is one plain matmul",
     ("--muon-use-syrk",)),
    (IGNORED, SPEED, "lays dist_muon's state out per parameter instead of layer-wise in the "
     "distributed optimizer's buckets; the layout changes the order of reductions only",
     ("--no-use-layer-wise-param-layout",)),
    (IGNORED, SPEED, "sends pipeline P2P over another backend (nccl or ucc); here it goes over "
     "the backend --distributed-backend picks",
     ("--pipeline-model-parallel-comm-backend",)),
    (IGNORED, SPEED, "picks the fused cross-entropy kernel (native or Transformer Engine's); "
     "here megatron_cp's fp32 autograd function computes the same loss",
     ("--cross-entropy-fusion-impl",)),
    (IGNORED, SPEED, "overlaps expert-parallel all-to-alls with another microbatch's compute, "
     "on a high-priority stream; here they run inline with their layer",
     ("--overlap-moe-expert-parallel-comm", "--high-priority-a2a-comm-stream",)),
    (IGNORED, MEMORY, "frees attention's activations early while the expert-parallel "
     "all-to-all overlaps",
     ("--ep-overlap-early-attn-memory-release",)),
    (IGNORED, SPEED, "defers weight-gradient GEMMs (or moves them beside the expert dispatch) "
     "to overlap communication; here weight gradients are computed in the same backward pass",
     ("--delay-wgrad-compute", "--overlap-dispatch-backward-with-experts-wgrad",
      "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit",)),
    (IGNORED, SPEED, "sends pipeline P2P with a custom ring_exchange kernel; here batched "
     "torch.distributed isend/irecv",
     ("--use-ring-exchange-p2p",)),
    (IGNORED, SPEED, "overlaps P2P with compute in the warmup and flush phases of the pipeline "
     "schedule",
     ("--overlap-p2p-communication-warmup-flush",)),
    (IGNORED, SPEED, "pins the FlashAttention generation (2 or 3) for core attention; here the "
     "kernel is chosen per device",
     ("--flash-attention-version",)),
    (IGNORED, SPEED, "uses a fused kernel (weighted squared ReLU, residual + RMSNorm, or "
     "Transformer Engine's op fuser); here the plain PyTorch ops compute the same",
     ("--use-fused-weighted-squared-relu", "--fused-residual-rmsnorm",
      "--use-transformer-engine-op-fuser",)),
    (IGNORED, SPEED, "runs the shared expert or dense MLP through Transformer Engine's "
     "GroupedLinear; here plain linear layers compute the same",
     ("--use-grouped-gemm-for-shared-expert", "--use-grouped-gemm-for-dense-mlp",)),
    (IGNORED, SPEED, "stores the local experts' weights as one Transformer Engine "
     "GroupedTensor parameter; here megatron_cp's expert weight layout runs torch grouped_mm",
     ("--moe-use-grouped-tensor", "--moe-single-grouped-weight", "--moe-single-grouped-bias",)),
    (IGNORED, MEMORY, "frees the embedding's sequence-parallel scatter output instead of "
     "cloning it (here the clone is kept, as by default)",
     ("--no-clone-scatter-output-in-embedding",)),
    (SAME, IO, "a --load tells the formats apart: an iteration folder with a DCP .metadata "
     "file loads as torch_dist, anything else as torch",
     ("--auto-detect-ckpt-format",)),
    (SAME, NONE, "Megatron-LM reads it nowhere at this commit (fully parallel saves are its "
     "default); torch_dist saves go through torch.distributed.checkpoint, every rank writing "
     "its own shards in parallel",
     ("--ckpt-fully-parallel-save",)),
    (IGNORED, SPEED, "saves without spreading the replicated shards over the data-parallel "
     "ranks, or over another process group; here every rank writes its shards in parallel",
     ("--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-save-process-group",)),
    (SAME, IO, "torch_dist loads go through torch.distributed.checkpoint: every rank reads "
     "only the chunks it needs, in parallel, straight from storage",
     ("--ckpt-fully-parallel-load",)),
    (IGNORED, SPEED, "tunes the fully parallel load's exchange of chunks between ranks "
     "(algorithm, per-rank objects, process group)",
     ("--ckpt-fully-parallel-load-exchange-algo",
      "--ckpt-fully-parallel-load-per-rank-objects",
      "--ckpt-fully-parallel-load-process-group",)),
    (IGNORED, SPEED, "reuses the previous save's structure or a cached process-group layout "
     "to plan a save or load faster",
     ("--ckpt-assume-constant-structure", "--ckpt-pg-tensors-cache-path",)),
    (IGNORED, SPEED, "skips the check that the shards of a load cover every tensor once (here "
     "the load always checks every indexed file)",
     ("--no-ckpt-load-validate-sharding-integrity",)),
    (SAME, IO, "torch_dist optimizer state is always saved as canonical full tensors, "
     "reshardable across TP/PP/CP/DP/EP, each rank writing its own shards without gathering",
     ("--dist-ckpt-optim-fully-reshardable",
      "--distrib-optim-fully-reshardable-mem-efficient",)),
    (SAME, IO, "tokenizer files are never copied into the checkpoint folder",
     ("--no-save-tokenizer-assets",)),
    (SAME, IO, "torch_dist checkpoints hold parameters and persistent buffers only; no "
     "Transformer Engine _extra_state is ever written",
     ("--ckpt-drop-redundant-extra-state",)),
    (IGNORED, SPEED, "runs an async save in a worker of another kind, count or OS priority; "
     "here one background thread of the training process writes it",
     ("--async-strategy", "--use-persistent-ckpt-worker", "--async-ckpt-cpu-priority",
      "--async-ckpt-io-priority", "--dist-ckpt-workers",)),
    (IGNORED, SPEED, "hands an async save's tensors to its worker through CPU shared memory "
     "instead of CUDA IPC; here every tensor is copied to CPU memory before the writer starts",
     ("--async-ckpt-use-cpu-shm",)),
    (SAME, BEHAVIOUR, "tokenizer flags given on the command line always take precedence over "
     "the ones saved in the checkpoint",
     ("--no-use-tokenizer-model-from-checkpoint-args",)),
    (SAME, IO, "the local rank is read from the LOCAL_RANK environment variable that torchrun "
     "sets",
     ("--local-rank",)),
    (IGNORED, SPEED, "configures NCCL communicators from a file or gives some groups "
     "high-priority streams",
     ("--nccl-communicator-config-path", "--high-priority-stream-groups",)),
    (SAME, SPEED, "no TorchScript/JIT fuser is used; plain PyTorch ops run unless "
     "--torch-compile is given",
     ("--disable-jit-fuser",)),
    (IGNORED, SPEED, "aligns the launch of gradient reductions and parameter all-gathers "
     "across pipeline stages, overlaps the gather with the optimizer step, or gives it a "
     "group of its own; here each launches when ready",
     ("--no-align-grad-reduce", "--no-align-param-gather",
      "--overlap-param-gather-with-optimizer-step", "--create-all-gather-group",)),
    (IGNORED, SPEED, "sets the number of gradient buckets or pads them for NCCL bus "
     "bandwidth; here buckets are sized by --ddp-bucket-size",
     ("--ddp-num-buckets", "--ddp-pad-buckets-for-high-nccl-busbw",)),
    (SAME, NUMERICS, "gradients are always accumulated and reduced in fp32 for every "
     "parameter",
     ("--ddp-reduce-scatter-with-fp32-accumulation",
      "--ddp-param-name-patterns-for-fp32-local-accumulation",)),
    (SAME, NUMERICS, "the gradient reduction is an fp32 SUM of gradients scaled before the "
     "collective; averaging inside it (ReduceOp.AVG) sums the same fp32 values",
     ("--ddp-average-in-collective", "--no-gradient-reduce-div-fusion",)),
    (IGNORED, SPEED, "synchronises the CPU with the GPU every N iterations to bound how far "
     "it runs ahead",
     ("--train-sync-interval",)),
    (IGNORED, SPEED, "skips the manual garbage collection around evaluation",
     ("--no-manual-gc-eval",)),
    (SAME, NONE, "Megatron-LM reads it nowhere at this commit; dataset index caches under "
     "--data-cache-path are reused whenever present",
     ("--dataloader-fast-cache-load",)),
    (SAME, NONE, "Megatron-LM reads it nowhere at this commit; the index .npy files are "
     "opened with np.load(mmap_mode='r'), so pages are read lazily on first access",
     ("--dataloader-defer-npy-index-mmap",)),
    (IGNORED, SPEED, "builds the datasets with several threads per rank",
     ("--num-dataset-builder-threads",)),
    (IGNORED, LOGGING, "sizes the tensorboard writer's event queue (when events are flushed, "
     "not what is written)",
     ("--tensorboard-queue-size",)),
    (SAME, LOGGING, "megatron_cp's timers never insert a barrier before measuring",
     ("--no-barrier-with-level-1-timing",)),
    (SAME, NONE, "Megatron-LM reads it nowhere (a deprecated no-op); megatron_cp never reads "
     "paths through the Multi-Storage Client",
     ("--disable-msc",)),
    (SAME, LOGGING, "megatron_cp sends nothing to NVIDIA's one-logger service",
     ("--no-one-logger",)),
    (IGNORED, SPEED, "stops splitting --tp-comm-overlap's all-gather / reduce-scatter into "
     "chunks pipelined with the GEMM (Transformer Engine before 1.6); the ring here always "
     "pipelines chunk by chunk",
     ("--no-tp-comm-split-ag", "--no-tp-comm-split-rs",)),
    (IGNORED, SPEED, "bootstraps Transformer Engine's userbuffers over another backend; here "
     "--tp-comm-overlap's ring sends through the TP process group's own backend",
     ("--tp-comm-bootstrap-backend",)),
)

NOT_BUILT = (  # (why, flags): refused, with what to use instead
    ("generalized-TP weight rematerialization sharding is not built; shard with "
     "--tensor-model-parallel-size / --expert-tensor-parallel-size",
     ("--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight-shards",
      "--gtp-remat-opt-in-modules",)),
    ("skipping weight initialization is not built; weights are always initialised (and "
     "overwritten by --load); drop it",
     ("--no-initialization",)),
    ("MTP layers live on the last pipeline stage, with the output layer they share; an MTP "
     "stage of its own is not built: put the layout's m's in the last stage, drop the flag",
     ("--mtp-standalone",)),
    ("detached MTP heads and MTP hidden-state mixing are not built; drop them (MTP trains "
     "with gradients through the shared embedding, output layer and decoder)",
     ("--mtp-detach-heads", "--mtp-hsm",)),
    ("--mtp-hybrid-override-pattern is for Megatron-LM's hybrid (Mamba) models, which are not "
     "built; GPT's MTP layer takes the last decoder layer's kind: drop it",
     ("--mtp-hybrid-override-pattern",)),
    ("this attention variant (off-by-one/learnable softmax, QK L2 norm, QK clip) is not "
     "built; drop it",
     ("--softmax-type", "--qk-l2-norm", "--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold",)),
    ("post-LN residual ordering is not built; layers are pre-LN; drop it",
     ("--apply-residual-connection-post-layernorm",)),
    ("a bias on QKV alone is not built; --disable-bias-linear switches all linear biases "
     "together",
     ("--add-qkv-bias",)),
    ("GLU offset and activation clamping are not built; SwiGLU/GELU run unmodified; drop "
     "them",
     ("--glu-linear-offset", "--activation-func-clamp-value",)),
    ("multimodal rope sections are not built; drop it",
     ("--mrope-section",)),
    ("DeepSeek sparse attention and its indexer are not built yet; drop them",
     ("--dsa-indexer-n-heads", "--dsa-indexer-head-dim",
      "--dsa-indexer-topk", "--dsa-indexer-topk-freq", "--dsa-indexer-skip-topk-offset",
      "--dsa-indexer-loss-coeff", "--dsa-indexer-use-sparse-loss", "--dsa-kernel-backend",
      "--dsa-indexer-rope-interleaved", "--no-dsa-indexer-rotate-activation",
      "--no-dsa-indexer-scoring-relu", "--dsa-indexer-k-norm-epsilon",
      "--dsa-indexer-k-norm-fp32",)),
    ("Gated DeltaProduct / Mamba hybrid layers (Megatron-LM's hybrid model) are not built "
     "yet; Gated DeltaNet layers come with --experimental-attention-variant gdn; drop them",
     ("--is-hybrid-model",
      "--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads",
      "--gdp-num-householder", "--disable-mamba-mem-eff-path", "--gdp-cutedsl-kernel",
      "--gdp-num-chunk-states-to-recompute",)),
    ("a separate embedding init std (and its weight-decay exemption) is not built; all "
     "weights use --init-method-std; drop it",
     ("--embedding-init-method-std",)),
    ("turning off reduced-precision bf16 matmul accumulation is not built; PyTorch's default "
     "is kept; drop it",
     ("--disable-bf16-reduced-precision-matmul",)),
    ("a custom FP8 quantizer (--fp8-recipe custom, Transformer Engine's quantizer factory) is "
     "not built; use --fp8-recipe tensorwise, delayed, blockwise or mxfp8",
     ("--fp8-quantizer-factory",)),
    ("FP4 needs Transformer Engine's NVFP4 recipe, which megatron_cp does not use; train in "
     "--bf16",
     ("--fp4-format", "--fp4-recipe", "--fp4-quantizer-factory",)),
    ("kitchen attention needs NVIDIA's Kitchen quantization extension, which megatron_cp "
     "does not use; drop it",
     ("--use-kitchen-attention", "--kitchen-attention-backend",)),
    ("block-interleaved GLU weight layout is not built; gate and linear halves are "
     "concatenated; drop it",
     ("--moe-shared-expert-glu-interleave-size", "--moe-mlp-glu-interleave-size",)),
    ("MoE routing replay is not built; routes are recomputed every forward; drop it",
     ("--moe-enable-routing-replay",)),
    ("forced (random-logit or random-bias) routing for benchmarks is not built; drop it",
     ("--moe-router-force-load-balancing", "--moe-router-force-biased",)),
    ("the NCCL EP dispatcher's fixed receive buffers (zero-copy, per-rank capacity) are "
     "not built; drop it (flex runs megatron_cp's all-to-all dispatcher)",
     ("--moe-ncclep-zero-copy", "--moe-expert-rank-capacity-factor",)),
    ("MXFP8 dispatch/combine payloads need Transformer Engine and the NCCL EP dispatcher, "
     "which are not used; drop it",
     ("--moe-dispatch-fwd-dtype", "--moe-combine-bwd-dtype",)),
    ("applying router probs to expert inputs is not built; probs scale the expert outputs; "
     "drop it",
     ("--moe-apply-probs-on-input",)),
    ("MoE latent projections are not built; drop it",
     ("--moe-latent-size",)),
    ("paged stashing of expert activations (custom CUDA kernels, overflow reruns) is not "
     "built; drop it",
     ("--moe-paged-stash", "--moe-paged-stash-page-size",
      "--moe-paged-stash-buffer-size-factor-cuda", "--moe-paged-stash-buffer-size-factor-cpu",)),
    ("CUDA graph capture is not built; every step runs eagerly; drop it",
     ("--enable-cuda-graph", "--cuda-graph-warmup-steps", "--external-cuda-graph",
      "--cuda-graph-impl", "--inference-cuda-graph-scope", "--delay-offload-until-cuda-graph",
      "--moe-pad-experts-for-cuda-graph-inference",)),
    ("manifold-constrained hyper-connections (mHC residual streams) are not built; drop them",
     ("--enable-mhc-connections", "--mhc-num-residual-streams", "--mhc-sinkhorn-iterations",
      "--mhc-init-gating-factor", "--mhc-recompute-layer-num",)),
    ("dumping entry-point configs to a directory is not built; the arguments are printed at "
     "start-up and saved in checkpoints; drop it",
     ("--config-logger-dir",)),
    ("this is for Megatron's inference server; megatron_cp generates with "
     "tools/run_text_generation.py; drop it",
     ("--flash-decode", "--nccl-all-reduce-for-prefill", "--inference-fuse-tp-communication",
      "--inference-disable-triton-nvls-kernels", "--inference-grouped-gemm-backend",
      "--inference-moe-disable-fused-quant-kernels", "--inference-moe-token-dispatcher-type",
      "--mlp-chunks-for-prefill",)),
    ("symmetric all-reduce needs NCCL symmetric memory / multimem, which megatron_cp does "
     "not use; drop it",
     ("--symmetric-ar-type",)),
    ("batch-invariant kernels change the numerics and are not built; drop them",
     ("--batch-invariant-mode", "--batch-invariant-backend",)),
    ("dumping params, activations, routing metadata or gradients to extra files is not "
     "built; drop it",
     ("--save-params-interval", "--save-activations-interval",
      "--save-tokens-per-expert-interval", "--save-wgrads-interval", "--save-dgrads-interval",)),
    ("without the optimizer, fp32 main params are rebuilt from the loaded model weights; "
     "reading them from the checkpoint is not built",
     ("--load-main-params-from-ckpt",)),
    ("non-persistent / local checkpoints and their replication are not built; use "
     "--save-interval with --save",
     ("--non-persistent-save-interval", "--non-persistent-ckpt-type",
      "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-dir",
      "--non-persistent-local-ckpt-algo", "--replication", "--replication-jump",
      "--replication-factor",)),
    ("a separate pretrained-checkpoint path is not built; use --load DIR --finetune",
     ("--pretrained-checkpoint",)),
    ("overriding the loaded iteration (and replaying data from it) is not built; drop it",
     ("--override-ckpt-iteration",)),
    ("copying parallel sizes from the checkpoint is not built; give the TP/PP/CP/EP sizes on "
     "the command line",
     ("--use-mp-args-from-checkpoint-args",)),
    ("in-run checkpoint conversion is not built; convert offline with "
     "tools/checkpoint_convert.py",
     ("--ckpt-convert-format", "--ckpt-convert-save",)),
    ("the legacy Megatron distributed-optimizer checkpoint layout is not read; drop it",
     ("--ckpt-convert-update-legacy-dist-opt-format",)),
    ("only PyTorch's own checkpoint cache files are used; writing a DCP distribution cache "
     "is not built, drop it",
     ("--ckpt-pg-tensors-cache-create",)),
    ("the pre-Megatron-Core-0.14 checkpoint save format is not built; drop it",
     ("--dist-ckpt-save-pre-mcore-014",)),
    ("deprecated Megatron spellings; use --ckpt-format torch_dist",
     ("--use-dist-ckpt", "--dist-ckpt-format",)),
    ("deferred model-parallel initialisation for an external DDP manager is not built; drop "
     "it",
     ("--lazy-mpu-init",)),
    ("it needs NVIDIA SHARP (InfiniBand in-network reductions), which is not used; drop it",
     ("--use-sharp", "--sharp-enabled-group",)),
    ("the NCCL flight recorder is not configured by megatron_cp; set the "
     "TORCH_NCCL_*/TORCH_FR_* environment variables yourself",
     ("--flight-recorder-dump-path", "--flight-recorder-trace-buffer-size",
      "--no-flight-recorder-dump-on-timeout", "--flight-recorder-include-stack-trace",
      "--no-flight-recorder-include-only-active", "--no-flight-recorder-extra-dump-on-exec",)),
    ("deprecated Megatron spelling; use --tensor-model-parallel-size",
     ("--model-parallel-size",)),
    ("generalized-TP (GTP) weight rematerialization is not built; drop it",
     ("--gtp-remat-reduce-scatter-with-fp32-accumulation",)),
    ("it needs NCCL user-buffer / symmetric-memory registration, which is not used; drop it",
     ("--use-nccl-ub", "--disable-symmetric-registration", "--gtp-remat-nccl-ub",
      "--gtp-expert-remat-nccl-ub",)),
    ("a fake process group skips all communication and so changes every result; it is not "
     "built, drop it",
     ("--fake-process-group",)),
    ("shrinking the global batch to fit micro batch x DP is not built; give a "
     "--global-batch-size divisible by micro batch x DP (or a --step-batch-size-schedule)",
     ("--decrease-batch-size-if-needed",)),
    ("GPU sniff tests (timed GEMMs, all-to-all and send/recv compared across ranks) are not "
     "built; drop it (--check-weight-hash-across-dp-replicas-interval compares the replicas)",
     ("--gpu-sniff-test-interval",)),
    ("only SIGTERM triggers the --exit-signal-handler save-and-exit; other signals and "
     "dataloader/training-specific handlers are not built",
     ("--exit-signal", "--exit-signal-handler-for-dataloader",
      "--exit-signal-handler-for-training",)),
    ("deprecated Megatron spelling; use --micro-batch-size",
     ("--batch-size",)),
    ("it tunes Transformer Engine userbuffers (SMs, splits, method per GEMM), which are not "
     "used: --tp-comm-overlap's ring has no such settings; drop it",
     ("--tp-comm-overlap-cfg",)),
    ("deprecated Megatron spelling; use --recompute-granularity full --recompute-method "
     "uniform",
     ("--checkpoint-activations",)),
    ("it needs CUDA graphs, which are not used; drop it",
     ("--optimizer-cuda-graph",)),
    ("writing a param-to-param-group map file is not built; drop it",
     ("--dump-param-to-param-group-map",)),
    ("training phases are not built; drop it",
     ("--phase-transition-iterations",)),
    ("reading data arguments from a file is not built; pass the blend directly with "
     "--data-path",
     ("--data-args-path", "--per-split-data-args-path",)),
    ("precomputed per-dataset sequence counts are not read; drop it (counts come from the "
     ".idx files)",
     ("--per-dataset-sequences-path",)),
    ("use --seq-length / --num-layers, which Megatron treats these as for GPT",
     ("--encoder-seq-length", "--encoder-num-layers",)),
    ("encoder-decoder (T5/BERT) models and their masking/sampling options are not built; "
     "drop them",
     ("--decoder-seq-length", "--sample-rate", "--mask-prob", "--short-seq-prob",
      "--decoder-num-layers", "--relative-attention-num-buckets",
      "--relative-attention-max-distance", "--bert-no-binary-head",)),
    ("object-storage (S3/MSC) data paths are not built; use local files",
     ("--object-storage-cache-path",)),
    ("changing the blended-dataset sample surplus changes the sample order; drop it",
     ("--mid-level-dataset-surplus",)),
    ("pad tokens are not handled this way (changes the loss mask); drop it",
     ("--allow-ambiguous-pad-tokens",)),
    ("sliding-window attention is not built; drop it",
     ("--window-size", "--window-attn-skip-freq",)),
    ("per-layer RoPE skipping (NoPE layers) is not built; drop it (rotary turns every "
     "layer's queries and keys)",
     ("--no-rope-freq",)),
    ("quick GEGLU is not built; use the default GELU, --no-bias-gelu-fusion (exact GELU), "
     "--swiglu or --squared-relu",
     ("--quick-geglu",)),
    ("the ONNX-export workarounds are not built; drop it",
     ("--onnx-safe",)),
    ("heterogeneous per-layer architectures are not built; drop it",
     ("--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json",)),
    ("Mamba hybrid layers are not built yet; drop it",
     ("--mamba-training-ssm-states-dtype",)),
    ("caching MLA's latents is for Megatron-LM's dynamic inference engine (flash MLA decode; "
     "Megatron-LM refuses it in training); generation here always caches MLA's latents "
     "(inference/mla_cache.py); drop it",
     ("--cache-mla-latents",)),
    ("upcycling a dense checkpoint into MoE is not built; drop it",
     ("--moe-use-upcycling", "--moe-upcycling-granularity",)),
    ("writing progress.txt into the checkpoint directory is not built; drop it",
     ("--log-progress",)),
    ("the timing log format is fixed; other min/max/all-rank timing reports are not built, "
     "drop it",
     ("--timing-log-option",)),
    ("these extra log values (memory interval, device memory, max attention logit, energy) "
     "are not built; drop them",
     ("--log-memory-interval", "--log-device-memory-used",
      "--log-max-attention-logit", "--log-energy",)),
    ("router decision tracing to JSONL / .pt files is not built; drop these flags",
     ("--moe-routing-trace-path", "--moe-routing-trace-max-training-iters",
      "--moe-routing-trace-capture-logits", "--moe-routing-trace-capture-hidden-states",
      "--moe-routing-trace-dump-weights",)),
    ("SGD and Lion are not built (--optimizer adam or muon); drop these optimizer settings",
     ("--sgd-momentum", "--lion-beta1", "--lion-beta2",)),
    ("deprecated Megatron spelling; use --lr-warmup-iters",
     ("--warmup",)),
    ("freezing layers is not built; drop it",
     ("--freeze-all-layers",)),
    ("the padded vocab is always computed from the tokenizer and "
     "--make-vocab-size-divisible-by; drop these",
     ("--padded-vocab-size", "--no-pad-vocab-size",)),
    ("Megatron's tokenizer metadata files and the gigatoken library are not built; use "
     "--tokenizer-type and its files",
     ("--tokenizer-metadata", "--use-gigatoken",)),
    ("sentencepiece options beyond the plain model are not built; drop them",
     ("--tokenizer-sentencepiece-legacy",
      "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",)),
    ("a HuggingFace tokenizer always loads as the fast tokenizer and never runs remote code; "
     "drop it",
     ("--tokenizer-hf-no-use-fast", "--trust-remote-code",)),
    ("the NullTokenizer eod id is fixed (one past the given ids) and it has no pad id; drop "
     "these",
     ("--null-tokenizer-eod-id", "--null-tokenizer-pad-id",)),
    ("chat templates are for SFT/inference, which is not built; drop it",
     ("--chat-template",)),
    ("gradients are always reduced in fp32; bf16 gradient reduction is not built, drop it",
     ("--grad-reduce-in-bf16",)),
    ("the LM-head cross entropy always runs in fp32; drop it",
     ("--fp16-lm-cross-entropy",)),
    ("choosing the logit dtype needs Transformer Engine's general_gemm, which is not used; "
     "drop it",
     ("--output-logit-dtype",)),
    ("fp4/MXFP8 params and per-module precision need Transformer Engine's layers, "
     "which are not used; use --bf16",
     ("--reuse-grad-buf-for-mxfp8-param-ag", "--fp4-param-gather",
      "--te-precision-config-file",)),
    ("evaluation always runs every --eval-interval, --eval-iters batches from the start of "
     "the one validation split; these eval options are not built",
     ("--start-eval-at-iter", "--full-validation", "--multiple-validation-sets",
      "--validation-set-names",)),
    ("evaluation-only runs are not built; drop it (evaluate a checkpoint with tasks/main.py)",
     ("--skip-train",)),
    ("the profiler trace is always recorded without shapes, call stacks or Chakra traces; "
     "these options are not built",
     ("--pytorch-profiler-collect-shapes", "--pytorch-profiler-collect-callstack",
      "--pytorch-profiler-collect-chakra",)),
    ("allocator memory-history snapshots are not built; drop them",
     ("--record-memory-history", "--memory-snapshot-path",)),
    ("no NVTX ranges are emitted and emit_nvtx shape recording is not built; drop them",
     ("--record-shapes", "--nvtx-ranges",)),
    ("the Transformer Engine RNG tracker (for CUDA graphs) is not used; megatron_cp has its "
     "own tracker, drop it",
     ("--te-rng-tracker",)),
    ("an inference RNG tracker is not built; drop it",
     ("--inference-rng-tracker",)),
    ("weights are always initialised identically on every DP rank with a normal init; drop "
     "these",
     ("--data-parallel-random-init", "--init-method-xavier-uniform",)),
    ("megatron_cp has no in-process restart: a fault stops the job with one error line and "
     "you resume from --load; drop the in-process restart flags",
     ("--inprocess-restart", "--inprocess-max-iterations",
      "--inprocess-monitor-thread-interval", "--inprocess-monitor-process-interval",
      "--inprocess-progress-watchdog-interval", "--inprocess-heartbeat-interval",
      "--inprocess-soft-timeout", "--inprocess-hard-timeout", "--inprocess-heartbeat-timeout",
      "--inprocess-barrier-timeout", "--inprocess-completion-timeout",
      "--inprocess-last-call-wait", "--inprocess-termination-grace-time",
      "--inprocess-granularity", "--inprocess-active-world-size",
      "--inprocess-empty-cuda-cache",)),
    ("megatron_cp neither saves teacher logits nor trains with a distillation loss (the loss "
     "is plain LM cross-entropy); drop the logits distillation flags",
     ("--logits-save-top-k", "--logits-save-top-p", "--logits-save-top-p-min-k",
      "--logits-save-dir", "--logits-save-dtype", "--logits-load-dir",
      "--logits-load-decode-threads", "--logits-load-prefetch-factor",
      "--logits-load-msc-prefetch-depth", "--logits-load-kd-loss-alpha",
      "--logits-load-ignore-errors",)),
    ("the ADLR cluster autoresume is not built; use --exit-signal-handler or "
     "--exit-duration-in-mins with --save, then resume with --load",
     ("--adlr-autoresume", "--adlr-autoresume-interval",)),
    ("megatron_cp pretrains GPT only: there are no BERT/ICT/REALM biencoder models, "
     "retriever evaluation or indexer; drop these flags",
     ("--ict-head-size", "--biencoder-projection-dim",
      "--biencoder-shared-query-context-model", "--ict-load", "--bert-load",
      "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs",
      "--evidence-data-path", "--retriever-report-topk-accuracies",
      "--retriever-score-scaling", "--block-data-path", "--embedding-path",
      "--indexer-batch-size", "--indexer-log-interval",)),
    ("megatron_cp has no pluggable layer specs: its GPT layers are fixed and configured by "
     "the model flags; drop it",
     ("--spec",)),
    ("Mamba hybrid layer patterns are not built (Gated DeltaNet hybrids are: "
     "--experimental-attention-variant gated_delta_net --linear-attention-freq N); drop the "
     "hybrid layer pattern",
     ("--hybrid-layer-pattern", "--hybrid-override-pattern",)),
    ("megatron_cp reads no YAML config; pass every setting as a command-line flag",
     ("--yaml-cfg",)),
    ("megatron_cp has no fault injector, so no hang or crash can be injected; drop the fault "
     "injector flags",
     ("--fault-injector-ranks", "--fault-injector-num-ranks", "--fault-injector-fault-types",
      "--fault-injector-fault-probabilities", "--fault-injector-fault-delay",
      "--fault-injector-delay-start-iteration", "--fault-injector-mtti-seconds",
      "--fault-injector-offset-seconds", "--fault-injector-seed",)),
    ("the NVIDIA-internal fault-tolerance package is not used; hangs end at "
     "--distributed-timeout-minutes with one error line, so drop these",
     ("--enable-ft-package", "--calc-ft-timeouts", "--ft-num-warmup-iters",)),
    ("the Megatron inference engine and text-generation server are not part of megatron_cp; "
     "generate with tools/run_text_generation.py and drop these",
     ("--inference-batch-times-seqlen-threshold", "--max-tokens-to-oom",
      "--use-legacy-static-engine", "--inference-max-requests", "--inference-max-seq-length",
      "--inference-dynamic-batching", "--inference-dynamic-batching-buffer-size-gb",
      "--inference-dynamic-batching-paused-buffer-size-gb",
      "--inference-dynamic-batching-block-size", "--inference-dynamic-batching-max-requests",
      "--inference-dynamic-batching-max-tokens",
      "--inference-dynamic-batching-track-paused-request-events",
      "--inference-dynamic-batching-track-generated-token-events",
      "--inference-dynamic-batching-unified-memory-level", "--enable-chunked-prefill",
      "--inference-dynamic-batching-prefix-caching",
      "--inference-dynamic-batching-prefix-caching-eviction-policy",
      "--inference-dynamic-batching-prefix-caching-coordinator-policy",
      "--inference-dynamic-batching-prefix-caching-routing-alpha",
      "--inference-dynamic-batching-async-sched-mode", "--inference-logging-step-interval",
      "--inference-text-gen-server-logging", "--inference-wandb-logging",
      "--inference-coordinator-port", "--inference-use-synchronous-zmq-collectives",
      "--inference-disable-ep-consensus", "--inference-shards",)),
    ("speculative decoding is not built; tools/run_text_generation.py decodes one token per "
     "step, so drop it",
     ("--num-speculative-tokens",)),
    ("returned log-probs are not a feature of tools/run_text_generation.py, which prints "
     "completions only; drop it",
     ("--inference-dynamic-batching-logprobs-mode",)),
    ("tools/run_text_generation.py seeds sampling with --seed plus the prompt's number on "
     "every layout; per-DP-rank seeds are not built, drop it",
     ("--use-same-sampling-seed-across-dp-ranks",)),
    ("the FlashInfer GPU library is not a dependency; tools/run_text_generation.py samples "
     "with plain torch ops, drop it",
     ("--inference-dynamic-batching-sampling-backend",)),
    ("the CUDA graphs (a GPU feature of PyTorch/Transformer Engine) are not captured by "
     "megatron_cp, in training or in tools/run_text_generation.py; drop these",
     ("--cuda-graph-scope", "--cuda-graph-modules",
      "--inference-dynamic-batching-num-cuda-graphs", "--decode-only-cuda-graphs",
      "--inference-cuda-graph-all-prefills", "--inference-cuda-graph-max-tokens",
      "--inference-dynamic-batching-cuda-graph-mixed-prefill-count",
      "--inference-dynamic-batching-cuda-graph-sizing-distribution",)),
    ("megatron_cp has no Mamba layers, so there are no Mamba inference states; drop these",
     ("--inference-dynamic-batching-mamba-memory-ratio",
      "--inference-dynamic-batching-prefix-caching-mamba-gb",
      "--mamba-inference-conv-states-dtype", "--mamba-inference-ssm-states-dtype",)),
    ("there are no BERT models or BERT embedders in megatron_cp; drop it",
     ("--output-bert-embeddings", "--bert-embedder-type",)),
    ("the Multi-Storage Client is not a dependency; give --data-path, --save and --load as "
     "local or mounted filesystem paths",
     ("--enable-msc",)),
    ("megatron_cp reports no metrics to NVIDIA's one-logger service (as if --no-one-logger "
     "were given); drop it, the run log and --tensorboard-dir hold the metrics",
     ("--one-logger-project", "--one-logger-run-name", "--one-logger-async",
      "--app-tag-run-name", "--app-tag-run-version",)),
    ("the OpenTelemetry traces and metrics are not exported by megatron_cp; use --profile or "
     "--tensorboard-dir, and drop these",
     ("--otel-enabled", "--otel-service-name", "--otel-span-groups",)),
    ("the Megatron RL/GRPO trainer is not part of megatron_cp, which pretrains GPT models "
     "with the LM loss; drop the RL flags",
     ("--perform-rl-step", "--rl-prompts-per-eval", "--grpo-prompts-per-step",
      "--grpo-group-size", "--rl-generation-lag", "--rl-max-inflight-requests",
      "--rl-submission-granularity", "--rl-consumption-granularity",
      "--rl-durable-rollout-bank", "--rl-rollout-bank-dir", "--rl-rollout-bank-max-bytes",
      "--grpo-iterations", "--grpo-clamp-eps-lower", "--grpo-clamp-eps-upper",
      "--grpo-kl-beta", "--grpo-entropy-term-weight", "--grpo-filter-groups-with-same-reward",
      "--langrl-env-config", "--rl-default-temperature", "--rl-default-top-p",
      "--rl-default-top-k", "--rl-offload-optimizer-during-inference",
      "--rl-kv-cache-management-mode", "--rl-persist-cuda-graphs", "--rl-partial-rollouts",
      "--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef",
      "--rl-use-sequence-packing", "--rl-sequence-packing-max-sequences-per-bin",
      "--rl-sequence-packing-algo", "--rl-training-cuda-graphs",
      "--rl-inference-tensor-model-parallel-size",
      "--rl-inference-pipeline-model-parallel-size",
      "--rl-inference-expert-model-parallel-size",
      "--rl-inference-expert-tensor-model-parallel-size",
      "--rl-inference-model-unified-memory-level",
      "--rl-offload-inference-model-weights-when-idle", "--refit-method",
      "--rl-verify-model-weights-swap", "--rl-skip-bos-token", "--rl-profile",
      "--rl-profile-dir", "--rl-inference-parsers",)),
    ("supervised fine-tuning with prompt formats is not built; megatron_cp pretrains on "
     "indexed token data (--finetune only restarts from a checkpoint), drop it",
     ("--sft", "--sft-tokenizer-prompt-format",)),
    ("the straggler detector is not built, so no per-GPU throughput report is logged; the "
     "log line's iteration time and --profile remain; drop these",
     ("--log-straggler", "--straggler-ctrlr-port", "--straggler-minmax-count",
      "--disable-straggler-on-startup",)),
    ("megatron_cp has no vision models (ViT, Swin, DINO, inpainting) or image data; drop the "
     "vision flags",
     ("--num-classes", "--img-h", "--img-w", "--num-channels", "--patch-dim",
      "--classes-fraction", "--data-per-class-fraction", "--head-lr-mult",
      "--vision-pretraining", "--vision-pretraining-type", "--vision-backbone-type",
      "--swin-backbone-type", "--mask-type", "--mask-factor", "--iter-per-epoch",
      "--dino-local-img-size", "--dino-local-crops-number", "--dino-head-hidden-size",
      "--dino-bottleneck-size", "--dino-freeze-last-layer", "--dino-norm-last-layer",
      "--dino-warmup-teacher-temp", "--dino-teacher-temp",
      "--dino-warmup-teacher-temp-epochs",)),
    ("it changes the sample order of Megatron's cyclic data loader, which megatron_cp does "
     "not have (it has one sampler order); drop it",
     ("--no-data-sharding",)),
    ("there is no workload-inspector server for on-demand profiling; profile with --profile "
     "(--use-pytorch-profiler, --profile-step-start/--profile-step-end)",
     ("--run-workload-inspector-server",)),
)


# ----- the census and the grouped entries ------------------------------------------------

# where Megatron-LM reads each SAME / IGNORED flag (tools/megatron_flag_sources.py)
SOURCES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "megatron_flag_sources.json")


@functools.lru_cache(maxsize=None)
def _census_by_flag():
    return {flag: action for action in megatron_census()["actions"] for flag in action["flags"]}


def _literal(value):
    """A census value that Python can compare (None for a non-JSON repr like an enum's)."""
    return None if isinstance(value, str) and value.startswith("<") else value


def census_spec(action):
    """argparse keyword arguments that read census ``action`` as Megatron-LM's parser does."""
    kind, default = action["kind"], _literal(action["default"])
    if kind == "store_true":
        return {"action": "store_true"}
    if kind == "store_false":
        return {"action": "store_false"}
    if kind == "boolean_optional":
        return {"action": argparse.BooleanOptionalAction, "default": bool(default)}
    spec = {"default": default, "type": {"int": int, "float": float}.get(action["type"], str)}
    if action["nargs"] is not None:
        spec["nargs"] = action["nargs"]
    choices = action["choices"]
    if choices and all(_literal(c) is not None for c in choices):
        spec["choices"] = choices
        if all(isinstance(c, int) for c in choices):  # e.g. signal numbers
            spec["type"] = int
    return spec


def _grouped(table):
    """CompatFlags of a grouped ``table``: rows (kind, effect, text, flags) (AS_IS) or
    (text, flags), refused (NOT_BUILT)."""
    entries = []
    for row in table:
        kind, effect, why, flags = row if len(row) == 4 else (REFUSE, "", *row)
        for flag in flags:
            action = _census_by_flag()[flag]
            aliases = () if action["kind"] == "boolean_optional" else tuple(
                f for f in action["flags"] if f != flag)
            entries.append(CompatFlag(flag, kind, why, argparse=census_spec(action),
                                      aliases=aliases, effect=effect))
    return tuple(entries)


@functools.lru_cache(maxsize=None)
def _grouped_flags():
    return frozenset(flag for row in AS_IS + NOT_BUILT for flag in row[-1])


@functools.lru_cache(maxsize=None)
def all_entries():
    """Every table entry: the explicit ones, then the grouped ones (spec from the census)."""
    return COMPAT_FLAGS + _grouped(AS_IS) + _grouped(NOT_BUILT)


def add_compat_flags(groups):
    """Add every table flag to ``groups[entry.group]`` (argparse argument groups by name)."""
    for entry in all_entries():
        text = {SAME: f"Accepted: {entry.why}.", REFUSE: f"Refused: {entry.why}.",
                IGNORED: f"Ignored ({entry.effect}): in Megatron-LM it {entry.why}."}.get(
            entry.kind, entry.why)
        kwargs = dict(entry.argparse) if entry.argparse else {"action": "store_true"}
        groups[entry.group].add_argument(entry.flag, *entry.aliases, dest=entry.dest,
                                         help=text.replace("%", "%%"), **kwargs)


def apply_compat_flags(args, defaults):
    """Refuse, rewrite or note the table flags given in ``args``; returns ``(notes,
    problems)``, a line each (every refused flag is a problem of its own).

    ``defaults(name)`` is the parser's default of argument ``name`` (``parser.get_default``);
    a flag counts as given when its value differs from its default. The grouped entries'
    values are then removed from ``args``: no code reads them, and the start-up banner and
    the checkpoints list the arguments megatron_cp uses.
    """
    notes, problems = [], []
    for entry in all_entries():
        value = vars(args)[entry.dest]
        if entry.flag in _grouped_flags():  # nothing reads it: off the arguments (and banner)
            delattr(args, entry.dest)
        if value == defaults(entry.dest):
            continue
        shown = _given(entry, value)
        if entry.needs and vars(args)[entry.needs[0]] not in entry.needs[1]:
            problems.append(f"{shown}: {entry.needs[2]}")
        elif entry.kind == REFUSE:
            problems.append(f"{shown}: {entry.why}")
        elif isinstance(value, (str, int, float)) and value in entry.refuse:
            problems.append(f"{shown}: {entry.refuse[value]}")
        elif entry.kind in (SAME, IGNORED):
            notes.append(note(entry, shown))
        elif entry.kind == MAP:
            name, target = entry.sets
            current = vars(args)[name]
            if current not in (defaults(name), target):
                problems.append(f"{entry.flag} means --{name.replace('_', '-')} {target}, but "
                                f"--{name.replace('_', '-')} {current} was given; drop one")
            else:
                setattr(args, name, target)
    return notes, problems


def note(entry, shown):
    """The start-up line of accepted entry ``entry`` given as ``shown``: what megatron_cp does
    (SAME), "ignored: <what it does in Megatron-LM>" (IGNORED), or a WARNING for an ignored
    memory saving."""
    if entry.kind == SAME:
        return f"{shown}: {entry.why}"
    if entry.effect == MEMORY:
        return (f"WARNING: {shown}: in Megatron-LM it {entry.why}; this run does not, so it "
                f"needs more memory than Megatron-LM's run with the flag")
    return f"{shown}: ignored ({entry.effect}): in Megatron-LM it {entry.why}"


def dispatcher_note(kind):
    """The start-up line of ``--moe-token-dispatcher-type flex`` (a setting of the MoE
    section that megatron_cp runs as its all-to-all dispatcher)."""
    return (f"--moe-token-dispatcher-type {kind}: ignored ({SPEED}): in Megatron-LM it exchanges "
            f"the routed tokens through the DeepEP / HybridEP / NCCL EP kernels (GPU libraries); "
            f"this run exchanges the same tokens with the alltoall dispatcher")


def _given(entry, value):
    """The flag as the user typed it: ``--flag``, ``--no-flag`` or ``--flag VALUE``."""
    if isinstance(value, bool):
        negated = value is False and entry.argparse.get("action") is argparse.BooleanOptionalAction
        return "--no-" + entry.flag[2:] if negated else entry.flag
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return f"{entry.flag} {shown}"
