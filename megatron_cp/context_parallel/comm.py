"""Communication used by context parallelism: ring exchange, gathers, all-to-all, sub-groups.

- ``RingExchange``: send a tensor to the next rank of a ring and receive the previous
  rank's, with batched ``isend/irecv`` posted before the compute it should hide behind
  (on GPU on a side stream from ``megatron_cp.device``; on CPU the stream helpers are no-ops).
- ``all_gather_stack`` / ``gather_sequence`` / ``reduce_scatter_stack``: plain (non-autograd)
  collectives the attention Functions call inside their forward/backward.
- ``seq_to_heads`` / ``heads_to_seq``: the Ulysses all-to-all as autograd Functions.
- ``build_hierarchical_groups`` / ``hierarchical_groups``: the inner (all-to-all) and outer
  (ring) sub-groups of a CP group for the a2a+p2p hybrid, cached by rank tuples.
"""
import torch
import torch.distributed as dist

from megatron_cp import device as device_mod

_HIERARCHICAL_GROUPS = {}  # (cp ranks tuple, U, R) -> (inner group, outer group) of this rank


def group_size(group):
    """Size of ``group``; None means no context parallelism (size 1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group):
    """This process's rank in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def _side_waits_for_compute(stream, device):
    # The side stream must see everything the compute stream queued (the tensors it sends).
    device_mod.side_waits_for_current(stream, device)


class RingExchange:
    """Rotate tensors around the ring of ``group``: send to rank+1, receive from rank-1.

    ``post(tensors)`` starts the exchange of a list of tensors (returns at once); ``wait()``
    returns the received list (same shapes/dtypes) after the compute stream has been made
    to wait for it. Every rank posts the same sequence of exchanges, so the batched
    isend/irecv pairs match and cannot deadlock. ``tag`` (+ position in the list) keeps
    concurrent rings on the same ranks (KV and dKV) apart on gloo.
    """

    def __init__(self, group, device, tag=0):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.device, self.tag = group, device, tag
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)
        self.stream = device_mod.side_stream(device)
        self._pending = None

    def post(self, tensors):
        assert self._pending is None, "wait() for the previous exchange first"
        tensors = [t.contiguous() for t in tensors]  # kernels may return permuted layouts
        received = [torch.empty_like(t) for t in tensors]
        _side_waits_for_compute(self.stream, self.device)
        with device_mod.stream_context(self.stream):
            ops = [dist.P2POp(dist.isend, t, self.next_rank, self.group, self.tag + n)
                   for n, t in enumerate(tensors)]
            ops += [dist.P2POp(dist.irecv, t, self.prev_rank, self.group, self.tag + n)
                    for n, t in enumerate(received)]
            requests = dist.batch_isend_irecv(ops)
        self._pending = (requests, tensors, received)  # keep the sent tensors alive until done

    def wait(self):
        requests, _, received = self._pending
        self._pending = None
        for request in requests:
            request.wait()
        device_mod.wait_stream(self.stream)
        return received


def all_gather_stack(x, group):
    """Gather ``x`` from every rank of ``group``: returns [size, *x.shape] in group-rank order."""
    size = dist.get_world_size(group)
    # The collective wants the output as [size * x0, *rest]; view it as [size, *x.shape].
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=group)
    return out.view((size,) + tuple(x.shape))  # [size, *x.shape]


def gather_sequence(x, group):
    """[b, s_local] metadata (token index, document ids) -> [b, size * s_local], rank order."""
    if x is None:
        return None
    stacked = all_gather_stack(x, group)  # [size, b, s_local]
    return stacked.transpose(0, 1).reshape(x.shape[0], -1)  # [b, size * s_local]


def reduce_scatter_stack(x, group):
    """Sum [size, *shape] over ``group`` and keep this rank's slot: returns [*shape]."""
    out = torch.empty(tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    flat = x.contiguous().view((-1,) + tuple(x.shape[2:]))  # [size * shape0, *rest]
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, flat, group=group)
    return out


