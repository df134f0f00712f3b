"""Flat gradient (and parameter) buffers cut into buckets: the one layout that the gradient
reduction, the distributed optimizer's shards and its parameter all-gather share.

One buffer per dense / expert set of params, laid out in the order backward produces the
gradients (reverse definition order); params never straddle buckets. Without sharding a
bucket is reduced by one all-reduce.

With ``shard=True`` (the distributed optimizer, ZeRO-1) every bucket is padded with zeros
to a multiple of its reduction group's size d, so it splits into d equal shards: group rank
r owns elements ``[r * n/d, (r+1) * n/d)`` of the bucket -- of the gradients (after the
reduce-scatter), of the fp32 main params and of the Adam moments -- and the model params
live in a second flat buffer of the same layout, which one all-gather per bucket refreshes
after the step. FP8 weights (``--fp8-param-gather``, :mod:`megatron_cp.fp8.params`) get
buffers of their own, their parameter buffer one byte per element (uint8: the all-gather moves
FP8 bytes). A tied word-embedding copy (``shared_embedding``) gets a bucket of its own:
the first and the last pipeline stage then shard it identically, so its gradient can be
summed over the embedding group after the reduce-scatter, shard for shard.

With K distributed-optimizer instances (Megatron-LM's ``--num-distributed-optimizer-instances``)
the sharding group is one instance, a 1/K slice of the reduction group
(``initialize.optimizer_groups``): the reduce-scatter runs inside the instance and the
shard is then all-reduced over the K instances (the inter-instance group), so every
instance holds the fully summed gradient of its shards; the parameter all-gather stays
inside the instance.
"""
import torch
import torch.distributed as dist

from megatron_cp.distributed import compat as dist_compat
from megatron_cp.distributed.initialize import optimizer_groups


