"""Autograd collectives of token dispatch: rows of a ``[tokens, h]`` tensor moved between ranks.

Every rank may hold a different number of rows, so each function takes the row counts.
Forward and backward are conjugate (Megatron's f and g):

- :func:`all_to_all`: rows to other ranks by split sizes; backward sends the gradients back
  with the splits swapped.
- :func:`gather_rows` / :func:`reduce_scatter_rows`: all-gather of every rank's rows (rank
  order) and its conjugate, the sum over ranks keeping this rank's rows.
- :func:`split_rows` / :func:`gather_replicated_rows`: this rank's share of rows that every
  rank holds alike, and back (backward: all-gather / keep own share).

Uneven row counts are padded to the largest for the flat collectives and cut after.
"""
import torch
import torch.distributed as dist

from megatron_cp.distributed.compat import all_gather_flat, reduce_scatter_flat


def _size(group):
    return dist.get_world_size(group) if group is not None else 1


def _rank(group):
    return dist.get_rank(group) if group is not None else 0


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))  # [sum(output_splits), h]
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _gather(x, counts, group):
    """[counts[rank], ...] on each rank -> [sum(counts), ...] in rank order."""
    largest = max(counts)
    padded = x.new_zeros((largest,) + tuple(x.shape[1:]))  # [largest, ...]
    padded[:x.shape[0]] = x
    out = x.new_empty((largest * len(counts),) + tuple(x.shape[1:]))  # [ranks * largest, ...]
    all_gather_flat(out, padded, group=group)
    return torch.cat([out[r * largest:r * largest + n] for r, n in enumerate(counts)])


def _reduce_scatter(x, counts, group):
    """[sum(counts), ...] on each rank -> its own [counts[rank], ...] rows, summed over ranks."""
    largest = max(counts)
    padded = x.new_zeros((largest * len(counts),) + tuple(x.shape[1:]))  # [ranks * largest, ...]
    start = 0
    for r, n in enumerate(counts):
        padded[r * largest:r * largest + n] = x[start:start + n]
        start += n
    out = x.new_empty((largest,) + tuple(x.shape[1:]))
    reduce_scatter_flat(out, padded, group=group)
    return out[:counts[_rank(group)]]


def _own_rows(x, counts, group):
    start = sum(counts[:_rank(group)])
    return x[start:start + counts[_rank(group)]].contiguous()


class _AllToAll(torch.autograd.Function):
    """Forward: rows sent by ``input_splits``, received by ``output_splits``. Backward: the
    reverse exchange."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


class _RowCollective(torch.autograd.Function):
    """Forward ``forward_op(x, counts, group)``, backward its conjugate ``backward_op`` on the
    gradient (the pairs are listed in the module docstring)."""

    @staticmethod
    def forward(ctx, x, counts, group, forward_op, backward_op):
        ctx.counts, ctx.group, ctx.backward_op = counts, group, backward_op
        return forward_op(x, counts, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.counts, ctx.group), None, None, None, None


def _rows(x, counts, group, forward_op, backward_op):
    if _size(group) == 1:
        return x
    return _RowCollective.apply(x, list(counts), group, forward_op, backward_op)


def all_to_all(x, output_splits, input_splits, group):
    """[sum(input_splits), h] -> [sum(output_splits), h] over ``group``."""
    if _size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def gather_rows(x, counts, group):
    """[counts[rank], h] -> [sum(counts), h]; backward sums the gradients over ``group``."""
    return _rows(x, counts, group, _gather, _reduce_scatter)


def reduce_scatter_rows(x, counts, group):
    """[sum(counts), h] partial on each rank -> this rank's [counts[rank], h] of the sum."""
    return _rows(x, counts, group, _reduce_scatter, _gather)


def split_rows(x, counts, group):
    """This rank's ``counts[rank]`` rows of ``x`` [sum(counts), h], held alike by every rank."""
    return _rows(x, counts, group, _own_rows, _gather)


def gather_replicated_rows(x, counts, group):
    """Inverse of :func:`split_rows`: every rank's rows, in rank order, on every rank."""
    return _rows(x, counts, group, _gather, _own_rows)


def all_gather_counts(counts, group):
    """[n] int64 on each rank -> [ranks, n] (no gradient)."""
    if _size(group) == 1:
        return counts.unsqueeze(0)
    out = counts.new_empty((_size(group) * counts.numel(),))
    all_gather_flat(out, counts.contiguous(), group=group)
    return out.view(_size(group), -1)


def exchange_counts(counts, group):
    """All-to-all of equal-sized count blocks: [ranks, n] (row r goes to rank r) -> [ranks, n]
    (row r came from rank r)."""
    if _size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def even_counts(total, parts):
    """``total`` rows cut into ``parts`` contiguous shares, the first ones one longer."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]
