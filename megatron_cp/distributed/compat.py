"""The flat-tensor collectives under the name this torch version wants.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (a FutureWarning
on every call) in favour of ``all_gather_single`` / ``reduce_scatter_single``, which take the
same arguments; older versions only have the former. Every caller goes through these two
functions, so the choice lives here and nowhere else. The name is looked up at each call
(a dictionary lookup), so a test that patches ``torch.distributed`` still sees every call.
"""
import torch.distributed as dist


def all_gather_flat(output, tensor, group=None, async_op=False):
    """Gather ``tensor`` of every rank of ``group`` into ``output`` (rank-major along dim 0);
    with ``async_op`` returns the work handle to wait on."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_flat(output, tensor, group=None, async_op=False):
    """Sum ``tensor`` over ``group`` and keep this rank's dim-0 slice of it in ``output``;
    with ``async_op`` returns the work handle to wait on."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group, async_op=async_op)
