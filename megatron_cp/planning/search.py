"""The settings of each parallel layout that train fastest within the memory limits, and the
longest sequence each layout trains at.

The parallel layouts come in as runs (:class:`~megatron_cp.config.run.RunConfig`), one per
layout the argument validation accepts (``plan_layout.py`` puts each candidate's flags
through :func:`megatron_cp.cli.arguments.parse_args`, so the rules live there, once). On each
the search tries the open levers of ``levers.py`` (CP comm type, FSDP2 or the distributed
optimizer, tiled logits, tiled MLP, recompute, activation offload): a *family* takes one
option of every lever, and its ladder of rungs climbs the options' ladders one after the
other (the cheapest savings first), each rung saving memory and costing time. A variant
fits when the predicted device bytes of the most loaded rank are at most the cap and, with
a host limit, the host bytes of the ranks of one node at most the host memory.

- :func:`fastest_fitting`: per layout, the fastest variant that fits (families in order of
  their plain rung's predicted time, stopping when no later family can be faster; in a
  family the first rung that fits, by bisection: offloading is tried only when nothing
  else fits).
- :func:`longest_sequence`: per layout, the longest sequence of its most saving family
  (every saving lever at its top, offloading as many layers as the host memory takes),
  and the term that stops it.
"""
import functools
import itertools
from dataclasses import dataclass, field, replace

from megatron_cp.distributed.initialize import rank_layout
from megatron_cp.planning.levers import Context, optimizer_name, recompute_name
from megatron_cp.planning.memory import estimate_memory, offloaded_activation_bytes
from megatron_cp.planning.step_time import predict_step_time

SEQ_LIMIT = 2 ** 25  # the longest sequence searched


@dataclass
class PlannedLayout:
    """One row of the plan (the ``--json`` fields): the layout, its lever settings, and at
    ``seq_length`` the predicted device bytes (``memory_parts``: the estimate's terms),
    host bytes of one node and step time; ``max_seq_length``: the longest sequence the
    layout trains at, and ``limiting_term`` what stops it there (the largest term of the
    device estimate, or "host"); ``flags``: the pretrain_gpt.py flags of the layout and
    its settings, to add to the planned line (``--seq-length`` excluded)."""
    tp: int
    cp: int
    cp_comm_type: str
    pp: int
    vp: int
    dp: int
    ep: int
    recompute: str
    optimizer: str
    offload_layers: int
    tiled_logits_chunk_size: int
    mlp_chunks: int
    seq_length: int
    memory_bytes: int
    host_bytes: int
    step_time_s: float
    max_seq_length: int
    limiting_term: str
    fits: bool
    memory_parts: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)
    optimizer_offload_fraction: float = 0.0  # of the optimizer state on the host


@dataclass(frozen=True)
class Limits:
    """The caps a variant must fit: ``device_bytes`` per rank; ``host_bytes`` per node of
    ``gpus_per_node`` ranks (None: no host limit, and nothing offloaded); ``device``: "cpu"
    or "gpu" (which kernels, and whether offloading moves anything)."""
    device_bytes: int
    host_bytes: int | None = None
    gpus_per_node: int = 8
    device: str = "cpu"

    @property
    def context(self):
        return Context(self.device, self.host_bytes is not None)


@dataclass
class Trial:
    """A run's prediction: its memory estimate, the host bytes of its fullest node, and
    whether each fits its limit."""
    run: object
    memory: object
    host_bytes: int
    fits_device: bool
    fits_host: bool

    @property
    def fits(self):
        return self.fits_device and self.fits_host


@functools.lru_cache(maxsize=256)
def _node_stages(world, tp, cp, pp, ep, etp, order, gpus_per_node):
    """Per node of ``gpus_per_node`` consecutive ranks: how many of its ranks each pipeline
    stage has."""
    layout = rank_layout(world, tp, cp, pp, ep, etp, order=order)
    stage = {rank: s for group in layout["pp"] for s, rank in enumerate(group)}
    nodes = []
    for first in range(0, world, gpus_per_node):
        counts = [0] * pp
        for rank in range(first, min(first + gpus_per_node, world)):
            counts[stage[rank]] += 1
        nodes.append(tuple(counts))
    return tuple(set(nodes))


