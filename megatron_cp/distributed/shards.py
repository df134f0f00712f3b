"""Which elements of a parameter this rank holds: all of them, or, for a parameter that
FSDP2 shards (a DTensor, :mod:`megatron_cp.distributed.fsdp`), its rows of dim 0."""
from torch.distributed.tensor import DTensor


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
    local = param.to_local().detach()  # [r1 - r0, *rest]
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
    follows (else the main param, which the weights are a rounding of, fills it)."""
    flat, start, stop = local_shard(param)
    compute = getattr(param, "compute_dtype", None)
    if stop == start or (compute is not None and for_load and with_optimizer):
        return None
    if compute is not None and not for_load:
        flat = flat.to(compute)
    return flat, start, stop
