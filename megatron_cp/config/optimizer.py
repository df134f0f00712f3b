"""The optimizer's configuration: one dataclass, the one place each optimizer setting lives.

Which optimizer (Adam, or Muon for the hidden matrices with Adam for every other
parameter), Muon's settings, and the decoupled learning rate of the input embedding and
output layer: Megatron-LM's flags, names and defaults (its ``OptimizerConfig``), declared
with :func:`megatron_cp.config.setting.setting` and checked in ``__post_init__``. The learning
rate, its schedule and Adam's betas are the run's own flags (arguments.py).
"""
import dataclasses
from dataclasses import dataclass

import torch

from megatron_cp.config.setting import check_choices, setting

# Muon's Newton-Schulz coefficient sets (their values: optimizer/newton_schulz.py) and the
# factor on an orthogonalised update
COEFFICIENT_SETS = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")
_NOT_BUILT = {
    "sgd": "SGD is not built",
    "lion": "Lion is not built",
    "soap": "SOAP is not built",
    "adaptive_muon": "adaptive Muon (a second moment after the orthogonalisation) is not built",
}
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
# Megatron-FSDP's --data-parallel-sharding-strategy, ZeRO-0 to ZeRO-3
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# Megatron-LM's spellings of the precision-aware optimizer's dtypes
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8": torch.uint8}
_PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
# the shapes of WSD's annealing phase (--lr-wsd-decay-style), Megatron-LM's names
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """How parameters are updated. Field names follow Megatron-LM's OptimizerConfig."""
    optimizer: str = setting(
        "adam", choices=OPTIMIZERS, group="training",
        help="adam (AdamW), or muon: Muon (momentum, Newton-Schulz orthogonalisation) for the "
             "2-D weights of the transformer layers, Adam for the rest (embedding, output "
             "layer, biases, norms). dist_muon: muon with --use-distributed-optimizer (its "
             "state sharded over the data-parallel ranks).")
    decoupled_lr: float | None = setting(
        None, group="training",
        help="Peak learning rate of the input embedding and the output layer weights (the "
             "word embedding only, not learned positions), on the same warmup and decay as "
             "--lr.")
    decoupled_min_lr: float | None = setting(
        None, group="training",
        help="With --decoupled-lr: the embedding's and output layer's rate at the end of the "
             "decay (default --min-lr).")
    muon_momentum: float = setting(0.9, group="training",
                                   help="Muon's momentum: m = momentum m + (1 - momentum) g.")
    muon_split_qkv: bool = setting(
        True, flag="--muon-no-split-qkv", group="training",
        help="Orthogonalise the fused QKV weight whole, not its Q, K and V parts apart.")
    muon_nesterov: bool = setting(
        False, group="training",
        help="Nesterov momentum: orthogonalise g + momentum (m - g) instead of m.")
    muon_scale_mode: str = setting(
        "spectral", choices=SCALE_MODES, group="training",
        help="Factor on an orthogonalised m x n update: spectral sqrt(max(m, n)), "
             "unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n)).")
    muon_fp32_matmul_prec: str = setting(
        "medium", choices=("low", "medium", "high"), group="training",
        help="Precision of the Newton-Schulz matmuls: medium runs them in bfloat16 (on every "
             "device), high in fp32 (TF32 on CUDA). Megatron-LM's low is not a torch setting.")
    muon_coefficient_type: str = setting(
        "quintic", group="training",
        help="Newton-Schulz coefficients: " + ", ".join(COEFFICIENT_SETS) + ".")
    muon_num_ns_steps: int = setting(5, group="training", help="Newton-Schulz steps.")
    muon_tp_mode: str = setting(
        "duplicated", choices=MUON_TP_MODES, group="training",
        help="A tensor-parallel matrix is orthogonalised: duplicated, gathered whole on each "
             "rank; distributed, in place with its Gram matrix summed over TP (both "
             "TP-invariant); blockwise, each rank its own shard (the update then depends on "
             "the TP size).")
    muon_extra_scale_factor: float = setting(
        1.0, group="training", help="A further factor on every Muon update.")
    muon_scalar_optimizer: str = setting(
        "adam", choices=("adam", "lion"), group="training",
        help="Optimizer of the parameters Muon does not take (embedding, output layer, "
             "biases, norms): adam.")
    # the learning rate and its schedule, Adam, clipping, mixed precision, gradient reduction
    lr: float | None = setting(None, group="training", help="Peak learning rate.")
    min_lr: float = setting(0.0, group="training", help="Learning rate at the end of decay.")
    lr_decay_style: str = setting("linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], group="training",
        help="Learning rate decay after warmup. WSD (warmup-stable-decay): the rate stays at "
             "--lr until the last --lr-wsd-decay-iters (or -samples) of the decay, then "
             "anneals to --min-lr in the --lr-wsd-decay-style shape.")
    lr_wsd_decay_style: str = setting("exponential", choices=WSD_DECAY_STYLES, group="training",
        help="Shape of WSD's annealing over its fraction r of the phase: exponential "
             "(2 x 0.5^r - 1), linear (1 - r), cosine ((1 + cos(pi r)) / 2) or minus_sqrt "
             "(1 - sqrt(r)), from --lr down to --min-lr.")
    lr_wsd_decay_iters: int | None = setting(None, group="training",
        help="WSD: iterations of the annealing phase, which ends with the decay "
             "(--lr-decay-iters); with --train-iters.")
    lr_wsd_decay_samples: int | None = setting(None, group="training",
        help="WSD: samples of the annealing phase; with --train-samples.")
    lr_warmup_iters: int = setting(0, group="training", help="Linear warmup iterations.")
    lr_warmup_fraction: float | None = setting(None, group="training",
        help="Warmup as a fraction of the decay iterations.")
    lr_decay_iters: int | None = setting(None, group="training",
        help="Decay iterations (default train iters).")
    lr_warmup_init: float = setting(0.0, group="training",
        help="Learning rate at the start of the warmup.")
    lr_warmup_samples: int = setting(0, group="training",
        help="Linear warmup in samples (with --train-samples).")
    lr_decay_samples: int | None = setting(None, group="training",
        help="Decay length in samples (with --train-samples; default --train-samples).")
    weight_decay: float = setting(0.01, group="training", help="AdamW weight decay.")
    apply_wd_to_qk_layernorm: bool = setting(False, group="training",
        help="Decay the --qk-layernorm weights (and biases) too; every other norm weight and "
             "bias stays undecayed.")
    start_weight_decay: float | None = setting(None, group="training",
        help="Weight decay at the start (with a non-constant --weight-decay-incr-style).")
    end_weight_decay: float | None = setting(None, group="training",
        help="Weight decay at the end of training.")
    weight_decay_incr_style: str = setting("constant", choices=("constant", "linear", "cosine"),
        group="training",
        help="How the weight decay moves from --start-weight-decay to --end-weight-decay over "
             "training.")
    adam_beta1: float = setting(0.9, group="training", help="Adam beta1.")
    adam_beta2: float = setting(0.999, group="training", help="Adam beta2.")
    adam_eps: float = setting(1e-8, group="training", help="Adam epsilon.")
    clip_grad: float = setting(1.0, group="training",
        help="Gradient clipping by global norm (0: off).")
    bf16: bool = setting(False, group="training", help="bf16 model with fp32 main params.")
    fp16: bool = setting(False, group="training",
        help="fp16 model with fp32 main params and loss scaling.")
    loss_scale: float | None = setting(None, group="training",
        help="Constant loss scale for fp16.")
    initial_loss_scale: float = setting(2 ** 32, group="training",
        help="Initial dynamic loss scale.")
    min_loss_scale: float = setting(1.0, group="training", help="Minimum dynamic loss scale.")
    loss_scale_window: int = setting(1000, group="training",
        help="Good steps before the scale grows.")
    hysteresis: int = setting(2, group="training", help="Overflows tolerated before backing off.")
    overlap_grad_reduce: bool = setting(False, group="training",
        help="Overlap the DP gradient all-reduce (reduce-scatter with the distributed optimizer)"
             " with backward.")
    use_distributed_optimizer: bool = setting(False, group="training",
        help="ZeRO-1: shard the fp32 main params and Adam state over the data-parallel (DP x CP)"
             " ranks; gradients are reduce-scattered and the updated params all-gathered, bucket"
             " by bucket.")
    num_distributed_optimizer_instances: int = setting(1, group="training",
        help="With --use-distributed-optimizer: keep K copies of the sharded optimizer state, "
             "each sharded over a 1/K slice of the DP x CP ranks (consecutive ranks of the "
             "group): gradients are reduce-scattered inside the slice and all-reduced across the"
             " K slices, parameters all-gathered inside it. The same training as K = 1, with the"
             " collectives over smaller groups.")
    ddp_bucket_size: int | None = setting(None, group="training",
        help="Gradient elements per data-parallel all-reduce bucket (default 40 MB of fp32 "
             "gradients).")
    overlap_param_gather: bool = setting(False, group="training",
        help="With --use-distributed-optimizer: run the parameter all-gather in the background "
             "after the step; each module's forward waits for its own bucket.")
    use_torch_fsdp2: bool = setting(False, group="training",
        help="ZeRO-3 with PyTorch's FSDP2 (fully_shard): every parameter, its gradient, fp32 "
             "main copy and Adam state sharded by rows over the DP x CP ranks; each transformer "
             "layer gathered just before it runs. Needs --pipeline-model-parallel-size 1, "
             "--expert-model-parallel-size 1, no --use-distributed-optimizer and --ckpt-format "
             "torch_dist.")
    torch_fsdp2_no_reshard_after_forward: bool = setting(False, group="training",
        help="With --use-torch-fsdp2: keep each layer's gathered parameters from its forward to "
             "its backward (more memory, one all-gather less).")
    use_megatron_fsdp: bool = setting(False, group="training",
        help="Megatron-LM's own FSDP, run on megatron_cp's machinery with the meaning of "
             "--data-parallel-sharding-strategy (what is sharded over the DP x CP ranks). "
             "Needs --ckpt-format fsdp_dtensor, as in Megatron-LM.")
    data_parallel_sharding_strategy: str = setting("optim_grads_params",
        choices=SHARDING_STRATEGIES, group="training",
        help="With --use-megatron-fsdp, what is sharded over the DP x CP ranks (ZeRO-0 to 3): "
             "no_shard, nothing (DDP); optim, the fp32 main params and Adam state (the "
             "distributed optimizer); optim_grads, also the gradients (FSDP2 reduce-scattering "
             "each microbatch, the gathered params kept whole from the step's first forward to "
             "its last backward); optim_grads_params, also the params (FSDP2, each layer gathered just "
             "before it runs, as --use-torch-fsdp2).")
    fp8_param_gather: bool = setting(False, group="mixed precision",
        help="With --fp8-format: keep the FP8 linears' weights in FP8 between steps (one byte "
             "per element and a scale), cast from the fp32 main params by the sharded "
             "optimizer and all-gathered in FP8 (--use-distributed-optimizer; "
             "--use-torch-fsdp2: each layer's gather casts its rows to FP8).")
    # the precision-aware optimizer and the optimizer on the host (Megatron-LM's names)
    use_precision_aware_optimizer: bool = setting(False, group="training",
        help="Keep the optimizer's tensors in the dtypes of --main-grads-dtype, "
             "--main-params-dtype, --exp-avg-dtype and --exp-avg-sq-dtype (Adam, with "
             "--use-distributed-optimizer or --use-megatron-fsdp); the update itself is "
             "computed in fp32.")
    main_grads_dtype: str = setting("fp32", choices=("fp32", "bf16"), group="training",
        help="With --use-precision-aware-optimizer: dtype of the gradient buffers the "
             "gradients accumulate and are reduced in (bf16 with --bf16 only).")
    main_params_dtype: str = setting("fp32", choices=("fp32", "fp16"), group="training",
        help="With --use-precision-aware-optimizer: dtype of the main (master) params.")
    exp_avg_dtype: str = setting("fp32", choices=("fp32", "fp16", "bf16", "fp8"),
        group="training",
        help="With --use-precision-aware-optimizer: dtype Adam's first moment is stored in "
             "between steps (the update is computed in fp32).")
    exp_avg_sq_dtype: str = setting("fp32", choices=("fp32", "fp16", "bf16", "fp8"),
        group="training",
        help="With --use-precision-aware-optimizer: dtype Adam's second moment is stored in "
             "between steps (the update is computed in fp32).")
    optimizer_cpu_offload: bool = setting(False, group="training",
        help="Keep --optimizer-offload-fraction of this rank's optimizer params (fp32 main "
             "params, Adam moments and a gradient copy) in host memory and step them there; "
             "the updated params are copied back. Needs --use-precision-aware-optimizer.")
    optimizer_offload_fraction: float = setting(1.0, group="training",
        help="With --optimizer-cpu-offload: the fraction of this rank's optimizer params, by "
             "element count in parameter order, kept and stepped on the host.")
    overlap_cpu_optimizer_d2h_h2d: bool = setting(False, group="training",
        help="With --optimizer-cpu-offload on a GPU: copy the gradients to the host and the "
             "updated params back on a side stream (the same numbers).")
    pin_cpu_grads: bool = setting(True, flag="--no-pin-cpu-grads", arg="pin_cpu_grads",
        store_false=True, group="training",
        help="With --optimizer-cpu-offload on a GPU: keep the host gradient copies in "
             "page-locked (pinned) memory; --no-pin-cpu-grads uses pageable memory.")
    pin_cpu_params: bool = setting(True, flag="--no-pin-cpu-params", arg="pin_cpu_params",
        store_false=True, group="training",
        help="With --optimizer-cpu-offload on a GPU: keep the host main params in page-locked "
             "(pinned) memory; --no-pin-cpu-params uses pageable memory.")
    # derived by the command line's checks (megatron_cp/cli/checks.py)
    lr_counts_samples: bool = setting(
        False, flag=None, arg="lr_counts_samples",
        help="The schedule's lengths count samples (--train-samples or a batch-size schedule), "
             "not iterations.")
    lr_warmup_steps: int | None = setting(None, flag=None, arg="lr_warmup_steps",
                                          help="Warmup length, in the schedule's unit.")
    lr_decay_steps: int | None = setting(None, flag=None, arg="lr_decay_steps",
                                         help="Decay length, in the schedule's unit.")
    wd_incr_steps: int | None = setting(None, flag=None, arg="wd_incr_steps",
                                        help="Weight-decay schedule length, in its unit.")
    wsd_decay_steps: int | float | None = setting(None, flag=None, arg="wsd_decay_steps",
                                                  help="WSD's annealing length, in the "
                                                       "schedule's unit.")
    ddp_bucket_size_mb: float = setting(40.0, flag=None, arg="ddp_bucket_size_mb",
                                        help="--ddp-bucket-size in MB of fp32 gradients.")

    def __post_init__(self):
        check_choices(self)
        if self.optimizer in _NOT_BUILT:
            raise ValueError(f"optimizer ({self.optimizer!r}): {_NOT_BUILT[self.optimizer]}; "
                             f"use adam or muon")
        if self.uses_muon:
            self._check_muon()
        else:
            given = [f.name if isinstance(f.default, bool) else
                     f"{f.name} ({getattr(self, f.name)!r})"
                     for f in dataclasses.fields(self)
                     if f.name.startswith("muon_") and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"{', '.join(given)} set Muon, but optimizer "
                                 f"({self.optimizer!r}) is not Muon; add --optimizer muon or "
                                 f"drop {'it' if len(given) == 1 else 'them'}")
        self._check_decoupled_lr()
        self._check_precision_aware()
        self._check_offload()
        self._check_fp8_param_gather()

    def _check_fp8_param_gather(self):
        """Megatron-LM's rule (a sharded optimizer makes the FP8 weights) and what is not
        built with it here."""
        if not self.fp8_param_gather:
            return
        if not (self.use_distributed_optimizer or self.fully_sharded):
            raise ValueError("fp8_param_gather (True) needs the distributed optimizer or FSDP "
                             "(Megatron-LM's rule): add --use-distributed-optimizer or "
                             "--use-torch-fsdp2")
        if not (self.bf16 or self.fp16 or self.fully_sharded):
            raise ValueError("fp8_param_gather (True) with fp32 params and the distributed "
                             "optimizer is not built (it keeps fp32 masters apart from the FP8 "
                             "weights of bf16/fp16 models; FSDP2's fp32 rows are the masters): "
                             "add --bf16")
        unbuilt = [name for name, on in (("optimizer muon", self.uses_muon),
                                         ("optimizer_cpu_offload", self.optimizer_cpu_offload),
                                         ("main_params_dtype fp16",
                                          self.main_params_dtype != "fp32")) if on]
        if unbuilt:
            raise ValueError(f"fp8_param_gather (True) with {unbuilt[0]} is not built; drop "
                             f"one")

    @property
    def fully_sharded(self):
        """The gradients are sharded over DP x CP (FSDP2): --use-torch-fsdp2, or
        --use-megatron-fsdp with optim_grads or optim_grads_params."""
        return self.use_torch_fsdp2 or (self.use_megatron_fsdp and self.data_parallel_sharding_strategy
                                        in ("optim_grads", "optim_grads_params"))

    @property
    def keeps_params_whole(self):
        """FSDP2 that keeps the gathered params from a step's first forward to its last
        backward (ZeRO-2: Megatron-FSDP's optim_grads; --torch-fsdp2-no-reshard-after-forward
        keeps them from each forward to its backward only)."""
        return self.use_megatron_fsdp and self.data_parallel_sharding_strategy == "optim_grads"

    def state_dtype(self, name):
        """The torch dtype of precision-aware field ``name`` (e.g. ``"exp_avg_dtype"``)."""
        return STATE_DTYPES[getattr(self, name)]

    @property
    def offload_fraction(self):
        """The fraction of this rank's optimizer params kept on the host (0 without
        --optimizer-cpu-offload)."""
        return self.optimizer_offload_fraction if self.optimizer_cpu_offload else 0.0

    def offload_notes(self):
        """Start-up notes for the host-offload switches that compute nothing different:
        what they do in Megatron-LM, and where they act here (on a GPU only)."""
        given = [flag for flag, on in (("--overlap-cpu-optimizer-d2h-h2d",
                                        self.overlap_cpu_optimizer_d2h_h2d),
                                       ("--no-pin-cpu-grads", not self.pin_cpu_grads),
                                       ("--no-pin-cpu-params", not self.pin_cpu_params)) if on]
        if not given:
            return []
        if not self.optimizer_cpu_offload:
            return [f"{', '.join(given)}: no effect without --optimizer-cpu-offload (as in "
                    f"Megatron-LM)"]
        return [f"{', '.join(given)}: the host copies' speed only, the same numbers: Megatron-LM "
                f"copies gradients to the host and updated params back on side streams and "
                f"pins (page-locks) the host buffers; here too on a GPU, through the device "
                f"helper; on a CPU nothing moves"]

    def _check_precision_aware(self):
        lowered = [f for f in _PRECISION_FIELDS if getattr(self, f) != "fp32"]
        if not self.use_precision_aware_optimizer:
            if lowered:
                raise ValueError(f"{lowered[0]} ({getattr(self, lowered[0])!r}) can only be fp32 "
                                 f"without the precision-aware optimizer (Megatron-LM's rule); "
                                 f"add --use-precision-aware-optimizer")
            return
        if self.optimizer != "adam":
            raise ValueError(f"use_precision_aware_optimizer works with Adam only (Megatron-LM's "
                             f"rule), not optimizer ({self.optimizer!r}); use --optimizer adam")
        if not (self.use_distributed_optimizer or self.use_megatron_fsdp):
            raise ValueError("use_precision_aware_optimizer needs the distributed optimizer "
                             "(Megatron-LM's rule; Megatron-FSDP turns it on itself, "
                             "--use-torch-fsdp2 takes none): add --use-distributed-optimizer, or "
                             "use --use-megatron-fsdp for FSDP")
        if self.use_megatron_fsdp and self.data_parallel_sharding_strategy == "no_shard":
            raise ValueError("use_precision_aware_optimizer: --data-parallel-sharding-strategy "
                             "no_shard runs the replicated optimizer here, which does not build "
                             "it; use optim or a sharding strategy above it")
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            value = getattr(self, name)
            if value == "fp8":
                raise ValueError(f"{name} ('fp8'): FP8 optimizer state is not built yet; use "
                                 f"bf16 or fp32")
        if self.main_params_dtype != "fp32" and self.fully_sharded:
            raise ValueError(f"main_params_dtype ({self.main_params_dtype!r}): FSDP's fp32 rows "
                             f"are the main params here (Megatron-FSDP has "
                             f"--megatron-fsdp-main-params-dtype); use fp32")
        if self.main_grads_dtype == "bf16" and not self.bf16:
            raise ValueError("main_grads_dtype ('bf16') is the gradient buffers of a bf16 model "
                             "(Megatron-LM's rule); add --bf16 or use fp32")
        if self.main_grads_dtype == "bf16" and self.fully_sharded:
            raise ValueError("main_grads_dtype ('bf16'): FSDP reduces the gradients in fp32 "
                             "here (Megatron-FSDP has --megatron-fsdp-main-grads-dtype); use fp32")

    def _check_offload(self):
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction ({self.optimizer_offload_fraction}) is "
                             f"a fraction of the optimizer params: give a number in [0, 1]")
        if not self.optimizer_cpu_offload:
            return
        if not self.use_precision_aware_optimizer:
            raise ValueError("optimizer_cpu_offload reuses the precision-aware optimizer's path "
                             "(Megatron-LM's rule): add --use-precision-aware-optimizer")
        lowered = [f for f in _PRECISION_FIELDS[1:] if getattr(self, f) != "fp32"]
        if lowered:
            raise ValueError(f"{lowered[0]} ({getattr(self, lowered[0])!r}): Megatron-LM's "
                             f"hybrid CPU/GPU optimizer keeps fp32 main params and moments "
                             f"whatever it says; drop it with --optimizer-cpu-offload")

    @property
    def uses_muon(self):
        return self.optimizer in ("muon", "dist_muon")

    def _check_muon(self):
        if self.fp16:
            raise ValueError(f"optimizer ({self.optimizer!r}) does not train fp16 models "
                             f"(Megatron-LM refuses it too); use --bf16")
        if self.muon_scalar_optimizer != "adam":
            raise ValueError(f"muon_scalar_optimizer ({self.muon_scalar_optimizer!r}): Lion is "
                             f"not built; use adam")
        if self.muon_fp32_matmul_prec == "low":
            raise ValueError("muon_fp32_matmul_prec ('low') is no torch float32 matmul "
                             "precision (Megatron-LM's optimizer fails on it); use medium or "
                             "high")
        if self.muon_coefficient_type not in COEFFICIENT_SETS:
            raise ValueError(f"muon_coefficient_type ({self.muon_coefficient_type!r}) must be "
                             f"one of {', '.join(COEFFICIENT_SETS)} (no flag gives 'custom' "
                             f"coefficients)")
        if self.muon_num_ns_steps < 1:
            raise ValueError(f"muon_num_ns_steps ({self.muon_num_ns_steps}) must be at least 1")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum ({self.muon_momentum}) must be in [0, 1)")

    def _check_decoupled_lr(self):
        lr, low = self.decoupled_lr, self.decoupled_min_lr
        if lr is None:
            if low is not None:
                raise ValueError(f"decoupled_min_lr ({low}) is the end of the decoupled "
                                 f"learning rate's decay: add decoupled_lr")
            return
        if lr < 0.0 or (low is not None and not 0.0 <= low <= lr):
            raise ValueError(f"need 0 <= decoupled_min_lr ({low}) <= decoupled_lr ({lr})"
                             if low is not None else f"decoupled_lr ({lr}) must be >= 0")
        if low is None and self.min_lr > lr:
            raise ValueError(f"the decoupled learning rate decays to min_lr ({self.min_lr}) "
                             f"when decoupled_min_lr is not given, which is above decoupled_lr "
                             f"({lr}); give decoupled_min_lr")