def _a2a_seq_to_heads(x, group):
    size = dist.get_world_size(group)
    *lead, heads, seq, dim = x.shape
    x = x.reshape(*lead, size, heads // size, seq, dim)  # [*L, U, H/U, s, d]
    x = x.movedim(-4, 0).contiguous()  # [U (dest), *L, H/U, s, d]
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # [U (src), *L, H/U, s, d]
    out = out.movedim(0, -3)  # [*L, H/U, U, s, d]
    return out.reshape(*lead, heads // size, size * seq, dim)  # [*L, H/U, U*s, d]


def _a2a_heads_to_seq(x, group):
    size = dist.get_world_size(group)
    *lead, heads_local, seq_full, dim = x.shape
    seq = seq_full // size
    x = x.reshape(*lead, heads_local, size, seq, dim)  # [*L, H/U, U, s, d]
    x = x.movedim(-3, 0).contiguous()  # [U (dest), *L, H/U, s, d]
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # [U (src head group), *L, H/U, s, d]
    out = out.movedim(0, -4)  # [*L, U, H/U, s, d]
    return out.reshape(*lead, size * heads_local, seq, dim)  # [*L, H, s, d]


class _SeqToHeads(torch.autograd.Function):
    """Forward: all-to-all [*, H, s/U, d] -> [*, H/U, s, d]. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a_seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a_heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """Forward: all-to-all [*, H/U, s, d] -> [*, H, s/U, d]. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a_heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a_seq_to_heads(grad, ctx.group), None


def seq_to_heads(x, group):
    """Ulysses scatter-heads/gather-sequence: [*, H, s_local, d] -> [*, H/U, U*s_local, d].

    The gathered sequence is the ranks' local sequences concatenated in group-rank order.
    """
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x, group):
    """Inverse of :func:`seq_to_heads`: [*, H/U, U*s_local, d] -> [*, H, s_local, d]."""
    return _HeadsToSeq.apply(x, group)


def _hierarchical_rank_lists(cp_ranks, inner_size, outer_size):
    inner = [list(cp_ranks[g * inner_size:(g + 1) * inner_size]) for g in range(outer_size)]
    outer = [list(cp_ranks[u::inner_size]) for u in range(inner_size)]
    return inner, outer


def _check_hierarchical_sizes(cp_size, inner_size, outer_size):
    if inner_size < 1 or outer_size < 1 or inner_size * outer_size != cp_size:
        raise ValueError(
            f"hierarchical sizes (U={inner_size}, R={outer_size}) must multiply to the context "
            f"parallel size ({cp_size}); pick U dividing {cp_size} and R = {cp_size} // U")


def build_hierarchical_groups(cp_rank_lists, inner_size, outer_size, timeout=None):
    """Create the a2a+p2p sub-groups of every CP group; EVERY rank of the world must call this.

    cp_rank_lists: all CP groups' rank lists (``state.layout["cp"]``) or one list. Inner
    groups are U consecutive CP ranks ([0..U-1], [U..2U-1], ...) for the all-to-all; outer
    groups are the CP ranks with the same cp_rank % U, for the ring. dist.new_group is
    called for every group of every CP group in the same order on all ranks (a collective
    requirement of torch.distributed); the pair belonging to this rank is cached.
    """
    if cp_rank_lists and isinstance(cp_rank_lists[0], int):
        cp_rank_lists = [cp_rank_lists]
    me = dist.get_rank()
    kwargs = {} if timeout is None else {"timeout": timeout}
    for cp_ranks in cp_rank_lists:
        _check_hierarchical_sizes(len(cp_ranks), inner_size, outer_size)
        inner_lists, outer_lists = _hierarchical_rank_lists(cp_ranks, inner_size, outer_size)
        mine = [None, None]
        for slot, rank_lists in enumerate((inner_lists, outer_lists)):
            for ranks in rank_lists:
                group = dist.new_group(ranks, **kwargs)
                if me in ranks:
                    mine[slot] = group
        if me in cp_ranks:
            _HIERARCHICAL_GROUPS[(tuple(cp_ranks), inner_size, outer_size)] = tuple(mine)


def hierarchical_groups(cp_group, inner_size, outer_size):
    """(inner, outer) sub-groups of ``cp_group`` built by :func:`build_hierarchical_groups`.

    If the CP group spans the whole world they are built here on first use (every rank is
    then inside this call); otherwise a missing entry is a ValueError naming the fix.
    """
    cp_ranks = tuple(dist.get_process_group_ranks(cp_group))
    _check_hierarchical_sizes(len(cp_ranks), inner_size, outer_size)
    key = (cp_ranks, inner_size, outer_size)
    if key not in _HIERARCHICAL_GROUPS:
        if len(cp_ranks) != dist.get_world_size():
            raise ValueError(
                f"no a2a+p2p sub-groups (U={inner_size}, R={outer_size}) were built for CP ranks "
                f"{list(cp_ranks)}; call build_hierarchical_groups(state.layout['cp'], "
                f"{inner_size}, {outer_size}) on every rank after initialize_model_parallel")
        build_hierarchical_groups(list(cp_ranks), inner_size, outer_size)
    return _HIERARCHICAL_GROUPS[key]
