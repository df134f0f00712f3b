"""Communication used by context parallelism: gathers, all-to-all, sub-groups (the ring
exchange, shared with the TP overlap, is :mod:`megatron_cp.distributed.ring_exchange`).

- ``all_gather_stack`` / ``gather_sequence`` / ``reduce_scatter_stack``: plain (non-autograd)
  collectives the attention Functions call inside their forward/backward.
- ``seq_to_heads`` / ``heads_to_seq``: the Ulysses all-to-all as autograd Functions.
The a2a+p2p sub-groups of a CP group are built by ``initialize_model_parallel`` and held
by the ``ParallelState`` (``hcp_inner`` / ``hcp_outer``).
"""
import torch
import torch.distributed as dist

from megatron_cp.distributed.compat import all_gather_flat, reduce_scatter_flat


def group_size(group):
    """Size of ``group``; None means no context parallelism (size 1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group):
    """This process's rank in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_stack(x, group):
    """Gather ``x`` from every rank of ``group``: returns [size, *x.shape] in group-rank order."""
    size = dist.get_world_size(group)
    # The collective wants the output as [size * x0, *rest]; view it as [size, *x.shape].
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x.contiguous(), group=group)
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
    reduce_scatter_flat(out, flat, group=group)
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
