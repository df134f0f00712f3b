"""The layouts a training command line leaves open, the ones the argument validation accepts,
and their predicted memory, step time and longest sequence, best first.

A dimension the command line sets itself (``--tensor-model-parallel-size 2``,
``--recompute-granularity full``, ``--use-distributed-optimizer`` ...) stays as given; the
others are searched: TP, CP with its comm type (p2p ring or a2a Ulysses), PP with 1 or 2
virtual stages, EP (MoE models), recompute (none, selective, full uniform 1 layer) and the
distributed optimizer. DP is what is left of the GPU count. Each candidate's layout flags go
through :func:`megatron_cp.cli.arguments.parse_args` for the GPU count: a layout our validation
refuses is never listed (the rules live there, once).
"""
import copy
from dataclasses import asdict, dataclass

from megatron_cp.cli.arguments import build_parser, parse_args
from megatron_cp.checkpoint.use_checkpoint_args import given_on_command_line
from megatron_cp.planning.memory import estimate_memory, tokenizer_vocab_size
from megatron_cp.planning.step_time import predict_step_time

RECOMPUTE = {"none": (None, None, None), "selective": ("selective", None, None),
             "full": ("full", "uniform", 1)}
# the arguments each open dimension owns (given on the command line: not searched)
DIMENSIONS = {
    "tp": ("tensor_model_parallel_size",),
    "cp": ("context_parallel_size", "cp_comm_type"),
    "pp": ("pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
           "num_virtual_stages_per_pipeline_rank"),
    "ep": ("expert_model_parallel_size",),
    "recompute": ("recompute_granularity", "recompute_method", "recompute_num_layers"),
    "distributed_optimizer": ("use_distributed_optimizer",),
}


@dataclass
class PlannedLayout:
    """One row of the plan (the ``--json`` fields, plus vp and the distributed optimizer)."""
    tp: int
    cp: int
    cp_comm_type: str
    pp: int
    vp: int
    dp: int
    ep: int
    recompute: str
    distributed_optimizer: bool
    memory_bytes: int
    step_time_s: float
    max_seq_length: int
    fits: bool


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout_argvs(argv, num_gpus, open_dims, num_experts):
    """(dimension values, extra argv) of every layout whose sizes divide ``num_gpus``."""
    base = {"tp": [None], "cp": [(None, None)], "pp": [(None, None)], "ep": [None]}
    if "tp" in open_dims:
        base["tp"] = _divisors(num_gpus)
    if "cp" in open_dims:
        base["cp"] = [(1, None)] + [(c, t) for c in _divisors(num_gpus) if c > 1
                                    for t in ("p2p", "a2a")]
    if "pp" in open_dims:
        base["pp"] = [(1, None)] + [(p, v) for p in _divisors(num_gpus) if p > 1 for v in (1, 2)]
    if "ep" in open_dims and num_experts:
        base["ep"] = [e for e in _divisors(num_gpus) if num_experts % e == 0]
    for tp in base["tp"]:
        for cp, comm in base["cp"]:
            for pp, vp in base["pp"]:
                for ep in base["ep"]:
                    sizes = [x or 1 for x in (tp, cp, pp)]
                    if num_gpus % (sizes[0] * sizes[1] * sizes[2]):
                        continue
                    extra = []
                    if tp is not None:
                        extra += ["--tensor-model-parallel-size", str(tp)]
                        if tp > 1:
                            extra += ["--sequence-parallel"]
                    if cp is not None:
                        extra += ["--context-parallel-size", str(cp)]
                        extra += ["--cp-comm-type", comm] if comm else []
                    if pp is not None:
                        extra += ["--pipeline-model-parallel-size", str(pp)]
                        if vp and vp > 1:
                            extra += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
                    if ep is not None:
                        extra += ["--expert-model-parallel-size", str(ep)]
                    yield argv + extra


def _variants(args, open_dims):
    """Copies of validated ``args`` with each open recompute / optimizer choice."""
    recomputes = RECOMPUTE if "recompute" in open_dims else {None: None}
    shards = args.data_parallel_size * args.context_parallel_size > 1
    optimizers = [False, True] if "distributed_optimizer" in open_dims and shards else [None]
    for name, setting in recomputes.items():
        for distributed in optimizers:
            variant = copy.copy(args)
            if setting is not None:
                (variant.recompute_granularity, variant.recompute_method,
                 variant.recompute_num_layers) = setting
            if distributed is not None:
                variant.use_distributed_optimizer = distributed
            yield variant


