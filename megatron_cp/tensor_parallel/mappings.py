"""Autograd collectives of the tensor-parallel region (the f and g operators of Megatron).

Each function's forward and backward are conjugate: what one does forward, the other does
backward. The sequence-parallel ones split / gather along dim 0, the sequence dim of the
``[s, b, h]`` activation layout. Every function takes its process group.
"""
import torch
import torch.distributed as dist

from megatron_cp.distributed.compat import all_gather_flat, reduce_scatter_flat


def _world(group):
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce(x, group):
    """The sum of ``x`` over ``group`` in a new tensor (``x`` itself on a group of one: no copy)."""
    if _world(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
    dist.all_reduce(x, group=group)
    return x


def _split_last(x, group):
    size = _world(group)
    if size == 1:
        return x
    chunk = x.shape[-1] // size
    return x.narrow(-1, dist.get_rank(group) * chunk, chunk).contiguous()


def _gather_last(x, group):
    size = _world(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x, group):
    size = _world(group)
    if size == 1:
        return x
    if x.shape[0] % size != 0:
        raise ValueError(f"sequence length ({x.shape[0]}) must be divisible by the tensor parallel "
                         f"size ({size}) under sequence parallelism; pad or change --seq-length")
    chunk = x.shape[0] // size
    return x.narrow(0, dist.get_rank(group) * chunk, chunk).contiguous()


def _gather_first(x, group):
    size = _world(group)
    if size == 1:
        return x
    out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_first(x, group):
    size = _world(group)
    if size == 1:
        return x
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x.contiguous(), group=group)
    return out


class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient over TP backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce (sum) over TP forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the last dim backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's chunk of the sequence (dim 0) forward; all-gather dim 0 backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence (dim 0) forward; reduce-scatter the gradient backward.

    The gathered activation feeds a column-parallel linear whose per-rank gradients are
    partial sums over the TP ranks' heads, hence the reduce-scatter. ``to_model_parallel=False``
    is for a gather whose consumers are replicated (e.g. before the output layer's loss is
    already split by vocab); then backward only keeps this rank's chunk.
    """

    @staticmethod
    def forward(ctx, x, group, to_model_parallel=True):
        ctx.group, ctx.to_model_parallel = group, to_model_parallel
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.to_model_parallel:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter over dim 0 forward (row-parallel output under SP); all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x, group):
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group):
    return ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group):
    return ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x, group):
    return GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    return ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group, to_model_parallel=True):
    return GatherFromSequenceParallelRegion.apply(x, group, to_model_parallel)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return ReduceScatterToSequenceParallelRegion.apply(x, group)
