"""Which elements of a parameter this rank holds: all of them, or, for a parameter that
FSDP2 shards (a DTensor, :mod:`megatron_cp.distributed.fsdp`), its rows of dim 0."""
import torch
from torch.distributed.tensor import DTensor

from megatron_cp.distributed.fsdp_fp8 import unwrapped


def local_tensor(tensor):
    """This rank's part of ``tensor``: its local shard for a DTensor (a view sharing its
    storage), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_shard(param):
    """``(flat, start, stop)``: this rank's elements of ``param`` as a 1-D view ``flat`` of
    its storage, which are the flat elements ``[start, stop)`` of the whole param (for an
    FSDP param its rows ``[r0, r1)``, dim-0 chunks as ``torch.chunk`` cuts them)."""
    if not isinstance(param, DTensor):
        return param.detach().view(-1), 0, param.numel()
    local = unwrapped(param.to_local().detach())  # [r1 - r0, *rest]; FP8-gathered: its rows
    rows = param.shape[0]
    per_rank = -(-rows // param.device_mesh.size())  # ceil
    r0 = min(rows, per_rank * param.device_mesh.get_local_rank())
    row_numel = param.numel() // rows if rows else 0
    assert local.shape[0] == min(per_rank, rows - r0), (tuple(param.shape), tuple(local.shape))
    return local.view(-1), r0 * row_numel, r0 * row_numel + local.numel()


def model_piece(param, for_load, with_optimizer):
    """``(flat, start, stop)`` of what a checkpoint's model entry of ``param`` holds on this
    rank, or None for nothing: its elements (:func:`local_shard`) in the model's dtype.

    An FSDP2 fp32 master of a bf16/fp16 model (``compute_dtype``) is saved as a rounded
    copy, the weights the model computes with (the master goes in as the optimizer's main
    param); a load reads the weights into the master, upcast, only when no optimizer state
    follows (else the main param, which the weights are a rounding of, fills it).

    An FP8 weight (``--fp8-param-gather``) is saved dequantized, in its nominal dtype, as
    Megatron-LM saves it; a load of weights only reads them as the source of the next fp32
    masters (the optimizer casts the FP8 weight from those), a load with the optimizer
    state reads none (the masters are cast)."""
    if getattr(param, "fp8_storage", False):  # --fp8-param-gather (megatron_cp/fp8/params.py)
        return _fp8_piece(param, for_load, with_optimizer)
    flat, start, stop = local_shard(param)
    compute = getattr(param, "compute_dtype", None)
    if stop == start or (compute is not None and for_load and with_optimizer):
        return None
    if compute is not None and not for_load:
        local = param.to_local() if isinstance(param, DTensor) else None
        # FSDP2 gathering in FP8: its FP8 weight dequantized, as the distributed optimizer's
        flat = (local.fp8_rows().float() / local._scale).to(compute).view(-1) \
            if hasattr(local, "fp8_rows") else flat.to(compute)
    return flat, start, stop


def _fp8_piece(param, for_load, with_optimizer):
    if for_load and with_optimizer:
        return None
    if for_load:
        param._pending = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        return param._pending.view(-1), 0, param.numel()
    return param.dequantize().view(-1), 0, param.numel()