def recompute_name(args):
    """"none", "selective", or "full/<method>/<layers>"."""
    if args.recompute_granularity is None:
        return "none"
    if args.recompute_granularity == "selective":
        return "selective"
    return f"full/{args.recompute_method}/{args.recompute_num_layers or 1}"


def sequence_unit(args):
    """The step a sequence length must move in for this layout (2 x CP x TP under SP)."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    return (2 * cp if cp > 1 else 1) * (tp if args.sequence_parallel else 1)


def max_seq_length(args, cap_bytes, device="cpu", vocab_size=None, limit=2 ** 25):
    """The longest sequence (a multiple of :func:`sequence_unit`) whose predicted memory is
    at most ``cap_bytes``; 0 when not even one unit fits. Memory grows with the length: from
    the run's own length, double (or halve) to bracket the answer, then bisect."""
    unit = sequence_unit(args)
    vocab_size = vocab_size or tokenizer_vocab_size(args)  # once, not per trial
    # learned positions: a table of --max-position-embeddings rows, which defaults to the
    # sequence length (arguments.py) and then grows with it; one given caps the length
    positions_follow = args.max_position_embeddings == args.seq_length
    if args.position_embedding_type == "learned_absolute" and not positions_follow:
        limit = min(limit, args.max_position_embeddings)
    top = limit // unit

    def fits(n):
        trial = copy.copy(args)
        trial.seq_length = n * unit
        if positions_follow:
            trial.max_position_embeddings = trial.seq_length
        return estimate_memory(trial, vocab_size, device).total_bytes <= cap_bytes
    n = min(max(1, args.seq_length // unit), top)
    if fits(n):
        lo, hi = n, min(2 * n, top)
        while hi < top and fits(hi):
            lo, hi = hi, min(2 * hi, top)
        if fits(hi):
            return hi * unit
    else:
        lo, hi = n // 2, n - 1
        while lo > 0 and not fits(lo):
            lo, hi = lo // 2, lo - 1
        if lo == 0:
            return 0
    while lo < hi:  # fits(lo), and every length above hi does not
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


def plan_layouts(argv, num_gpus, cap_bytes, rates, device="cpu", vocab_size=None):
    """Every accepted layout of ``argv`` (pretrain_gpt.py's flags) on ``num_gpus`` ranks as
    :class:`PlannedLayout` rows, best first: those that fit, fastest first (the smaller
    memory first among equals), then the rest by memory."""
    given = given_on_command_line(build_parser(), argv)
    open_dims = {dim for dim, dests in DIMENSIONS.items() if not given & set(dests)}
    num_experts = parse_args(argv, world_size=1 if open_dims else num_gpus).num_experts \
        if "ep" in open_dims else None
    rows, seen = [], set()
    for candidate in _layout_argvs(list(argv), num_gpus, open_dims, num_experts):
        try:
            layout_args = parse_args(candidate, world_size=num_gpus)
        except ValueError:
            continue  # the validation refuses this layout
        vocab_size = vocab_size or tokenizer_vocab_size(layout_args)  # once, not per layout
        for args in _variants(layout_args, open_dims):
            row = _row(args, cap_bytes, rates, device, vocab_size)
            key = tuple(asdict(row).items())
            if row is not None and key not in seen:
                seen.add(key)
                rows.append(row)
    rows.sort(key=lambda r: (not r.fits, r.step_time_s if r.fits else 0, r.memory_bytes))
    return rows


def _row(args, cap_bytes, rates, device, vocab_size):
    try:
        memory = estimate_memory(args, vocab_size, device).total_bytes
    except ValueError:  # a recompute variant the model config refuses
        return None
    cp = args.context_parallel_size
    return PlannedLayout(
        tp=args.tensor_model_parallel_size, cp=cp,
        cp_comm_type=args.cp_comm_type if cp > 1 else "none",
        pp=args.pipeline_model_parallel_size,
        vp=args.virtual_pipeline_model_parallel_size or 1,
        dp=args.data_parallel_size, ep=args.expert_model_parallel_size,
        recompute=recompute_name(args),
        distributed_optimizer=args.use_distributed_optimizer,
        memory_bytes=memory, step_time_s=predict_step_time(args, rates, vocab_size),
        max_seq_length=max_seq_length(args, cap_bytes, device, vocab_size),
        fits=memory <= cap_bytes)
