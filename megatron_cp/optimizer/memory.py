"""Bytes of model params, gradients, fp32 main params and Adam state held per rank, and
the per-parameter formula they follow.

With d the size of the data-parallel group the optimizer state is sharded over (1 without
the distributed optimizer; DP x CP / K with K optimizer instances), Megatron-LM's figures per
parameter are:

=================================  ===========  ==============  ===========
model params / grads                 FSDP2        distributed     replicated
=================================  ===========  ==============  ===========
bf16 or fp16 / fp32 (main fp32)      16/d         6 + 12/d        18
fp32 / fp32                          16/d         8 + 8/d         16
=================================  ===========  ==============  ===========

(params 2 or 4, grads 4, fp32 main params 4 only for half models, Adam moments 8). FSDP2
(``--use-torch-fsdp2``) shards all of it over DP x CP and keeps fp32 params that are their
own main params (a half model gathers them rounded, one layer at a time, on top of this
steady-state count).
Measured figures include the distributed optimizer's bucket padding (< d elements per
bucket); Adam's per-tensor step counters are left out.
"""
import torch

from megatron_cp.distributed.fsdp import is_fully_sharded
from megatron_cp.distributed.shards import local_tensor


def expected_bytes_per_param(params_dtype, d=1, distributed=False, fully_sharded=False):
    """The formula of the module docstring for ``params_dtype`` and group size ``d``."""
    half = params_dtype in (torch.bfloat16, torch.float16)
    param, grad, main, adam = (2 if half else 4), 4, (4 if half else 0), 8
    if fully_sharded:
        return (4 + grad + adam) / d
    shard = d if distributed else 1
    return param + grad + (main + adam) / shard


def memory_breakdown(model_chunks, optimizer):
    """This rank's bytes: ``{"num_params", "params", "grads", "main_params",
    "optimizer_state", "total", "bytes_per_param"}``.

    ``model_chunks`` are the :class:`DistributedDataParallel` wrappers (their flat buffers
    are counted, padding included) or the FSDP2 ones (each rank's rows and ``main_grad``);
    ``optimizer`` is a :class:`MixedPrecisionOptimizer`, :class:`DistributedOptimizer` or
    :class:`FullyShardedOptimizer` (its state is created as zeros if it has not stepped).
    """
    params = list({id(p): p for chunk in model_chunks for p in chunk.parameters()}.values())
    fully_sharded = is_fully_sharded(model_chunks)
    num_params = sum(p.numel() for p in params)
    param_buffers = [b for chunk in model_chunks for b in getattr(chunk, "param_buffers", [])]
    if param_buffers:
        param_bytes = sum(b.numel() * b.element_size() for b in param_buffers)
    else:  # whole params, or FSDP2's rows of them
        param_bytes = sum(local_tensor(p).numel() * p.element_size() for p in params)
    if fully_sharded:
        grad_bytes = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params)
    else:
        grad_bytes = sum(b.numel() * b.element_size() for chunk in model_chunks
                         for b in chunk.buffers)
    shards = optimizer.param_shards()
    # FSDP2's fp32 params are their own main params: counted once, as params
    main_bytes = 0 if fully_sharded else \
        sum(s.main.numel() * s.main.element_size() for s in shards if s.main is not None)
    state_bytes = sum(t.numel() * t.element_size() for s in shards for t in s.state.values())
    total = param_bytes + grad_bytes + main_bytes + state_bytes
    return {"num_params": num_params, "params": param_bytes, "grads": grad_bytes,
            "main_params": main_bytes, "optimizer_state": state_bytes, "total": total,
            "bytes_per_param": total / num_params}