class Bucket:
    """A contiguous slice of one buffer, reduced (and, sharded, gathered) by one collective.

    ``offsets[id(p)]`` is ``(start, stop)`` of param ``p`` inside the bucket; ``grad_data``
    is the [n] view of the gradient buffer and ``param_data`` (sharded only) the [n] view
    of the parameter buffer; ``n`` is a multiple of ``group_size`` when sharded.
    """

    def __init__(self, params, offsets, grad_data, param_data, group_name, group, shard,
                 inter_group=None):
        self.params = params
        self.offsets = offsets
        self.grad_data = grad_data  # [n]
        self.param_data = param_data  # [n] or None
        self.group_name, self.group = group_name, group
        self.group_size = dist.get_world_size(group) if group is not None else 1
        self.group_rank = dist.get_rank(group) if group is not None else 0
        self.inter_group = inter_group  # the other optimizer instances (sharded, K > 1)
        self.inter_size = dist.get_world_size(inter_group) if inter_group is not None else 1
        self.shard = shard
        self.ready = set()
        self.handle = None
        self.launched = False
        self.gather_handle = None

    @property
    def data(self):
        """The [n] gradient view (the name the unsharded reduction always used)."""
        return self.grad_data

    def shard_range(self):
        """``(start, stop)`` of this rank's shard inside the bucket (the whole bucket unsharded)."""
        if not self.shard:
            return 0, self.grad_data.numel()
        size = self.grad_data.numel() // self.group_size
        return self.group_rank * size, (self.group_rank + 1) * size

    def reset(self):
        self.ready.clear()
        self.handle = None
        self.launched = False

    def start_grad_reduce(self, average):
        """Launch the (asynchronous) SUM of the gradients over the group: an all-reduce, or a
        reduce-scatter into this rank's shard (in place) when sharded."""
        if average and self.group_size * self.inter_size > 1:
            self.grad_data.mul_(1.0 / (self.group_size * self.inter_size))
        if self.group_size > 1:
            if self.shard:
                start, stop = self.shard_range()
                self.handle = dist_compat.reduce_scatter_flat(
                    self.grad_data[start:stop], self.grad_data, group=self.group, async_op=True)
            else:
                self.handle = dist.all_reduce(self.grad_data, group=self.group, async_op=True)
        self.launched = True

    def finish_grad_reduce(self):
        """Wait for the launched reduction; with optimizer instances, then sum this rank's
        shard over them (every rank finishes its buckets in the same order)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.launched and self.inter_size > 1:
            start, stop = self.shard_range()
            dist.all_reduce(self.grad_data[start:stop], group=self.inter_group)

    def start_param_gather(self, async_op):
        """All-gather the updated param shards of every rank into ``param_data`` (in place)."""
        if not self.shard or self.group_size == 1:
            return
        start, stop = self.shard_range()
        handle = dist_compat.all_gather_flat(self.param_data, self.param_data[start:stop],
                                             group=self.group, async_op=async_op)
        self.gather_handle = handle if async_op else None

    def finish_param_gather(self):
        """Wait for a pending parameter all-gather (no-op when none is pending)."""
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None


def _plan(params, bucket_numel, multiple, alone):
    """Bucket plan: a list of (params, [(start, stop)], padded size), buffer-relative."""
    plans, members, ranges, start, offset = [], [], [], 0, 0

    def close():
        nonlocal start, offset, members, ranges
        if members:
            padded = -(-(offset - start) // multiple) * multiple
            plans.append((members, ranges, start, start + padded))
            offset = start = start + padded
            members, ranges = [], []

    for p in params:
        if alone(p):
            close()
        members.append(p)
        ranges.append((offset, offset + p.numel()))
        offset += p.numel()
        if alone(p) or (bucket_numel is not None and offset - start >= bucket_numel):
            close()
    close()
    return plans, offset


def build_buckets(params, state, bucket_numel, grad_dtype, shard):
    """Flat buffers and buckets for ``params`` (in gradient order).

    Returns ``(grad_buffers, param_buffers, buckets)``. Dense params reduce over ``dp_cp``,
    expert params (``is_expert``) over ``edp``. With ``shard`` the model params are moved
    into the param buffers (their ``.data`` becomes a view) and buckets are padded as the
    module docstring says (to the size of one optimizer instance, which is the whole group
    unless there are several); every param gets ``main_grad``, its view of the gradient
    buffer.
    """
    per_key = {}
    for p in params:
        fp8 = shard and getattr(p, "fp8_storage", False)
        per_key.setdefault((bool(getattr(p, "is_expert", False)), fp8), []).append(p)
    grad_buffers, param_buffers, buckets = [], [], []
    for (is_expert, fp8), key_params in per_key.items():
        group_name, inter_name = optimizer_groups(state, is_expert) if shard else (
            "edp" if is_expert else "dp_cp", None)
        group = state.group(group_name)
        inter = state.group(inter_name) if inter_name else None
        multiple = state.size(group_name) if shard else 1
        dtypes = {p.dtype for p in key_params}
        if shard and len(dtypes) > 1:
            raise ValueError(f"the distributed optimizer needs one parameter dtype per model, got "
                             f"{sorted(map(str, dtypes))}; cast the model to one params_dtype")
        alone = (lambda p: getattr(p, "shared_embedding", False)) if shard else (lambda p: False)
        plans, total = _plan(key_params, bucket_numel, multiple, alone)
        device = key_params[0].device
        grads = torch.zeros(total, dtype=grad_dtype, device=device)  # [total]
        values = torch.zeros(total, dtype=torch.uint8 if fp8 else key_params[0].dtype,
                             device=device) if shard else None  # [total]
        grad_buffers.append(grads)
        if shard:
            param_buffers.append(values)
        for members, ranges, start, stop in plans:
            offsets = {}
            for p, (lo, hi) in zip(members, ranges):
                p.main_grad = grads[lo:hi].view(p.shape)
                if fp8:  # an FP8 weight (--fp8-param-gather): its bytes
                    p.move_bytes(values[lo:hi])
                elif shard:
                    values[lo:hi].copy_(p.data.reshape(-1))
                    p.data = values[lo:hi].view(p.shape)
                offsets[id(p)] = (lo - start, hi - start)
            buckets.append(Bucket(members, offsets, grads[start:stop],
                                  values[start:stop] if shard else None, group_name, group, shard,
                                  inter))
    return grad_buffers, param_buffers, buckets
