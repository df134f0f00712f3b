"""The command line's checks: :func:`validate_args` derives what the flags imply (DP size,
microbatch counts, the schedule's lengths, the dtype) and runs every rule that spans sections
(the rank grid, batch and pipeline split, the model config with flag names, the schedule,
the data files, the tokenizer, the optimizer and checkpoint companions), then each section's
own rules, keeping every failure; all of them raise together as :class:`ArgumentErrors`."""
import math
import os

import torch

from megatron_cp.resilience import rerun
from megatron_cp.observability import wandb_logging
from megatron_cp.cli.megatron_flags import apply_compat_flags, dispatcher_note
from megatron_cp.config.checkpoint import CheckpointConfig
from megatron_cp.config.dynamic_cp import dynamic_cp_note, dynamic_cp_problems
from megatron_cp.config.data import NOT_BUILT_TOKENIZERS, SENTENCEPIECE_TYPES, DataConfig
from megatron_cp.config.logging import LoggingConfig
from megatron_cp.config.model import GPTConfig
from megatron_cp.config.optimizer import OptimizerConfig
from megatron_cp.config.parallel import ParallelConfig
from megatron_cp.config.setting import build_config, fill_args, name_flags
from megatron_cp.config.training import TrainingConfig
from megatron_cp.data.batch_schedule import (SIZE_NAME, BatchSchedule, check_divisible,
                                             parse_schedule)
from megatron_cp.data.utils import parse_and_normalize_split
from megatron_cp.distributed.initialize import check_instances, rank_order, validate_sizes
from megatron_cp.distributed import fsdp
from megatron_cp.pipeline_parallel.stages import (layout_from_config,
                                                  validate_interleaved_microbatches)


class ArgumentErrors(ValueError):
    """Every problem found in the arguments, one line each (``str``: the lines joined)."""

    def __init__(self, lines):
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


class _Checks:
    """Runs checks and keeps every failure: each ValueError (or ArgumentErrors' lines) is a
    line, and ``run`` says whether the check passed so the checks that build on its derived
    values run only then."""

    def __init__(self, problems=()):
        self.problems = list(problems)

    def run(self, check, *args, **kwargs):
        try:
            check(*args, **kwargs)
        except ValueError as error:  # ArgumentErrors carries its lines
            self.problems += getattr(error, "lines", [str(error)])
            return False
        return True

    def raise_any(self):
        if self.problems:
            raise ArgumentErrors(self.problems)


def validate_args(args, world_size, parser, names, inference=False, problems=()):
    """Derive defaults (DP size, batch sizes, dtype) and check every flag and combination;
    raise :class:`ArgumentErrors` with every problem found (``problems``: lines found
    already, e.g. unknown flags). ``parser``: the parser that read ``args`` (its defaults
    tell a given flag from one left alone); ``names``: ``{Python name: flag}`` for messages.

    ``inference``: no training schedule or dataset is checked (see
    :func:`~megatron_cp.cli.arguments.parse_args`)."""
    checks = _Checks(problems)
    args.world_size = world_size
    checks.run(_apply_megatron_flags, args, parser.get_default)
    counts_ok = checks.run(_validate_counts, args)
    checks.run(_validate_precision, args)
    sizes_ok = checks.run(_validate_sizes, args, world_size, names)
    batch_ok = counts_ok and sizes_ok and checks.run(_validate_batch, args)
    if batch_ok:
        eval_ok = checks.run(_validate_eval_batch, args)
        checks.run(_validate_pipeline, args, check_microbatches=not inference, eval_counted=eval_ok)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # Megatron turns it off silently for TP=1
    if args.deterministic_mode and args.attention_kernel == "auto":
        args.attention_kernel = "torch"  # the fused kernels' backward accumulates atomically
    model_ok = checks.run(_validate_model, args, names, sizes_ok)
    checks.run(_validate_sequence_split, args)
    if inference:
        args.train_iters = args.train_iters or 0
    elif counts_ok and batch_ok:
        checks.run(_validate_schedule, args)
    checks.run(_validate_split, args)
    checks.run(_validate_data, args, need_data=not inference)
    checks.run(_validate_tokenizer, args)
    built = {section: checks.run(build_config, section, args)  # each section's own rules
             for section in (DataConfig, TrainingConfig, ParallelConfig, CheckpointConfig,
                             LoggingConfig)}
    built[OptimizerConfig] = checks.run(_validate_optimizer, args, names)
    checks.run(_validate_optimizer_and_checkpoint, args)
    if all(built[section] for section in _FSDP2_SECTIONS):  # else their checks said why
        checks.run(_validate_fsdp2, args)
    if sizes_ok and model_ok and built[ParallelConfig] and built[TrainingConfig]:
        checks.run(_validate_dynamic_cp, args)
    checks.run(_validate_rerun_and_wandb, args)
    if args.save:
        checks.run(_check_writable, args.save)
    checks.raise_any()
    return args


