"""Dynamic context parallelism's schedule: which documents of a global batch run where.

Megatron-LM's dynamic CP (``--hybrid-context-parallel``; "hybrid" here names a2a+p2p CP,
so this is dynamic CP) gives every packed document a CP group sized for it, out of the
pool of the DP x CP ranks (one pool per TP rank, the same schedule on each), instead of
splitting every sample over the fixed CP group. The rules here, all pure functions of the
documents' lengths (every rank computes the same schedule; nothing is exchanged):

1. **Group size.** A document of ``L`` tokens runs on the smallest power-of-two group ``k``
   whose ranks each hold at most ``M`` tokens (``--max-seqlen-per-dp-cp-rank``) once it is
   padded for the zigzag split: ``pad(L, k) <= k x M``, ``pad`` rounding up to a multiple of
   ``granule(k)`` (2 x k, times TP under sequence parallelism; 1 at k = 1, TP with SP).
   Megatron-LM's ``gpus_needed`` is ``2^ceil(log2(L / M))``; the padding makes ours at most
   one step larger where a document fills its ranks to the last token.
2. **Bins.** The documents of one group size are packed first-fit decreasing (longest first,
   ties by document number) into bins of at most ``k x M`` padded tokens: a bin is one packed
   microbatch, run by its ``k`` ranks together.
3. **Placement.** Bins are taken by decreasing cost (ties: larger group, then lower first
   document) and each is placed on the aligned block of ``k`` consecutive pool ranks
   (``[j k, (j + 1) k)``; the CP groups of each size are made once at start-up) where it
   would finish first, when every rank runs its bins in placement order and a bin starts
   once all its ranks are free (ties: the block free earliest, then the lowest).
4. **Every rank works.** While a rank of the pool has no bin, the costliest bin whose buddy
   block (the other half of its aligned ``2k`` block) holds no bin at all is spread over
   both halves (k doubles; only while its ranks still hold at most ``M`` tokens each), then
   the times are worked out again.

5. **Never worse than static.** Given the samples and the static CP size, the static layout
   is a schedule too (each sample one bin on its DP replica's CP group, the replicas taking
   contiguous shares of the batch); when its modelled step is shorter, it is the schedule.

6. **Lockstep (expert parallelism).** An expert all-to-all needs every rank of its group in
   the same forward at once, so with EP the bins run in rounds (:func:`rounds`): a bin runs
   in the first round all its ranks are free for it, and a rank with no bin in a round runs
   an empty one (one token, no loss) to keep the exchanges paired.

Each rank then runs its bins in placement order: a bin's collectives involve only its
ranks, and every rank meets its bins in the same global order, so no rank waits on a bin
that waits on it. ``cost(padded_lengths, lengths, k)`` gives one rank's time for a bin;
:class:`FlopCost` counts FLOPs (the model's matmuls per token, attention per causal
token pair), which is what the balancing and ``benchmarks/varlen.py`` use.
"""
from dataclasses import dataclass

from megatron_cp.config.dynamic_cp import granule, group_size, is_power_of_two, padded