def node_host_bytes(run, memory, limits):
    """Host bytes of the fullest node: each rank's offloaded activations (by its pipeline
    stage) plus what the memory estimate keeps in host memory (``host_bytes``, when the
    estimate has one: the optimizer state on the host), summed over a node's ranks."""
    p = run.parallel
    per_stage = offloaded_activation_bytes(run, limits.device)
    extra = memory.host_bytes
    nodes = _node_stages(p.world_size, p.tensor_model_parallel_size, p.context_parallel_size,
                         p.pipeline_model_parallel_size, p.expert_model_parallel_size,
                         p.expert_tensor_parallel_size, p.rank_order, limits.gpus_per_node)
    return max(sum(n * (b + extra) for n, b in zip(counts, per_stage)) for counts in nodes)


def evaluate(run, limits):
    """The :class:`Trial` of ``run`` under ``limits``."""
    memory = estimate_memory(run, limits.device)
    host = node_host_bytes(run, memory, limits)
    return Trial(run, memory, host, memory.total_bytes <= limits.device_bytes,
                 limits.host_bytes is None or host <= limits.host_bytes)


class Family:
    """One option (a ladder of values) of every lever of ``levers``; its rungs climb the
    ladders one after the other, in the levers' order."""

    def __init__(self, levers, options):
        self.levers, self.options = levers, options
        position = [0] * len(options)
        self.rungs = [tuple(ladder[0] for ladder in options)]
        for i, ladder in enumerate(options):
            for step in range(1, len(ladder)):
                position[i] = step
                self.rungs.append(tuple(o[p] for o, p in zip(options, position)))

    def run(self, base, rung):
        """``base`` (a run at its sequence length) with rung ``rung``'s settings; ValueError
        when a section's check or a lever's check refuses them."""
        out = base
        for lever, value in zip(self.levers, self.rungs[rung]):  # each sees the ones before
            changed = {name: fields for name, fields in lever.settings(out, value).items()
                       if any(getattr(getattr(out, name), k) != v for k, v in fields.items())}
            if changed:  # a copy re-runs every section's checks: only for a real change
                out = replace(out, **{name: replace(getattr(out, name), **fields)
                                      for name, fields in changed.items()})
        for lever in self.levers:
            lever.check(out)
        return out

    def trial(self, base, rung, limits):
        """The :class:`Trial` of rung ``rung`` on ``base``, or None when it is refused."""
        try:
            return evaluate(self.run(base, rung), limits)
        except ValueError:
            return None

    def first_fitting(self, base, limits):
        """(fits, trial): the first rung that fits (device memory falls and host memory grows
        along the ladder: the first rung under the device cap, then its host check), else
        the rung with the least device memory."""
        first = self.trial(base, 0, limits)
        if first is not None and first.fits or len(self.rungs) == 1:
            return bool(first and first.fits), first
        top = len(self.rungs) - 1
        last = self.trial(base, top, limits)
        if last is None or not last.fits_device:
            return False, last
        def over(rung):
            trial = self.trial(base, rung, limits)
            return not (trial is not None and trial.fits_device), trial
        _, found = _bisect(0, first, top, last, over)  # rung 0 is over the device cap
        return found.fits, found

    def saving_tops(self, ladders):
        """This family's trade-off options with every combination of the saving levers'
        options (``ladders``: each lever's options), the most saving first: what saves most
        at one length need not at another (tiled logits sum an fp32 weight gradient, which
        only long sequences repay)."""
        choices = [[option] if not lever.saving else list(reversed(options))
                   for lever, option, options in zip(self.levers, self.options, ladders)]
        return [Family(self.levers, list(combination))
                for combination in itertools.product(*choices)]


def families(base, levers, context):
    """(each lever's options on ``base``, every :class:`Family` of them)."""
    ladders = [lever.ladders(base, context) for lever in levers]
    return ladders, [Family(levers, list(options)) for options in itertools.product(*ladders)]


def sequence_unit(run):
    """The step a sequence length must move in for ``run``'s layout (2 x CP x TP under SP)."""
    cp, tp = run.parallel.context_parallel_size, run.parallel.tensor_model_parallel_size
    return (2 * cp if cp > 1 else 1) * (tp if run.model.sequence_parallel else 1)


def _positions_follow(run):
    """Whether ``run``'s learned position table (--max-position-embeddings) defaults to the
    sequence length (arguments.py) and so grows with it."""
    return run.model.max_position_embeddings == run.data.seq_length