def _apply_megatron_flags(args, defaults):
    """The table of further Megatron-LM flags (megatron_flags.py): notes for the banner,
    aliases rewritten, every refused flag a problem."""
    fsdp_problems = fsdp.megatron_fsdp_flag_problems(args)  # before the table drops its flags
    args.compat_notes, problems = apply_compat_flags(args, defaults)
    args.compat_notes += fsdp.apply_megatron_fsdp(args)
    problems += fsdp_problems
    if args.moe_token_dispatcher_type == "flex":
        args.compat_notes.append(dispatcher_note("flex"))
    if args.async_save and not args.use_gloo_process_groups:
        args.compat_notes.append(
            "--async-save with --disable-gloo-process-groups: ignored (speed): each save is "
            "written before training goes on; megatron_cp's background writer coordinates over "
            "a gloo group of its own, which the flag does not create")
    if problems:
        raise ArgumentErrors(problems)


def _validate_precision(args):
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are exclusive; pick one")
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32


def _validate_sizes(args, world_size, names):
    """The rank grid: every size divides the world, and the expert mesh fits."""
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size  # Megatron's default
    if args.expert_model_parallel_size > 1 and not args.num_experts:
        raise ValueError(f"--expert-model-parallel-size {args.expert_model_parallel_size} splits "
                         f"MoE experts, but the model has none: add --num-experts")
    try:
        args.rank_order = rank_order(args.rank_order, args.use_tp_pp_dp_mapping)
        args.data_parallel_size = validate_sizes(
            world_size, args.tensor_model_parallel_size, args.context_parallel_size,
            args.pipeline_model_parallel_size, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size, args.rank_order)
        expert_dp = world_size // (args.pipeline_model_parallel_size
                                   * args.expert_model_parallel_size
                                   * args.expert_tensor_parallel_size)
        check_instances(args.num_distributed_optimizer_instances,
                        args.data_parallel_size * args.context_parallel_size, expert_dp)
    except ValueError as err:  # initialize's rule names fields: name the flags instead
        raise ValueError(name_flags(str(err), names).replace("world_size", "the world "
                                                                    "size")) from None


def _validate_batch(args):
    """Global batch = micro batch x DP x microbatches: constant, or stepped by
    --step-batch-size-schedule (data/batch_schedule.py)."""
    dp = args.data_parallel_size
    args.batch_size_schedule = None
    if args.step_batch_size_schedule is not None:
        args.batch_size_schedule = parse_schedule(args.step_batch_size_schedule, args.seq_length)
        # Megatron-LM fills the unused --global-batch-size as without a schedule; its
        # iteration-based learning-rate lengths count these samples per iteration
        args.global_batch_size = args.micro_batch_size * dp
        args.num_microbatches = None  # it follows the consumed samples (BatchSchedule)
        if not args.load:  # a resumed run may have passed entries that no longer fit
            for _, size in args.batch_size_schedule:
                check_divisible(size, args.micro_batch_size, dp, SIZE_NAME)
        return
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    check_divisible(args.global_batch_size, args.micro_batch_size, dp)
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)


def _validate_eval_batch(args):
    """Evaluation's own batch sizes (Megatron's defaults: the training ones)."""
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    per = args.eval_micro_batch_size * args.data_parallel_size
    if args.eval_global_batch_size % per != 0:
        raise ValueError(f"--eval-global-batch-size ({args.eval_global_batch_size}) must be "
                         f"divisible by --eval-micro-batch-size ({args.eval_micro_batch_size}) "
                         f"x data-parallel size ({args.data_parallel_size}); use a multiple of "
                         f"{per}")
    args.eval_num_microbatches = args.eval_global_batch_size // per