@dataclass(frozen=True)
class FlopCost:
    """One rank's FLOPs (forward and backward) for a bin on ``k`` ranks:
    ``(per_token x padded tokens + per_pair x causal pairs) / k``, the pairs of a document
    of ``L`` real tokens being ``L (L + 1) / 2`` (each query with itself and its
    predecessors in the document). ``per_token``: 6 x the matmul weights a token passes
    through; ``per_pair``: 3 x 2 x 2 x the query heads' width, per layer (QK^T and PV)."""
    per_token: float
    per_pair: float

    @classmethod
    def for_model(cls, hidden, ffn_hidden, layers, heads, kv_heads, head_dim, gated_mlp=False):
        attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
        mlp = hidden * ffn_hidden * (3 if gated_mlp else 2)
        return cls(per_token=6.0 * layers * (attention + mlp),
                   per_pair=12.0 * layers * heads * head_dim)

    def __call__(self, padded_lengths, lengths, k):
        pairs = sum(n * (n + 1) // 2 for n in lengths)
        return (self.per_token * sum(padded_lengths) + self.per_pair * pairs) / k


@dataclass
class Bin:
    """One packed microbatch: ``documents`` (their numbers in the global batch, in packing
    order) and ``lengths``, run by the ``size`` pool ranks from ``first``; ``order`` is its
    place in the step (every rank runs its bins by increasing order); ``start`` / ``finish``
    the modelled times."""
    documents: list
    lengths: list
    size: int
    first: int = -1
    order: int = -1
    cost: float = 0.0
    start: float = 0.0
    finish: float = 0.0

    @property
    def ranks(self):
        return range(self.first, self.first + self.size)


@dataclass
class Schedule:
    """The bins of one global batch on a pool of ``pool`` ranks, in run order; ``static``:
    the static layout won (rule 5)."""
    bins: list
    pool: int
    static: bool = False

    def bins_of(self, slot):
        """The bins pool rank ``slot`` runs, in run order."""
        return [b for b in self.bins if b.first <= slot < b.first + b.size]

    @property
    def step_time(self):
        """The modelled time of the step: the last bin's finish."""
        return max((b.finish for b in self.bins), default=0.0)

    def busy(self, slot):
        """The modelled time pool rank ``slot`` computes (the sum of its bins' costs)."""
        return sum(b.cost for b in self.bins_of(slot))


def _pack(documents, lengths, k, capacity, tp_multiple):
    """First-fit decreasing of the documents of group size k into bins of ``capacity``
    padded tokens."""
    order = sorted(documents, key=lambda d: (-lengths[d], d))
    bins, room = [], []
    for d in order:
        need = padded(lengths[d], k, tp_multiple)
        for i, free in enumerate(room):
            if need <= free:
                bins[i].documents.append(d)
                bins[i].lengths.append(lengths[d])
                room[i] -= need
                break
        else:
            bins.append(Bin([d], [lengths[d]], k))
            room.append(capacity - need)
    return bins


def _cost(b, cost, tp_multiple):
    return cost([padded(n, b.size, tp_multiple) for n in b.lengths], b.lengths, b.size)


def _time(bins, pool):
    """Start and finish of every bin when each rank runs its bins in order."""
    ready = [0.0] * pool
    for b in bins:
        b.start = max(ready[r] for r in b.ranks)
        b.finish = b.start + b.cost
        for r in b.ranks:
            ready[r] = b.finish


def schedule(lengths, pool, max_per_rank, cost, tp_multiple=1, least=1, samples=None,
             static_size=None):
    """The :class:`Schedule` of documents of ``lengths`` (the global batch's, in order;
    zero-length ones are skipped) on ``pool`` ranks (a power of two) at ``max_per_rank``
    padded tokens per rank, on groups of at least ``least`` ranks
    (--min-dynamic-context-parallel-size). ``cost``: see the module doc (e.g. a
    :class:`FlopCost`). ``samples`` (the document numbers of each sample, in order) and
    ``static_size`` (the static CP size): rule 5's comparison (None: none)."""
    if not is_power_of_two(pool):
        raise ValueError(f"the DP x CP pool ({pool} ranks) must be a power of two for dynamic "
                         f"context parallelism (its groups are aligned power-of-two blocks)")
    if max_per_rank < granule(1, tp_multiple):
        raise ValueError(f"--max-seqlen-per-dp-cp-rank ({max_per_rank}) must be at least "
                         f"{granule(1, tp_multiple)}")
    sizes = {}
    for d, n in enumerate(lengths):
        if n > 0:
            k = group_size(n, max_per_rank, pool, tp_multiple, least)
            sizes.setdefault(k, []).append(d)
    bins = []
    for k in sorted(sizes, reverse=True):
        bins += _pack(sizes[k], lengths, k, k * max_per_rank, tp_multiple)
    for b in bins:
        b.cost = _cost(b, cost, tp_multiple)
    bins.sort(key=lambda b: (-b.cost, -b.size, b.documents[0]))
    ready = [0.0] * pool
    for b in bins:
        best = None
        for first in range(0, pool, b.size):
            start = max(ready[first:first + b.size])
            key = (start + b.cost, start, first)
            if best is None or key < best:
                best = key
        b.first = best[2]
        for r in b.ranks:
            ready[r] = best[0]
    _spread_to_idle(bins, pool, max_per_rank, cost, tp_multiple)
    for i, b in enumerate(bins):
        b.order = i
    _time(bins, pool)
    dynamic = Schedule(bins, pool)
    static = None if samples is None else _static(lengths, samples, static_size, pool,
                                                  max_per_rank, cost, tp_multiple)
    return static if static is not None and static.step_time < dynamic.step_time else dynamic


def _static(lengths, samples, size, pool, max_per_rank, cost, tp_multiple):
    """The static layout as a schedule (rule 5): sample j on the CP group of DP replica
    ``j // (samples per replica)``; None where a sample does not fit ``max_per_rank``."""
    replicas = pool // size
    if len(samples) % replicas:
        return None
    share = len(samples) // replicas
    bins = []
    for j, documents in enumerate(samples):
        documents = [d for d in documents if lengths[d] > 0]
        if not documents:
            continue
        b = Bin(documents, [lengths[d] for d in documents], size, first=(j // share) * size,
                order=len(bins))
        if sum(padded(n, size, tp_multiple) for n in b.lengths) > size * max_per_rank:
            return None
        b.cost = _cost(b, cost, tp_multiple)
        bins.append(b)
    _time(bins, pool)
    return Schedule(bins, pool, static=True)


def _spread_to_idle(bins, pool, max_per_rank, cost, tp_multiple):
    """Rule 4: double the costliest bin whose buddy block holds no bin, while a rank is idle."""
    while True:
        used = [False] * pool
        for b in bins:
            for r in b.ranks:
                used[r] = True
        if all(used):
            return
        candidates = []
        for b in bins:
            if 2 * b.size > pool or sum(padded(n, 2 * b.size, tp_multiple)
                                        for n in b.lengths) > 2 * b.size * max_per_rank:
                continue
            low = b.first - b.first % (2 * b.size)
            buddy = range(low, low + 2 * b.size)
            if not any(used[r] for r in buddy if r not in b.ranks):
                candidates.append(b)
        if not candidates:
            return
        b = max(candidates, key=lambda c: (c.cost, -c.first))
        b.first -= b.first % (2 * b.size)
        b.size *= 2
        b.cost = _cost(b, cost, tp_multiple)


def rounds(plan):
    """Rule 6: ``{slot: [bin or None per round]}``, every pool rank the same number of
    rounds; each round runs every bin whose ranks all have it next in their run order (the
    lowest unfinished bin always does, so the rounds end), None where a rank waits."""
    queues = {slot: plan.bins_of(slot) for slot in range(plan.pool)}
    out = {slot: [] for slot in range(plan.pool)}
    while any(queues.values()):
        heads = {slot: q[0] for slot, q in queues.items() if q}
        running = {id(b) for b in heads.values()
                   if all(heads.get(r) is b for r in b.ranks)}
        for slot in out:
            b = heads.get(slot)
            if b is not None and id(b) in running:
                out[slot].append(b)
                queues[slot].pop(0)
            else:
                out[slot].append(None)
    return out
