"""The optimizer on the host (Megatron-LM's ``--optimizer-cpu-offload`` with
``--optimizer-offload-fraction f``; its ``HybridDeviceOptimizer``).

The first params of this rank's optimizer, in parameter-group order, are kept on the host
until they hold the fraction f of its elements (:func:`choose_offloaded`, Megatron-LM's
rule: a param is taken while the elements taken so far are below f x total, so the one
that crosses the line goes whole). Each has its fp32 main param, its Adam moments and a
gradient copy in host memory (page-locked with the pin flags on a GPU) and is stepped there by
torch's AdamW; the others are stepped on the device as before. One step, after clipping:
the clipped device gradients are copied to their host copies (device to host), both
optimizers step, and the updated host main params are copied into the model's params
(host to device) by the sharded optimizer's usual copy of main params into the model.

The arithmetic is the device optimizer's, element by element, so on a CPU (where AdamW is
the same kernel on both sides) the losses equal those without offload bit for bit. On a
CPU nothing moves: the host tensors are further CPU tensors, marked ``on_host`` so that
:func:`megatron_cp.optimizer.memory.memory_breakdown` counts by placement what would move.
With ``--overlap-cpu-optimizer-d2h-h2d`` the copies run on a side stream of the device
helper (:mod:`megatron_cp.distributed.device`); on a CPU there is no stream.
"""
import torch

from megatron_cp.distributed import device as device_mod
from megatron_cp.optimizer.inner import build_adamw
from megatron_cp.optimizer.optimizer import _PARAM_ATTRS


def choose_offloaded(numels, fraction):
    """Which of the params of ``numels`` elements (in parameter order) go to the host."""
    threshold, taken, chosen = sum(numels) * fraction, 0, []
    for numel in numels:
        chosen.append(taken < threshold)
        if chosen[-1]:
            taken += numel
    return chosen


def host_copy(tensor, pin):
    """An fp32 copy of ``tensor`` in host memory (page-locked when ``pin`` and a GPU holds
    ``tensor``), marked ``on_host``."""
    host = torch.empty(tensor.shape, dtype=torch.float32, device="cpu",
                       pin_memory=pin and tensor.device.type == "cuda")
    host.copy_(tensor)
    host.on_host = True
    return host


def on_host(tensor, model_on_host=False):
    """The tensor lives (or, on a CPU run, would live) in host memory."""
    return model_on_host or getattr(tensor, "on_host", False)


def offload_shards(shards, settings, proxy=None):
    """Move the main params of the shards :func:`choose_offloaded` picks to the host: each
    such shard's ``main`` becomes an fp32 host copy (carrying its model param's attributes)
    and ``host_grad`` its host gradient buffer. ``proxy(shard)``: the device tensor that
    carries the shard's gradient for clipping, given the model param's attributes too."""
    chosen = choose_offloaded([s.main.numel() for s in shards], settings.fraction)
    for shard, move in zip(shards, chosen):
        if not move:
            continue
        shard.main = host_copy(shard.main, settings.pin_params)
        shard.host_grad = torch.empty(shard.main.shape, dtype=torch.float32, device="cpu",
                                      pin_memory=settings.pin_grads and
                                      shard.model.device.type == "cuda")
        shard.host_grad.on_host = True
        for target in (shard.main, proxy(shard) if proxy else None):
            for attr in _PARAM_ATTRS:
                if target is not None and hasattr(shard.model, attr):
                    setattr(target, attr, getattr(shard.model, attr))


def offload_transfers(shards, settings, device_grad=lambda shard: shard.grad_view):
    """``(host main, host gradient, device gradient function)`` of every offloaded shard
    (None without offload), for :class:`HybridDeviceAdamW`."""
    if settings is None:
        return None
    return [(s.main, s.host_grad, (lambda s=s: device_grad(s))) for s in shards
            if getattr(s, "host_grad", None) is not None]


def mark_state_on_host(state):
    """Mark a host param's optimizer state tensors ``on_host`` (torch creates them)."""
    for value in state.values():
        if torch.is_tensor(value) and value.dim() > 0:
            value.on_host = True


class OffloadSettings:
    """What the optimizer section asks of the host part: the fraction, the pin flags and
    the side stream (``--overlap-cpu-optimizer-d2h-h2d``)."""

    def __init__(self, fraction, pin_grads=True, pin_params=True, overlap=False):
        self.fraction, self.pin_grads, self.pin_params = fraction, pin_grads, pin_params
        self.overlap = overlap

    @classmethod
    def from_config(cls, config):
        """From an :class:`~megatron_cp.config.optimizer.OptimizerConfig` (None without
        --optimizer-cpu-offload)."""
        if not config.optimizer_cpu_offload:
            return None
        return cls(config.optimizer_offload_fraction, config.pin_cpu_grads,
                   config.pin_cpu_params, config.overlap_cpu_optimizer_d2h_h2d)


class HybridDeviceAdamW:
    """AdamW over ``groups`` whose params are device tensors or host ones (``on_host``): one
    torch optimizer per side, the host's fed by ``transfers`` -- ``(host main, host gradient
    buffer, function returning the device gradient)`` -- before it steps (module docstring).
    ``param_groups`` are the given groups (the LR scheduler's), copied into both sides'
    groups at each step."""

    def __init__(self, groups, transfers, lr, weight_decay, betas, eps, device, use_fused=None,
                 overlap=False):
        self._outer = groups
        self._transfers = transfers
        self.device = device
        self.stream = device_mod.side_stream(device) if overlap else None
        self.optimizers, self._subgroups = [], []
        for side_is_host in (False, True):
            sub = []
            for index, group in enumerate(groups):
                params = [p for p in group["params"] if on_host(p) == side_is_host]
                if params:
                    sub.append((index, {**group, "params": params}))
            if not sub:
                continue
            where = torch.device("cpu") if side_is_host else device
            self.optimizers.append(build_adamw([g for _, g in sub], lr, weight_decay, betas, eps,
                                               where, use_fused if not side_is_host else False))
            self._subgroups += [(index, opt_group) for (index, _), opt_group
                                in zip(sub, self.optimizers[-1].param_groups)]
        self._owner = {id(p): opt for opt in self.optimizers
                       for g in opt.param_groups for p in g["params"]}

    @property
    def param_groups(self):
        return self._outer

    @property
    def state(self):
        """Both sides' per-param state."""
        return {p: st for opt in self.optimizers for p, st in opt.state.items()}

    def owner(self, param):
        """The torch optimizer (device or host side) stepping ``param``."""
        return self._owner[id(param)]

    @torch.no_grad()
    def step(self):
        for index, group in self._subgroups:  # the scheduler's lr and weight decay
            group.update({k: v for k, v in self._outer[index].items() if k != "params"})
        device_mod.side_waits_for_current(self.stream, self.device)
        with device_mod.stream_context(self.stream):
            for host, host_grad, device_grad in self._transfers:
                grad = device_grad()
                host_grad.copy_(grad, non_blocking=host_grad.is_pinned())  # device to host
                host.grad = host_grad
        for opt in self.optimizers:
            if opt is self.optimizers[-1] and self._transfers:
                device_mod.wait_stream(self.stream)
                device_mod.synchronize(self.device)  # the host reads the copied gradients
            opt.step()
        for host, _, _ in self._transfers:
            host.grad = None
            mark_state_on_host(self.owner(host).state[host])

    def state_dict(self):
        raise NotImplementedError("the sharded optimizers save the state per param "
                                  "(param_shards)")
