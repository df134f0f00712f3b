"""Bytes of model params, gradients, fp32 main params and Adam state held per rank, and
the per-parameter formula they follow.

With d the size of the data-parallel group the optimizer state is sharded over (1 without
the distributed optimizer; DP x CP / K with K optimizer instances), Megatron-LM's figures per
parameter are:

=================================  ==============  ===========
model params / grads                 distributed     replicated
=================================  ==============  ===========
bf16 or fp16 / fp32 (main fp32)      6 + 12/d        18
fp32 / fp32                          8 + 8/d         16
=================================  ==============  ===========

(params 2 or 4, grads 4, fp32 main params 4 only for half models, Adam moments 8).
Measured figures include the distributed optimizer's bucket padding (< d elements per
bucket); Adam's per-tensor step counters are left out.
"""
import torch


def expected_bytes_per_param(params_dtype, d=1, distributed=False):
    """The formula of the module docstring for ``params_dtype`` and group size ``d``."""
    half = params_dtype in (torch.bfloat16, torch.float16)
    param, grad, main, adam = (2 if half else 4), 4, (4 if half else 0), 8
    shard = d if distributed else 1
    return param + grad + (main + adam) / shard


def memory_breakdown(model_chunks, optimizer):
    """This rank's bytes: ``{"num_params", "params", "grads", "main_params",
    "optimizer_state", "total", "bytes_per_param"}``.

    ``model_chunks`` are the :class:`DistributedDataParallel` wrappers (their flat buffers
    are counted, padding included); ``optimizer`` is a :class:`MixedPrecisionOptimizer` or
    :class:`DistributedOptimizer` (its state is created as zeros if it has not stepped).
    """
    params = list({id(p): p for chunk in model_chunks for p in chunk.parameters()}.values())
    num_params = sum(p.numel() for p in params)
    param_buffers = [b for chunk in model_chunks for b in getattr(chunk, "param_buffers", [])]
    if param_buffers:
        param_bytes = sum(b.numel() * b.element_size() for b in param_buffers)
    else:
        param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(b.numel() * b.element_size() for chunk in model_chunks for b in chunk.buffers)
    shards = optimizer.param_shards()
    main_bytes = sum(s.main.numel() * s.main.element_size() for s in shards if s.main is not None)
    state_bytes = sum(t.numel() * t.element_size() for s in shards for t in s.state.values())
    total = param_bytes + grad_bytes + main_bytes + state_bytes
    return {"num_params": num_params, "params": param_bytes, "grads": grad_bytes,
            "main_params": main_bytes, "optimizer_state": state_bytes, "total": total,
            "bytes_per_param": total / num_params}
