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

:func:`optimizer_bytes_per_param` adds the precision-aware optimizer and the host offload:
the gradient buffer, the Adam moments and the main params take their dtypes' sizes
(--main-grads-dtype, --exp-avg-dtype, --exp-avg-sq-dtype, --main-params-dtype: fp16 masters
are kept, 2 bytes, for fp32 models too, as Transformer Engine does), and the offloaded fraction f of the optimizer's
elements moves its fp32 main params (4, also for fp32 models, whose device params stay), its
moments (8) and a gradient copy (4) to the host, 16 f / d bytes, taking its share of the main
params and moments off the device. Under FSDP2, f = 1 is FSDP2's own host offload: the fp32
rows and their gradients go too, leaving nothing on the device between steps.
"""
import torch

from megatron_cp.distributed.fsdp import is_fully_sharded
from megatron_cp.distributed.shards import local_tensor
from megatron_cp.optimizer.offload import on_host


def expected_bytes_per_param(params_dtype, d=1, distributed=False, fully_sharded=False):
    """The formula of the module docstring for ``params_dtype`` and group size ``d`` (the
    plain optimizer: everything on the device)."""
    return optimizer_bytes_per_param(None, params_dtype, d, distributed, fully_sharded)[0]


def optimizer_bytes_per_param(optimizer_config, params_dtype, d=1, distributed=False,
                              fully_sharded=False):
    """``(device_bytes, host_bytes)`` per parameter held by the model's params, gradients and
    optimizer state (module docstring) for the optimizer section ``optimizer_config``
    (:class:`~megatron_cp.config.optimizer.OptimizerConfig`, or None for the plain case) and
    group size ``d``; ``distributed`` and ``fully_sharded`` as in
    :func:`expected_bytes_per_param`. The fraction is of elements, which the optimizer takes
    param by param, so a run's measured figure follows the elements it actually moved."""
    def size(name):  # bytes of one element of a precision-aware dtype
        if optimizer_config is None:
            return 4
        return torch.empty((), dtype=optimizer_config.state_dtype(name)).element_size()
    half = params_dtype in (torch.bfloat16, torch.float16)
    adam = size("exp_avg_dtype") + size("exp_avg_sq_dtype")
    f = 0.0 if optimizer_config is None else optimizer_config.offload_fraction
    host_part = f * (4 + adam + 4)  # fp32 main, moments, gradient copy
    if fully_sharded:
        if f == 1.0:  # FSDP2's CPUOffloadPolicy: rows, main_grad and state on the host
            return 0.0, (4 + 4 + adam) / d
        return (4 + 4 + (1 - f) * adam) / d, host_part / d
    param, grad = (2 if half else 4), size("main_grads_dtype")
    shard = d if distributed else 1
    # fp32 masters of a half model; fp16 masters (in the optimizer's state) of any model
    main = size("main_params_dtype") if half or size("main_params_dtype") == 2 else 0
    return param + grad + (1 - f) * (main + adam) / shard, host_part / shard


def memory_breakdown(model_chunks, optimizer):
    """This rank's bytes: ``{"num_params", "params", "grads", "main_params",
    "optimizer_state", "total", "bytes_per_param", "device", "host", "device_by_kind",
    "host_by_kind"}``; ``device`` and ``host`` split ``total`` by where each tensor the model
    and optimizer hold lives (on a CPU run: would live; ``host_by_kind`` adds the host
    gradient copies, ``host_grads``, of --optimizer-cpu-offload).

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
    optimizer.param_shards()  # creates the state of params that have not stepped yet
    rows_on_host = any(getattr(c, "offload_params", False) for c in model_chunks)
    device, host = {}, {}  # category: bytes, by where the tensors live (would live, on a CPU)

    def add(category, tensors):
        for t in tensors:
            where = host if on_host(t, rows_on_host) else device
            where[category] = where.get(category, 0) + t.numel() * t.element_size()
    add("main_params", optimizer.main_tensors())
    add("optimizer_state", optimizer.state_tensors())  # as stored (shards created it)
    add("host_grads", optimizer.host_grad_tensors())
    place = host if rows_on_host else device
    place["params"], place["grads"] = param_bytes, grad_bytes
    main_bytes = device.get("main_params", 0) + host.get("main_params", 0)
    state_bytes = device.get("optimizer_state", 0) + host.get("optimizer_state", 0)
    total = sum(device.values()) + sum(host.values())
    return {"num_params": num_params, "params": param_bytes, "grads": grad_bytes,
            "main_params": main_bytes, "optimizer_state": state_bytes, "total": total,
            "bytes_per_param": total / num_params, "device": sum(device.values()),
            "host": sum(host.values()), "device_by_kind": device, "host_by_kind": host}
