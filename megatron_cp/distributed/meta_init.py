"""--init-model-with-meta-device: build the model on the meta device, then draw its parameters
one at a time where they live.

Every weight here is a function of its own seed (tensor_parallel/layers.py: the FULL tensor is
drawn on the CPU from a per-parameter seed, then this rank keeps its TP shard), never of the
order of construction, so a parameter can be drawn later than its module is built and come
out bit for bit the same. While the model is built under ``with torch.device("meta")``, each
drawing site (:func:`drawn_parameter`) makes a meta parameter of its shard's shape and keeps
the draw as ``materialize(device)``; :func:`materialize` then runs those draws one parameter at
a time: full tensor drawn, this rank's part kept, full tensor freed. Under FSDP2 (after
``fully_shard``, whose params are still meta) only the rank's rows of the TP shard are written
into storage that holds the rank's rows alone, so during the build a rank holds its shards
plus one full parameter, never the TP-local model. Parameters that start at a constant
(biases, norm weights) and buffers name their device and are made there as in any build.
"""
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_cp.distributed.shards import local_shard


def building_on_meta():
    """True inside ``with torch.device("meta")``: drawing sites defer their draws."""
    return torch.get_default_device().type == "meta"


def drawn_parameter(draw, device):
    """``nn.Parameter(draw(device))``, ``draw(device)`` making this rank's part of a weight
    drawn from its seed; while :func:`building_on_meta`, a meta parameter of its shape whose
    ``materialize`` is ``draw`` (run by :func:`materialize`). ``draw`` on the meta device
    computes shapes only."""
    if not building_on_meta():
        return nn.Parameter(draw(device))
    param = nn.Parameter(draw(torch.device("meta")))
    param.materialize = draw
    return param


def meta_parameters(module):
    """[(name, param)] of ``module``'s parameters still on the meta device."""
    return [(name, p) for name, p in module.named_parameters() if p.is_meta]


@torch.no_grad()
def materialize(module, device):
    """Draw every meta parameter of ``module`` on ``device``, one at a time (each keeps its
    identity and attributes): a plain parameter becomes its drawn tensor; an FSDP2 one (a
    DTensor) gets storage for its rows, then its rows of the drawn tensor (drawn on the CPU).
    Raises AssertionError for a meta parameter no drawing site made (it cannot be drawn), and
    for a buffer or tensor attribute the build left on the meta device."""
    params = meta_parameters(module)
    orphans = [name for name, p in params if not hasattr(p, "materialize")]
    assert not orphans, f"meta parameters without a draw: {orphans}"
    if any(isinstance(p, DTensor) for _, p in params):
        # FSDP2's sharded params: storage for this rank's rows (fully_shard re-pads them);
        # _apply swaps every DTensor param in place, its attributes with it: put them back
        attrs = [(p, dict(vars(p))) for p in module.parameters()]
        module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
        for param, saved in attrs:
            param.__dict__.update(saved)
    for _, param in params:
        draw = param.materialize
        del param.materialize
        if isinstance(param, DTensor):
            flat, start, stop = local_shard(param)  # this rank's rows, flat
            flat.copy_(draw(torch.device("cpu")).reshape(-1)[start:stop])
            continue
        attrs = dict(vars(param))
        torch.utils.swap_tensors(param, nn.Parameter(draw(device),
                                                     requires_grad=param.requires_grad))
        param.__dict__.update(attrs)  # swap_tensors swaps the attributes too
    left = _meta_tensors(module)
    assert not left, f"tensors left on the meta device (give them a device): {left}"


def _meta_tensors(module):
    """Names of the buffers and tensor attributes (also in a dict, list or tuple attribute)
    of ``module``'s submodules still on the meta device."""
    found = [name for name, b in module.named_buffers() if b.is_meta]
    for prefix, sub in module.named_modules():
        for key, value in vars(sub).items():
            values = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else (value,)
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
                found.append(f"{prefix}.{key}" if prefix else key)
    return found