def _microbatch_counts(args):
    """The microbatch counts the run will use, as far as the arguments tell (a resumed
    schedule is checked as it runs)."""
    if args.num_microbatches is not None:
        return [args.num_microbatches]
    if args.load:
        return []
    per = args.micro_batch_size * args.data_parallel_size
    return [size // per for _, size in args.batch_size_schedule]


def _validate_sequence_split(args):
    """The sequence splits evenly over 2 x CP chunks (x TP with sequence parallelism)."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    split = 2 * cp if cp > 1 else 1
    if args.seq_length % (split * (tp if args.sequence_parallel else 1)) != 0:
        raise ValueError(f"--seq-length ({args.seq_length}) must be divisible by "
                         f"{'2 x CP (' + str(2 * cp) + ')' if cp > 1 else '1'}"
                         f"{' x TP (' + str(tp) + ') for sequence parallelism' if args.sequence_parallel else ''}")


# Counts that a loop divides by or runs over: (argument, smallest value that means something).
COUNT_MINIMUMS = (("micro_batch_size", 1), ("global_batch_size", 1), ("log_interval", 1),
                  ("train_iters", 0), ("train_samples", 1), ("eval_iters", 0),
                  ("eval_interval", 0), ("save_interval", 0), ("eval_global_batch_size", 1),
                  ("eval_micro_batch_size", 1), ("check_weight_hash_across_dp_replicas_interval", 1))


def _validate_counts(args):
    """Sizes and intervals in range, and one training length (Megatron's rule too)."""
    values = vars(args)
    problems = [f"--{name.replace('_', '-')} ({values[name]}) must be at least {minimum}"
                for name, minimum in COUNT_MINIMUMS
                if values[name] is not None and values[name] < minimum]
    if args.train_iters is not None and args.train_samples is not None:
        problems.append(f"--train-iters ({args.train_iters}) and --train-samples "
                        f"({args.train_samples}) both give the training length; give one")
    if args.step_batch_size_schedule is not None and args.global_batch_size is not None:
        problems.append(f"--step-batch-size-schedule and --global-batch-size "
                        f"({args.global_batch_size}) both give the global batch size; give one")
    if problems:
        raise ArgumentErrors(problems)


def _validate_optimizer(args, names):
    """The optimizer config's own rules (naming flags, not fields). dist_muon is Muon under
    the distributed optimizer, which Megatron-LM also rewrites it to."""
    try:
        config = build_config(OptimizerConfig, args)
    except ValueError as err:
        raise ValueError(name_flags(str(err), names)) from err
    args.compat_notes += config.offload_notes()
    if args.accumulate_allreduce_grads_in_fp32 and \
            config.main_grads_dtype != "fp32":
        raise ValueError("--main-grads-dtype bf16 reduces the gradients in bf16, "
                         "--accumulate-allreduce-grads-in-fp32 in fp32 (Megatron-LM refuses "
                         "both); drop one")
    if args.optimizer == "dist_muon":
        args.optimizer, args.use_distributed_optimizer = "muon", True


def _validate_optimizer_and_checkpoint(args):
    """The distributed optimizer's and the checkpoint format's companions."""
    if args.exit_signal_handler and not args.save:
        raise ValueError("--exit-signal-handler saves a checkpoint on SIGTERM: give --save")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ValueError("--overlap-param-gather overlaps the distributed optimizer's parameter "
                         "all-gather: add --use-distributed-optimizer")
    if args.num_distributed_optimizer_instances > 1 and not args.use_distributed_optimizer \
            and not args.use_megatron_fsdp:  # its strategies' own rule (fsdp.argument_problems)
        raise ValueError(f"--num-distributed-optimizer-instances "
                         f"({args.num_distributed_optimizer_instances}) copies the distributed "
                         f"optimizer: add --use-distributed-optimizer")
    if args.async_save and args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):
        raise ValueError(f"--async-save writes --ckpt-format torch_dist or fsdp_dtensor "
                         f"checkpoints, not {args.ckpt_format}; add --ckpt-format torch_dist")
    if (args.distributed_timeout_seconds_after_init is not None
            and args.distributed_timeout_seconds_after_init <= 0):
        raise ValueError(f"--distributed-timeout-seconds-after-init "
                         f"({args.distributed_timeout_seconds_after_init}) is a timeout in "
                         f"seconds: give a positive number")
    if args.verify_integrity and args.ckpt_format != "torch_dist":
        raise ValueError(f"--verify-integrity hashes --ckpt-format torch_dist checkpoints "
                         f"(Megatron-LM's rule), not {args.ckpt_format}; add --ckpt-format "
                         f"torch_dist")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ValueError(f"--ckpt-step ({args.ckpt_step}) is the iteration to load: give a "
                         f"saved iteration (>= 1), or drop it to load the latest")
    retain, every = args.save_retain_interval, args.save_interval
    if retain is not None and not (every and retain >= 1 and retain % every == 0):
        need = f"--save-interval ({every})" if every else "--save --save-interval N"
        raise ValueError(f"--save-retain-interval ({retain}) keeps the checkpoints at its "
                         f"multiples, so it must be a positive multiple of {need}")


# the sections whose settings the FSDPs' companions are (fsdp.argument_problems)
_FSDP2_SECTIONS = (OptimizerConfig, ParallelConfig, CheckpointConfig, TrainingConfig)


def _validate_fsdp2(args):
    """--use-torch-fsdp2's and --use-megatron-fsdp's companions (megatron_cp.distributed.fsdp),
    and --ckpt-format fsdp_dtensor's, read from the sections that hold them."""
    problems = fsdp.argument_problems(*(build_config(s, args) for s in _FSDP2_SECTIONS))
    if problems:
        raise ArgumentErrors(problems)


def _validate_dynamic_cp(args):
    """--dynamic-context-parallel's rules and start-up note (megatron_cp/config/dynamic_cp.py)."""
    parallel, training = (build_config(section, args) for section in (ParallelConfig, TrainingConfig))
    model = build_config(GPTConfig, args, vocab_size=1) if args.dynamic_context_parallel else None
    problems = dynamic_cp_problems(parallel, training, model, args.seq_length,
                                   args.use_torch_fsdp2, args.use_megatron_fsdp)
    if problems:
        raise ArgumentErrors(problems)
    args.compat_notes += [dynamic_cp_note(parallel)] if parallel.dynamic_context_parallel else []


def _validate_rerun_and_wandb(args):
    """The rerun engine's flags (rerun.py) and Weights & Biases' (wandb_logging.py), read from
    the sections they configure."""
    problems = (rerun.flag_problems(build_config(TrainingConfig, args))
                + wandb_logging.flag_problems(build_config(LoggingConfig, args), args.save))
    if problems:
        raise ArgumentErrors(problems)


def _check_writable(path):
    """--save must be a directory this process can write, or creatable under one: checked
    now, not at the first save after hours of training (nothing is created here)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--save {path}: {existing} is a file, not a directory; give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--save {path}: {existing} is not writable (read-only or another "
                         f"user's); give a directory you can write")


def _validate_model(args, names, sizes_ok=True):
    """Build the model config from the flags, run its own rules (naming flags, not fields) and
    write its derived values back to ``args``; its rules of the parallel sizes only when the
    sizes themselves passed (``sizes_ok``: a size of 0 is already a line of its own)."""
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    try:
        config = build_config(GPTConfig, args, vocab_size=1)  # (no rule needs the vocabulary)
        if sizes_ok:
            config.validate_parallel(args.tensor_model_parallel_size, args.context_parallel_size)
            config.validate_experts(args.expert_model_parallel_size,
                                    args.expert_tensor_parallel_size)
            config.check_fp8(args.pipeline_model_parallel_size, args.context_parallel_size,
                             args.expert_tensor_parallel_size)
        args.compat_notes += config.fp8_checks_and_notes(args.fp8_param_gather)
        # pad tokens repeat their document's last position: only real positions need rows
        config.check_positions(args.seq_length, "seq_length")
        _check_quantile_share(config, args.micro_batch_size * args.seq_length)
    except ValueError as err:
        raise ValueError(name_flags(str(err), names)) from err
    fill_args(config, args)


def _check_quantile_share(config, tokens):
    """Quantile balancing's fair share of a microbatch's ``tokens``: tokens x top-k routed
    assignments must divide over the experts (Megatron-LM's qb_dual_update asserts it)."""
    if (config.num_moe_experts and config.moe_router_load_balancing_type == "quantile_balancing"
            and tokens * config.moe_router_topk % config.num_moe_experts):
        raise ValueError(f"moe_router_load_balancing_type 'quantile_balancing' gives each expert "
                         f"a fair share of a microbatch's micro_batch_size x seq_length "
                         f"({tokens}) tokens x moe_router_topk ({config.moe_router_topk}) "
                         f"assignments, which must divide by num_moe_experts "
                         f"({config.num_moe_experts}) (Megatron-LM's rule); change one of them")


def _samples_to_iters(samples, global_batch_size):
    """Megatron's sample-based schedule in iterations: fractional where the batch does not
    divide, so every step gets the rate Megatron gives it (a constant batch size; under a
    --step-batch-size-schedule the scheduler counts samples instead)."""
    iters = samples / global_batch_size
    return int(iters) if iters.is_integer() else iters


def _validate_schedule(args):
    """Training length, learning-rate and weight-decay schedule."""
    if args.train_iters is None and args.train_samples is None:
        raise ValueError("give --train-iters (or --train-samples)")
    sample_flags = args.lr_decay_samples is not None or args.lr_warmup_samples > 0
    if sample_flags and (args.train_samples is None or args.train_iters is not None):
        raise ValueError("--lr-decay-samples / --lr-warmup-samples give a sample-based schedule, "
                         "which goes with --train-samples alone; with --train-iters use "
                         "--lr-decay-iters / --lr-warmup-iters")
    if sample_flags and (args.lr_decay_iters is not None or args.lr_warmup_iters > 0):
        raise ValueError("give the learning-rate schedule in samples (--lr-decay-samples, "
                         "--lr-warmup-samples) or in iterations (--lr-decay-iters, "
                         "--lr-warmup-iters), not both")
    schedule = BatchSchedule.from_config(build_config(TrainingConfig, args),
                                         build_config(ParallelConfig, args))
    if schedule.stepped and args.train_samples is not None and (
            args.lr_decay_iters is not None or args.lr_warmup_iters > 0):
        raise ValueError("with --step-batch-size-schedule and --train-samples the "
                         "learning-rate schedule counts samples: give --lr-decay-samples / "
                         "--lr-warmup-samples instead of --lr-decay-iters / --lr-warmup-iters")
    if args.train_iters is None:
        args.train_iters = schedule.iterations_for(args.train_samples) if schedule.stepped \
            else math.ceil(args.train_samples / args.global_batch_size)
    if args.lr is None:
        raise ValueError("give --lr, the peak learning rate")
    if args.lr_decay_samples is not None:
        args.lr_decay_iters = _samples_to_iters(args.lr_decay_samples, args.global_batch_size)
    if args.lr_warmup_samples > 0:
        args.lr_warmup_iters = _samples_to_iters(args.lr_warmup_samples, args.global_batch_size)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    # the scheduler's unit: iterations, or samples once the batch size steps (Megatron's)
    args.lr_counts_samples = schedule.stepped
    if schedule.stepped:
        args.lr_warmup_steps, args.lr_decay_steps, args.wd_incr_steps = _lr_lengths_in_samples(args)
        if args.lr_warmup_steps >= args.lr_decay_steps and args.lr_warmup_steps > 0:
            raise ValueError(f"the learning-rate warmup ({args.lr_warmup_steps} samples) must "
                             f"be shorter than its decay ({args.lr_decay_steps} samples); "
                             f"shorten the warmup or lengthen the decay")
    else:
        args.lr_warmup_steps, args.lr_decay_steps = args.lr_warmup_iters, args.lr_decay_iters
        args.wd_incr_steps = args.train_iters
        if args.lr_warmup_iters >= args.lr_decay_iters and args.lr_warmup_iters > 0:
            raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than "
                             f"--lr-decay-iters ({args.lr_decay_iters}, default --train-iters); "
                             f"shorten the warmup or lengthen the decay")
    args.wsd_decay_steps = _wsd_decay_steps(args, schedule.stepped)
    given = [flag for flag, value in (("--start-weight-decay", args.start_weight_decay),
                                      ("--end-weight-decay", args.end_weight_decay))
             if value is not None]
    style = args.weight_decay_incr_style
    if style == "constant" and given:
        raise ValueError(f"{' and '.join(given)} need --weight-decay-incr-style linear or cosine; "
                         f"for a constant weight decay give --weight-decay")
    if style != "constant" and len(given) != 2:
        raise ValueError(f"--weight-decay-incr-style {style} needs both --start-weight-decay and "
                         f"--end-weight-decay")
    if style != "constant" and not 0.0 <= args.start_weight_decay <= args.end_weight_decay:
        raise ValueError(f"need 0 <= --start-weight-decay ({args.start_weight_decay}) <= "
                         f"--end-weight-decay ({args.end_weight_decay})")
    # DDP takes the bucket size in MB of its fp32 gradient buffer; Megatron counts elements.
    args.ddp_bucket_size_mb = 40.0 if args.ddp_bucket_size is None else \
        args.ddp_bucket_size * 4 / 2 ** 20


def _wsd_decay_steps(args, in_samples):
    """WSD's annealing length in the scheduler's unit (samples when ``in_samples``, else
    iterations), None without WSD. As Megatron-LM: --lr-wsd-decay-iters with --train-iters
    (times --global-batch-size in samples), --lr-wsd-decay-samples with --train-samples; its
    scheduler stops without the one its training length reads."""
    by_samples = args.train_samples is not None
    flags = {"--lr-wsd-decay-iters": args.lr_wsd_decay_iters,
             "--lr-wsd-decay-samples": args.lr_wsd_decay_samples}
    given = [flag for flag, value in flags.items() if value is not None]
    if args.lr_decay_style != "WSD":
        if args.lr_wsd_decay_style != "exponential":
            given.append(f"--lr-wsd-decay-style {args.lr_wsd_decay_style}")
        if given:
            one = len(given) == 1
            raise ValueError(f"{' and '.join(given)} {'shapes' if one else 'shape'} the "
                             f"annealing of --lr-decay-style WSD, and the decay style is "
                             f"{args.lr_decay_style}; add --lr-decay-style WSD or drop "
                             f"{'it' if one else 'them'}")
        return None
    flag, length = ("--train-samples", "--train-iters") if by_samples else \
        ("--train-iters", "--train-samples")
    own = "--lr-wsd-decay-samples" if by_samples else "--lr-wsd-decay-iters"
    other = "--lr-wsd-decay-iters" if by_samples else "--lr-wsd-decay-samples"
    if flags[other] is not None:
        raise ValueError(f"{other} goes with {length}; with {flag} give the annealing phase "
                         f"of --lr-decay-style WSD as {own}")
    value = flags[own]
    if value is None:
        raise ValueError(f"--lr-decay-style WSD needs {own} (the length of its annealing "
                         f"phase, at the end of the decay) with {flag}")
    if value < 0:
        raise ValueError(f"{own} ({value}) must be >= 0")
    if by_samples:
        return value if in_samples else _samples_to_iters(value, args.global_batch_size)
    return value * args.global_batch_size if in_samples else value


def _lr_lengths_in_samples(args):
    """``(warmup, decay, weight-decay increment)`` in samples, the unit of Megatron-LM's
    scheduler, which each iteration steps by its global batch size: what a batch-size
    schedule needs. With --train-samples the sample flags (decay default --train-samples);
    with --train-iters the iteration flags times --global-batch-size, which a schedule
    leaves at micro batch x DP (Megatron-LM's formula). --lr-warmup-fraction is a fraction
    of the decay."""
    if args.train_samples is not None:
        decay = args.train_samples if args.lr_decay_samples is None else args.lr_decay_samples
        warmup, weight_decay = args.lr_warmup_samples, args.train_samples
    else:
        per_iteration = args.global_batch_size
        decay = args.lr_decay_iters * per_iteration
        warmup, weight_decay = args.lr_warmup_iters * per_iteration, args.train_iters * per_iteration
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return warmup, decay, weight_decay


def _validate_data(args, need_data=True):
    """A data source (when ``need_data``) whose files exist and open."""
    split_paths = any(vars(args).get(f"{split}_data_path") for split in ("train", "valid", "test"))
    if need_data and not args.mock_data and not split_paths:  # those are refused (the table)
        if not args.data_path:
            raise ValueError("no data: give --data-path PREFIX (from tools/preprocess_data.py) "
                             "or --mock-data")
        if args.tokenizer_type is None:
            raise ValueError("--data-path needs --tokenizer-type (and its model or vocab files)")
        check_data_files(args.data_path)


def _validate_split(args):
    try:
        parse_and_normalize_split(args.split)
    except ValueError as err:
        raise ValueError(f"--{err}") from None


def _validate_tokenizer(args):
    """The tokenizer is built here (and its package installed), has what it needs, and its
    files exist."""
    from megatron_cp.data import tokenizers
    kind = args.tokenizer_type
    if kind in NOT_BUILT_TOKENIZERS:
        raise ValueError(f"--tokenizer-type {kind}: {NOT_BUILT_TOKENIZERS[kind]}")
    if kind == "TikTokenizer":
        if not tokenizers.tiktoken_available():
            raise ValueError(tokenizers.TIKTOKEN_MISSING)
        tokenizers.check_tiktoken_settings(args.special_tokens, args.tiktoken_num_special_tokens,
                                           args.vocab_size)
    needs_model = SENTENCEPIECE_TYPES + ("HuggingFaceTokenizer", "TikTokenizer")
    if kind in needs_model and not args.tokenizer_model:
        raise ValueError(f"--tokenizer-type {kind} needs --tokenizer-model")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    _check_tokenizer_files(args)
    if (args.tokenizer_type == "NullTokenizer" or (args.mock_data and args.tokenizer_type is None)) \
            and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer (and --mock-data without a tokenizer) "
                         "needs --vocab-size")


