"""The training section: how long and on how many samples a run trains and evaluates, when
it stops, and how it guards its results (Megatron-LM's rerun state machine, NaN and spike
checks, weight hashes, determinism, the loss weighting)."""
from dataclasses import dataclass

from megatron_cp.config.setting import check_choices, setting

# Megatron-LM's rerun state machine (megatron_cp/rerun.py): its modes and injected faults
RERUN_MODES = ("disabled", "validate_results", "report_stats")
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    micro_batch_size: int = setting(group="training", help="Samples per microbatch per DP rank.")
    global_batch_size: int | None = setting(None, group="training",
        help="Samples per optimizer step (default micro batch x DP).")
    step_batch_size_schedule: str | None = setting(None, group="training",
        help="Global batch size by training tokens consumed, instead of --global-batch-size: "
             "'THRESHOLD:BATCH_SIZE ...' (e.g. '0:384 200B:768 400B:1152'; K/M/B/T suffixes; "
             "thresholds in tokens, divided by --seq-length into samples; the first 0). Each "
             "iteration takes the batch size of the largest threshold reached, so the number of "
             "microbatches grows (never falls); a checkpoint is saved (with --save) before the "
             "first iteration of a new size. The learning-rate schedule then counts samples, as "
             "Megatron-LM's does: with --train-iters, its iteration lengths are micro batch x DP"
             " samples per iteration.")
    train_iters: int | None = setting(None, group="training", help="Number of optimizer steps.")
    train_samples: int | None = setting(None, group="training",
        help="Train for this many samples instead.")
    eval_interval: int | None = setting(None, group="checkpointing and logging",
        help="Evaluate on the validation split every this many iterations (by default, as in "
             "Megatron-LM, only once training ends).")
    eval_iters: int = setting(100, group="checkpointing and logging",
        help="Batches per evaluation.")
    eval_global_batch_size: int | None = setting(None, group="checkpointing and logging",
        help="Samples per evaluation batch (default --global-batch-size, which a "
             "--step-batch-size-schedule leaves at micro batch x DP); a multiple of "
             "--eval-micro-batch-size x DP. An evaluation reads --eval-iters of them.")
    eval_micro_batch_size: int | None = setting(None, group="checkpointing and logging",
        help="Samples per evaluation microbatch per DP rank (default --micro-batch-size).")
    exit_interval: int | None = setting(None, group="training",
        help="Exit after iterations divisible by this.")
    exit_duration_in_mins: float | None = setting(None, group="training",
        help="Exit after this many minutes.")
    exit_signal_handler: bool = setting(False, group="training",
        help="On SIGTERM, save a checkpoint and exit cleanly.")
    check_for_nan_in_loss_and_grad: bool = setting(True,
        negative=("--no-check-for-nan-in-loss-and-grad",
                  "Train on through a NaN or inf loss or gradient norm."), group="training",
        help="Stop, naming the iteration and rank, when the training loss or the gradient norm "
             "is NaN or inf (the default; with fp16 loss scaling an overflowing gradient is a "
             "skipped step instead).")
    check_for_large_grads: bool = setting(False, group="training",
        help="Validate each gradient bucket's norm before its data-parallel reduction against "
             "10x the largest of the first 100 norms; with --rerun-mode validate_results a "
             "larger one reruns the step (not fatal: training goes on).")
    result_rejected_tracker_filename: str | None = setting(None, group="training",
        help="Append a line for every rejected result and every rerun verdict to this file "
             "(Megatron's format); at start-up the iterations it shows rejected twice on one "
             "rank, reruns disabled or reproducing them, are skipped (added to "
             "--iterations-to-skip).")
    iterations_to_skip: tuple[int, ...] = setting((), group="training",
        help="Skip these iterations (1-based): their batch is read and counted consumed, with no"
             " forward, backward or update.")
    check_weight_hash_across_dp_replicas_interval: int | None = setting(None, group="training",
        help="Every this many iterations (and before the first), hash every parameter (SHA-1 of "
             "its fp32 values) on each data-parallel replica and compare them over the DP group "
             "(expert parameters over the expert-DP group); replicas that differ stop the run "
             "naming the ranks and parameters. By default weights are not compared.")
    deterministic_mode: bool = setting(False, group="training",
        help="Deterministic execution, so two runs of one job give the same bits (slower): "
             "torch's deterministic algorithms (an op without one raises), cuBLAS's fixed "
             "workspace (CUBLAS_WORKSPACE_CONFIG), one NCCL algorithm (NCCL_ALGO, Ring unless "
             "set) and, unless --attention-kernel is given, the plain-PyTorch attention kernels,"
             " whose backward adds no atomics.")
    rerun_mode: str = setting("validate_results", choices=RERUN_MODES, group="rerun engine",
        help="validate_results (the default): a rejected loss or gradient reruns the step in "
             "place to tell a transient fault (exit status 17 when fatal) from a reproducible "
             "result (a checkpoint under --save and exit status 16, to rerun it on another GPU);"
             " report_stats: run every step twice and print how much the validated results vary;"
             " disabled: no rerun.")
    error_injection_rate: int = setting(0, group="rerun engine",
        help="Fake a rejected result about once in this many validations (0: never), to test the"
             " result validation.")
    error_injection_type: str = setting("transient_error",
        choices=INJECTION_TYPES, group="rerun engine",
        help="What an injected result turns out to be: a transient error (its rerun differs), a "
             "persistent error (the same when rerun here, different on another GPU) or a correct"
             " result (the same everywhere).")
    test_mode: bool = setting(False, group="rerun engine",
        help="Megatron-LM's realtime test: every attention forward checks that the "
             "--qk-layernorm weights are equal over the data-parallel replicas (stops naming "
             "them if not); nothing else changes.")
    check_for_spiky_loss: bool = setting(False, group="rerun engine",
        help="Validate each microbatch's loss against 10x the largest of the first 100 losses; "
             "with --rerun-mode validate_results a spike reruns the step (not fatal: training "
             "goes on).")
    calculate_per_token_loss: bool = setting(False, group="rerun engine",
        help="Take the gradient of the token-weighted mean loss over the whole global batch. "
             "Without it (Megatron-LM's default) each microbatch's loss is the mean over its own"
             " loss tokens, averaged over the microbatches "
             "(megatron_cp.pipeline_parallel.loss_weighting). The logged lm loss is the "
             "token-weighted mean either way.")
    empty_unused_memory_level: int = setting(0, choices=(0, 1, 2), group="training",
        help="Hand the caching allocator's unused blocks back to the device: 1 after each "
             "iteration's forward and backward (and each evaluation step), 2 after the "
             "optimizer step as well (slower; less fragmentation).")
    manual_gc: bool = setting(False, group="training",
        help="Disable automatic Python garbage collection; collect every --manual-gc-interval "
             "iterations.")
    manual_gc_interval: int = setting(0, group="training",
        help="Iterations between manual garbage collections (0: only at checkpoints and "
             "evaluation).")
    # derived by the command line's checks (megatron_cp/cli/checks.py)
    num_microbatches: int | None = setting(
        None, flag=None, arg="num_microbatches",
        help="Microbatches per step and rank (None: --step-batch-size-schedule decides).")
    eval_num_microbatches: int | None = setting(
        None, flag=None, arg="eval_num_microbatches",
        help="Microbatches per evaluation batch and rank.")
    batch_size_schedule: tuple | None = setting(
        None, flag=None, arg="batch_size_schedule",
        help="--step-batch-size-schedule parsed: (first sample, global batch size) pairs.")

    def __post_init__(self):
        check_choices(self)
