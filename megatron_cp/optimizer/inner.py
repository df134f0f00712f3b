"""The torch optimizers inside a MixedPrecisionOptimizer, and their per-parameter state.

``--optimizer adam`` steps one AdamW over every main param; ``--optimizer muon`` steps Muon
over the groups marked ``optimizer: "muon"`` (:func:`get_param_groups`) chained with AdamW
over the rest (:class:`ChainedOptimizer`, one face with the groups in their order). The
fused Adam (apex ``FusedAdam``, else torch's ``fused=True``) is chosen in
:func:`build_adamw` only, and only on CUDA; the CPU path is plain ``torch.optim.AdamW``.

Each optimizer keeps its own state per parameter (:data:`STATE_KINDS`: Adam's two moments,
Muon's momentum buffer). :func:`param_state` gives it, created as zeros before the first
step as the optimizer would create it, so checkpoints save and load it in place.
"""
import torch

from megatron_cp.optimizer.muon import Muon

ADAM_KINDS, MUON_KINDS = ("exp_avg", "exp_avg_sq"), ("momentum_buffer",)


def _import_fused_adam():
    """apex's FusedAdam class, or None when apex is missing or broken."""
    try:
        from apex.optimizers import FusedAdam  # optional accelerator
    except (ImportError, OSError):
        return None
    return FusedAdam


def build_adamw(param_groups, lr, weight_decay, betas, eps, device, use_fused=None):
    """The one import point for Adam: fused on CUDA (apex, else torch), torch AdamW elsewhere.

    ``use_fused`` False forces plain torch AdamW; None picks fused when on CUDA.
    """
    kwargs = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    fused = device.type == "cuda" if use_fused is None else bool(use_fused)
    if fused and device.type != "cuda":
        raise ValueError(f"use_fused=True needs a CUDA device, this rank runs on {device}; "
                         f"leave use_fused unset on CPU")
    if fused:
        apex_adam = _import_fused_adam()
        if apex_adam is not None:
            return apex_adam(param_groups, adam_w_mode=True, **kwargs)
        return torch.optim.AdamW(param_groups, fused=True, **kwargs)
    return torch.optim.AdamW(param_groups, **kwargs)


class ChainedOptimizer:
    """Several torch optimizers stepped as one: ``param_groups`` lists theirs in order (the
    same dicts, so the LR scheduler's writes reach them), and ``state_dict`` is the format of
    one torch optimizer holding all those groups (params numbered across them)."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        self._owner = {id(p): opt for opt in self.optimizers
                       for g in opt.param_groups for p in g["params"]}

    @property
    def param_groups(self):
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self):
        """Every optimizer's per-param state (read-only: :func:`param_state` creates it)."""
        return {p: st for opt in self.optimizers for p, st in opt.state.items()}

    def owner(self, param):
        """The optimizer whose groups hold ``param``."""
        return self._owner[id(param)]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def state_dict(self):
        state, groups, offset = {}, [], 0
        for opt in self.optimizers:
            saved = opt.state_dict()
            state.update({index + offset: value for index, value in saved["state"].items()})
            groups += [{**g, "params": [i + offset for i in g["params"]]}
                       for g in saved["param_groups"]]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        first, offset = 0, 0
        for opt in self.optimizers:
            saved = state_dict["param_groups"][first:first + len(opt.param_groups)]
            count = sum(len(g["params"]) for g in saved)
            opt.load_state_dict({
                "state": {i - offset: v for i, v in state_dict["state"].items()
                          if offset <= i < offset + count},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]}
                                 for g in saved]})
            first, offset = first + len(opt.param_groups), offset + count


def build_inner(groups, lr, weight_decay, betas, eps, device, use_fused=None, make_muon=None):
    """AdamW over ``groups``, or, when some are Muon's (``optimizer: "muon"``, listed
    first), ``make_muon(their groups)`` chained with AdamW over the others."""
    muon = [g for g in groups if g.get("optimizer") == "muon"]
    adam = [g for g in groups if g.get("optimizer") != "muon"]
    if not muon:
        return build_adamw(groups, lr, weight_decay, betas, eps, device, use_fused)
    assert all(a is b for a, b in zip(groups, muon)), "Muon's groups come first"
    parts = [make_muon(muon)]
    if adam:
        parts.append(build_adamw(adam, lr, weight_decay, betas, eps, device, use_fused))
    return ChainedOptimizer(parts)


def torch_optimizers(optimizer):
    """The torch optimizers behind ``optimizer`` (one, or a chain's)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))  # a chain's, or a hybrid's


def state_kinds(optimizer):
    """The per-parameter state tensors a torch optimizer keeps."""
    return MUON_KINDS if isinstance(optimizer, Muon) else ADAM_KINDS


def param_state(optimizer, param):
    """``{kind: tensor}`` of ``param``'s state in (the optimizer of the chain holding it)
    ``optimizer``, created as zeros when it has not stepped yet (module docstring)."""
    if hasattr(optimizer, "owner"):  # a chain, or the hybrid device/host optimizer
        optimizer = optimizer.owner(param)
    if hasattr(optimizer, "unscaled_state"):  # the precision-aware Adam: its dtypes, scales
        return optimizer.unscaled_state(param)
    kinds = state_kinds(optimizer)
    state = optimizer.state[param]
    if kinds[0] not in state:
        if kinds == ADAM_KINDS:
            group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32,
                                        device=param.device if on_device else "cpu")
        for kind in kinds:
            state[kind] = torch.zeros_like(param, memory_format=torch.preserve_format)
    if getattr(param, "on_host", False):  # --optimizer-cpu-offload's host part
        for kind in kinds:
            state[kind].on_host = True
    return {kind: state[kind] for kind in kinds}


def adam_step(optimizer):
    """The number of Adam steps taken (the same for every param; 0 before the first)."""
    steps = [float(st["step"]) for opt in torch_optimizers(optimizer)
             for st in opt.state.values() if "step" in st]
    steps += [float(g["step"]) for g in optimizer.param_groups if "step" in g]  # apex FusedAdam
    return max(steps, default=0.0)


def set_adam_step(optimizer, step):
    """Set the Adam step count of every param (and group, for apex) to ``step``."""
    for opt in torch_optimizers(optimizer):
        for param_state_ in opt.state.values():
            if "step" in param_state_:
                param_state_["step"].fill_(step)
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = int(step)