def check_data_files(data_path, mmap_bin=True, open_files=False):
    """Every ``--data-path`` prefix has its .bin and .idx files; with ``open_files`` they also
    open and fit (a wrong magic, a truncated index, a .bin shorter than the index: the file
    named), a scan of the whole index that the launch scripts' one-process check makes and
    the dataset build makes again, not every rank at start-up."""
    from megatron_cp.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path
    from megatron_cp.data.utils import parse_data_path
    prefixes, _ = parse_data_path(data_path)
    for prefix in prefixes:
        missing = [p for p in (data_file_path(prefix), index_file_path(prefix))
                   if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"--data-path {prefix}: {' and '.join(missing)} not found; build "
                             f"them with tools/preprocess_data.py (or "
                             f"examples/prepare_pydoc_data.sh)")
        if open_files:
            IndexedDataset(prefix, mmap_bin=mmap_bin)


def _check_tokenizer_files(args):
    """The tokenizer's files exist (a Hugging Face --tokenizer-model may also be a hub name),
    and a sentencepiece --tokenizer-model is the binary .model, not its .vocab listing."""
    files = []
    if args.tokenizer_type in SENTENCEPIECE_TYPES + ("TikTokenizer",):
        files.append(("--tokenizer-model", args.tokenizer_model))
        if args.tokenizer_type != "TikTokenizer" and args.tokenizer_model.endswith(".vocab"):
            model = args.tokenizer_model[:-len(".vocab")] + ".model"
            raise ValueError(f"--tokenizer-model {args.tokenizer_model} is sentencepiece's "
                             f"vocabulary listing; give the model file ({model})")
    if args.tokenizer_type == "GPT2BPETokenizer":
        files += [("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)]
    for flag, path in files:
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")


def _validate_pipeline(args, check_microbatches=True, eval_counted=True):
    """Stage split (the layout the split flags describe), virtual stages, interleaving's
    microbatch rule (when ``check_microbatches``: evaluation pads its own microbatch count,
    known when ``eval_counted``) and the buffer length."""
    pp = args.pipeline_model_parallel_size
    layout = layout_from_config(build_config(ParallelConfig, args), args.num_layers,
                                args.mtp_num_layers)
    args.virtual_pipeline_model_parallel_size = layout.vp_size if layout.vp_size > 1 else None
    if check_microbatches:
        evaluation = [args.eval_num_microbatches] if eval_counted and args.eval_iters > 0 \
            else []
        for count in sorted(set(_microbatch_counts(args) + evaluation)):
            validate_interleaved_microbatches(count, pp, args.virtual_pipeline_model_parallel_size,
                                              args.microbatch_group_size_per_vp_stage)
    if args.pipeline_seq_length is None:
        return  # the pipeline buffers follow each step's data
    if args.pipeline_seq_length < args.seq_length:
        raise ValueError(f"--pipeline-seq-length ({args.pipeline_seq_length}) must be at least "
                         f"--seq-length ({args.seq_length}): every microbatch is padded to it")
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    divisor = (2 * cp if cp > 1 else 1) * (tp if args.sequence_parallel else 1)
    if args.pipeline_seq_length % divisor != 0:
        raise ValueError(f"--pipeline-seq-length ({args.pipeline_seq_length}) must be divisible by "
                         f"{'2 x CP' if cp > 1 else '1'}{' x TP' if args.sequence_parallel else ''} "
                         f"= {divisor}; use a multiple of {divisor}")