def with_seq_length(run, seq_length, positions_follow=False):
    """``run`` training on sequences of ``seq_length`` tokens; with ``positions_follow`` its
    learned position table (--max-position-embeddings) as long."""
    model = run.model
    if positions_follow:
        model = replace(model, max_position_embeddings=seq_length)
    return replace(run, data=replace(run.data, seq_length=seq_length), model=model)


def _length_limit(run, limit):
    model = run.model
    if model.position_embedding_type == "learned_absolute" and not _positions_follow(run):
        return min(limit, model.max_position_embeddings)  # a given table caps the length
    return limit


def longest_units(fits, start, top):
    """The largest n in [1, ``top``] with ``fits(n)`` (true up to some n, false above), 0
    when none: from ``start`` double (or halve) to bracket the answer, then bisect."""
    n = min(max(1, start), top)
    if fits(n):
        lo, hi = n, min(2 * n, top)
        while hi < top and fits(hi):
            lo, hi = hi, min(2 * hi, top)
        if fits(hi):
            return hi
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
    return lo


def max_seq_length(run, cap_bytes, device="cpu", limit=SEQ_LIMIT):
    """The longest sequence (a multiple of :func:`sequence_unit`) at which ``run``, with its
    own settings, is predicted to hold at most ``cap_bytes``; 0 when not even one unit fits."""
    unit, follow = sequence_unit(run), _positions_follow(run)

    def fits(n):
        trial = with_seq_length(run, n * unit, follow)
        return estimate_memory(trial, device).total_bytes <= cap_bytes
    return longest_units(fits, run.data.seq_length // unit, _length_limit(run, limit) // unit) \
        * unit


def _saving_trial(family, base, limits):
    """(trial, fits the device with the most offloading): ``family``'s most saving rung that
    the host memory takes (host bytes grow along the ladder) on ``base``."""
    top = len(family.rungs) - 1
    last = family.trial(base, top, limits)
    if last is None or last.fits_host:
        return last, bool(last and last.fits_device)
    def under(rung):
        trial = family.trial(base, rung, limits)
        return trial is not None and trial.fits_host, trial
    found, _ = _bisect(0, family.trial(base, 0, limits), top, last, under)
    return found, last.fits_device


def _bisect(lo, lo_trial, hi, hi_trial, probe):
    """(the trial of the last rung that ``probe`` passes, that of the first it fails) between
    rung ``lo`` (passes) and ``hi`` (fails); ``probe(rung)``: (passes, trial)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        passed, trial = probe(mid)
        if passed:
            lo, lo_trial = mid, trial
        else:
            hi, hi_trial = mid, trial
    return lo_trial, hi_trial


def _best_saving_trial(tops, base, limits):
    """(trial, fits the device with the most offloading) of the first family of ``tops``
    whose :func:`_saving_trial` fits on ``base``, else of the one with the least device
    memory."""
    least = (None, False)
    for family in tops:
        trial, device_fits = _saving_trial(family, base, limits)
        if trial is not None and trial.fits:
            return trial, device_fits
        if trial is not None and (least[0] is None or
                                  trial.memory.total_bytes < least[0].memory.total_bytes):
            least = (trial, device_fits)
    return least


def longest_sequence(run, tops, limits, limit=SEQ_LIMIT, start=None):
    """(longest sequence, limiting term) on the layout ``run`` of the families ``tops``
    (:meth:`Family.saving_tops`): the longest multiple of :func:`sequence_unit` at which the
    most saving rung that the host takes of one of them fits (the search starts at
    ``start``, else the run's length), and what stops it one unit longer: "host" when more
    offloading would have fit the device, else the largest term of the device estimate."""
    unit, follow = sequence_unit(run), _positions_follow(run)
    top = _length_limit(run, limit) // unit

    def at(n):
        return _best_saving_trial(tops, with_seq_length(run, n * unit, follow), limits)

    def fits(n):
        trial, _ = at(n)
        return bool(trial and trial.fits)
    units = longest_units(fits, (start or run.data.seq_length) // unit, top)
    if units == top:
        return units * unit, "search limit"
    trial, device_fits_offloaded = at(units + 1)
    if trial is None:
        return units * unit, "refused"
    if not trial.fits_host or (device_fits_offloaded and not trial.fits_device):
        return units * unit, "host"
    parts = trial.memory.parts
    return units * unit, max(parts, key=parts.get)


def fastest_fitting(base, levers, limits, rates):
    """(fits, trial, tops) of the fastest variant of ``base`` (a run at the sequence length
    to plan for) that fits ``limits``, when none fits the variant with the least device
    memory, and the most saving families of its trade-off options (:meth:`Family.saving_tops`). Families are taken in order of their plain rung's predicted time: a family
    whose plain rung is no faster than the best found cannot beat it."""
    ladders, options = families(base, levers, limits.context)
    ranked = []
    for number, family in enumerate(options):
        try:
            plain = family.run(base, 0)
        except ValueError:
            continue
        ranked.append((predict_step_time(plain, rates), number, family))
    ranked.sort(key=lambda entry: entry[:2])
    best, best_time, least = None, None, None
    for plain_time, _, family in ranked:
        if best is not None and plain_time >= best_time:
            break
        fits, trial = family.first_fitting(base, limits)
        if trial is None:
            continue
        if fits:
            seconds = predict_step_time(trial.run, rates)
            if best is None or seconds < best_time:
                best, best_time = (trial, family), seconds
        elif least is None or trial.memory.total_bytes < least[0].memory.total_bytes:
            least = (trial, family)
    if best is not None:
        return True, best[0], best[1].saving_tops(ladders)
    if least is None:
        return False, None, None
    return False, least[0], least[1].saving_tops(ladders)


def _most_saving_families(run, levers, limits):
    """The most saving families of the layout ``run`` (one per combination of trade-off
    options), those that promise the longest sequences first: each family's device bytes
    at the run's length and 64 times it, on a line, reach the cap at some length. (An
    order to search in, not an answer: the terms' maxima bend the line.)"""
    ladders, options = families(run, levers, limits.context)
    follow, unit = _positions_follow(run), sequence_unit(run)
    short = max(1, run.data.seq_length // unit) * unit
    lengths = (short, min(64 * short, _length_limit(run, SEQ_LIMIT) // unit * unit))
    seen, ranked = set(), []
    for family in options:
        tops = family.saving_tops(ladders)
        key = tuple(map(tuple, tops[0].options))
        if key in seen:
            continue
        seen.add(key)
        trials = [_saving_trial(tops[0], with_seq_length(run, n, follow), limits)[0]
                  for n in lengths]
        if None in trials:
            continue
        (m0, m1), (s0, s1) = (t.memory.total_bytes for t in trials), lengths
        slope = (m1 - m0) / (s1 - s0) if s1 > s0 else 0.0
        reach = (limits.device_bytes - m0) / slope + s0 if slope > 0 else float(s1)
        ranked.append((-reach, len(ranked), tops))
    ranked.sort(key=lambda entry: entry[:2])
    return [tops for _, _, tops in ranked]


def plan_layout(run, levers, limits, rates, longest=False, floor=None):
    """The :class:`PlannedLayout` of the layout ``run`` (None when every variant is
    refused): its fastest variant that fits at the run's sequence length (``longest``: at
    the longest sequence the layout trains at, and None when that is not above ``floor``),
    and that longest sequence."""
    if longest:
        best, unit = (None if floor is None else (floor, None)), sequence_unit(run)
        for tops in _most_saving_families(run, levers, limits):
            if best is not None:  # only families that fit one unit longer can beat it
                trial, _ = _best_saving_trial(tops, with_seq_length(
                    run, best[0] + unit, _positions_follow(run)), limits)
                if not (trial and trial.fits):
                    continue
            found = longest_sequence(run, tops, limits, start=best and best[0])
            if best is None or found[0] > best[0]:
                best = found
        if best is None or best[1] is None:
            return None
        length, term = best
        if length:
            fits, trial, _ = fastest_fitting(
                with_seq_length(run, length, _positions_follow(run)), levers, limits, rates)
            return _row(trial, rates, fits, length, term)
    fits, trial, tops = fastest_fitting(run, levers, limits, rates)
    if trial is None:
        return None
    length, term = longest_sequence(run, tops, limits)
    return _row(trial, rates, fits, length, term)


def plan_layouts(runs, levers, limits, rates, longest=False, top=None):
    """A :class:`PlannedLayout` for every layout of ``runs`` (a RunConfig for each parallel
    layout the argument validation accepts), with the open ``levers`` searched, best first:
    those that fit, fastest first (``longest``: the longest sequence first, then the
    fastest), then the rest by memory. ``top``: only the best so many are wanted (with
    ``longest``, a layout is searched only as far as it can beat the top rows found)."""
    if longest and top:
        rows = []  # the layouts over most ranks first: they find long floors early
        for run in sorted(runs, key=lambda r: -(r.parallel.context_parallel_size
                                                * r.parallel.tensor_model_parallel_size)):
            lengths = sorted((r.max_seq_length for r in rows), reverse=True)
            floor = lengths[top - 1] if len(lengths) >= top and lengths[top - 1] else None
            row = plan_layout(run, levers, limits, rates, longest, floor)
            if row is not None:
                rows.append(row)
    else:
        rows = [row for row in (plan_layout(run, levers, limits, rates, longest)
                                for run in runs) if row is not None]
    if longest:
        rows.sort(key=lambda r: (-r.max_seq_length, r.step_time_s))
    else:
        rows.sort(key=lambda r: (not r.fits, r.step_time_s if r.fits else 0, r.memory_bytes))
    return rows


def _row(trial, rates, fits, max_length, term):
    run, parallel, model = trial.run, trial.run.parallel, trial.run.model
    cp = parallel.context_parallel_size
    comm = " ".join(model.cp_comm_types()) if cp > 1 else "none"
    if cp > 1 and "a2a+p2p" in model.cp_comm_types():
        comm += " {}x{}".format(*model.hierarchical_cp_sizes(parallel.tensor_model_parallel_size,
                                                              cp))
    return PlannedLayout(
        tp=parallel.tensor_model_parallel_size, cp=cp, cp_comm_type=comm,
        pp=parallel.pipeline_model_parallel_size,
        vp=parallel.virtual_pipeline_model_parallel_size or 1,
        dp=parallel.data_parallel_size, ep=parallel.expert_model_parallel_size,
        recompute=recompute_name(model), optimizer=optimizer_name(run.optimizer),
        offload_layers=model.cpu_offloading_num_layers,
        tiled_logits_chunk_size=model.tiled_logits_chunk_size,
        mlp_chunks=model.mlp_chunks_for_training, seq_length=run.data.seq_length,
        memory_bytes=trial.memory.total_bytes, host_bytes=trial.host_bytes,
        step_time_s=predict_step_time(run, rates), max_seq_length=max_length,
        limiting_term=term, fits=fits, memory_parts=dict(trial.memory.parts),
        flags=row_flags(run), optimizer_offload_fraction=run.optimizer.offload_fraction)


def row_flags(run):
    """The pretrain_gpt.py flags that give ``run``'s parallel layout and lever settings."""
    p, m, opt = run.parallel, run.model, run.optimizer
    flags = ["--tensor-model-parallel-size", str(p.tensor_model_parallel_size),
             "--context-parallel-size", str(p.context_parallel_size),
             "--pipeline-model-parallel-size", str(p.pipeline_model_parallel_size)]
    if (p.virtual_pipeline_model_parallel_size or 1) > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank",
                  str(p.virtual_pipeline_model_parallel_size)]
    if p.expert_model_parallel_size > 1:
        flags += ["--expert-model-parallel-size", str(p.expert_model_parallel_size)]
    if m.sequence_parallel:
        flags.append("--sequence-parallel")
    if p.context_parallel_size > 1:
        flags += ["--cp-comm-type", *m.cp_comm_types()]
        if m.hierarchical_context_parallel_sizes:
            flags += ["--hierarchical-context-parallel-sizes",
                      *map(str, m.hierarchical_context_parallel_sizes)]
    flags += {"fsdp2": ["--use-torch-fsdp2"], "distributed": ["--use-distributed-optimizer"],
              "megatron-fsdp": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                opt.data_parallel_sharding_strategy, "--ckpt-format",
                                run.checkpoint.ckpt_format]}.get(optimizer_name(opt), [])
    if opt.optimizer_cpu_offload:
        flags += ["--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                  "--optimizer-offload-fraction", str(opt.optimizer_offload_fraction)]
    if m.recompute_granularity:
        flags += ["--recompute-granularity", m.recompute_granularity]
    if m.recompute_granularity == "full":
        flags += ["--recompute-method", m.recompute_method,
                  "--recompute-num-layers", str(m.recompute_num_layers)]
    for flag, value, plain in (("--tiled-logits-chunk-size", m.tiled_logits_chunk_size, 0),
                               ("--mlp-chunks-for-training", m.mlp_chunks_for_training, 1),
                               ("--cpu-offloading-num-layers", m.cpu_offloading_num_layers, 0)):
        if value != plain:
            flags += [flag, str(value)]
    return flags
