"""The layouts a training command line leaves open, ranked by their predicted memory, step
time and longest sequence, best first.

A dimension the command line sets itself (``--tensor-model-parallel-size 2``,
``--recompute-granularity full``, ``--use-distributed-optimizer`` ...) stays as given; the
others are searched: TP, CP with its comm type (p2p ring or a2a Ulysses), PP with 1 or 2
virtual stages, EP (MoE models), recompute (none, selective, full uniform 1 layer) and the
distributed optimizer. DP is what is left of the GPU count.

The parallel layouts come in as runs (:class:`~megatron_cp.config.run.RunConfig`), one per
layout the argument validation accepts: ``tools/plan_layout.py``, the command-line front, puts
each candidate's flags through :func:`megatron_cp.cli.arguments.parse_args` for the GPU count,
so a layout our validation refuses is never listed (the rules live there, once). The recompute
and optimizer variants of a run replace fields of its sections (``dataclasses.replace``),
which re-runs the sections' checks.
"""
from dataclasses import asdict, dataclass, replace

from megatron_cp.planning.memory import estimate_memory
from megatron_cp.planning.step_time import predict_step_time

RECOMPUTE = {"none": (None, None, None), "selective": ("selective", None, None),
             "full": ("full", "uniform", 1)}


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


def _variants(run, open_dims):
    """``run`` with each open recompute / optimizer choice (the model's checks refuse a
    recompute the model cannot take: that variant is left out)."""
    recomputes = RECOMPUTE if "recompute" in open_dims else {None: None}
    parallel = run.parallel
    shards = parallel.data_parallel_size * parallel.context_parallel_size > 1
    optimizers = [False, True] if "distributed_optimizer" in open_dims and shards else [None]
    for setting in recomputes.values():
        model = run.model
        if setting is not None:
            granularity, method, num_layers = setting
            try:
                model = replace(model, recompute_granularity=granularity,
                                recompute_method=method, recompute_num_layers=num_layers)
            except ValueError:
                continue
        for distributed in optimizers:
            optimizer = run.optimizer
            if distributed is not None:
                optimizer = replace(optimizer, use_distributed_optimizer=distributed)
            yield replace(run, model=model, optimizer=optimizer)


def recompute_name(model):
    """"none", "selective", or "full/<method>/<layers>" of the model config ``model``."""
    if model.recompute_granularity is None:
        return "none"
    if model.recompute_granularity == "selective":
        return "selective"
    return f"full/{model.recompute_method}/{model.recompute_num_layers or 1}"


def sequence_unit(run):
    """The step a sequence length must move in for ``run``'s layout (2 x CP x TP under SP)."""
    cp, tp = run.parallel.context_parallel_size, run.parallel.tensor_model_parallel_size
    return (2 * cp if cp > 1 else 1) * (tp if run.model.sequence_parallel else 1)


def with_seq_length(run, seq_length, positions_follow=False):
    """``run`` training on sequences of ``seq_length`` tokens; with ``positions_follow`` its
    learned position table (--max-position-embeddings) as long."""
    model = run.model
    if positions_follow:
        model = replace(model, max_position_embeddings=seq_length)
    return replace(run, data=replace(run.data, seq_length=seq_length), model=model)


def max_seq_length(run, cap_bytes, device="cpu", limit=2 ** 25):
    """The longest sequence (a multiple of :func:`sequence_unit`) whose predicted memory is
    at most ``cap_bytes``; 0 when not even one unit fits. Memory grows with the length: from
    the run's own length, double (or halve) to bracket the answer, then bisect."""
    unit = sequence_unit(run)
    model, seq_length = run.model, run.data.seq_length
    # learned positions: a table of --max-position-embeddings rows, which defaults to the
    # sequence length (arguments.py) and then grows with it; one given caps the length
    positions_follow = model.max_position_embeddings == seq_length
    if model.position_embedding_type == "learned_absolute" and not positions_follow:
        limit = min(limit, model.max_position_embeddings)
    top = limit // unit

    def fits(n):
        trial = with_seq_length(run, n * unit, positions_follow)
        return estimate_memory(trial, device).total_bytes <= cap_bytes
    n = min(max(1, seq_length // unit), top)
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


def plan_layouts(runs, open_dims, cap_bytes, rates, device="cpu"):
    """Every layout of ``runs`` (a RunConfig for each parallel layout the argument validation
    accepts) with each recompute / distributed optimizer choice of ``open_dims`` (the
    dimensions the command line leaves open: "recompute", "distributed_optimizer", ...) as
    :class:`PlannedLayout` rows, best first: those that fit, fastest first (the smaller
    memory first among equals), then the rest by memory."""
    rows, seen = [], set()
    for layout_run in runs:
        for run in _variants(layout_run, open_dims):
            row = _row(run, cap_bytes, rates, device)
            key = tuple(asdict(row).items())
            if key not in seen:
                seen.add(key)
                rows.append(row)
    rows.sort(key=lambda r: (not r.fits, r.step_time_s if r.fits else 0, r.memory_bytes))
    return rows


def _row(run, cap_bytes, rates, device):
    memory = estimate_memory(run, device).total_bytes
    parallel = run.parallel
    cp = parallel.context_parallel_size
    return PlannedLayout(
        tp=parallel.tensor_model_parallel_size, cp=cp,
        cp_comm_type=" ".join(run.model.cp_comm_types()) if cp > 1 else "none",
        pp=parallel.pipeline_model_parallel_size,
        vp=parallel.virtual_pipeline_model_parallel_size or 1,
        dp=parallel.data_parallel_size, ep=parallel.expert_model_parallel_size,
        recompute=recompute_name(run.model),
        distributed_optimizer=run.optimizer.use_distributed_optimizer,
        memory_bytes=memory, step_time_s=predict_step_time(run, rates),
        max_seq_length=max_seq_length(run, cap_bytes, device),
        fits=memory <= cap_bytes)
