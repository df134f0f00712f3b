"""Sequence partition for context parallelism: the zigzag split and its inverse.

Zigzag: cut the sequence into 2*CP equal chunks; CP rank r keeps chunks r and 2*CP-1-r
(an early and a late one), which balances causal attention work over the ranks.

Turning a whole microbatch (packed documents included) into this rank's tensors is
``megatron_cp.data.microbatch.prepare_microbatch``, which pads and then uses
:func:`zigzag_indices` per document.
"""
import torch
import torch.distributed as dist

def _multiple(cp_size):
    """Length granularity of the split: 2*CP chunks (nothing to split at CP=1)."""
    return 1 if cp_size == 1 else 2 * cp_size


def _check_splittable(length, cp_size, what="sequence length"):
    if length % _multiple(cp_size) != 0:
        raise ValueError(
            f"{what} ({length}) must be divisible by 2 x context_parallel_size "
            f"(2 x {cp_size} = {2 * cp_size}) for the zigzag split; pad the sequence to a "
            f"multiple of {2 * cp_size} (e.g. --seq-length {-(-length // (2 * cp_size)) * 2 * cp_size})")


def zigzag_indices(cp_rank, cp_size, seq_len, device=None):
    """Global positions held by ``cp_rank``: chunks r and 2*CP-1-r of 2*CP. int64 [seq_len/CP]."""
    _check_splittable(seq_len, cp_size)
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp_size)
    early = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    late_start = (2 * cp_size - 1 - cp_rank) * chunk
    late = torch.arange(late_start, late_start + chunk, device=device)
    return torch.cat([early, late])


def zigzag_split(x, cp_rank, cp_size, dim):
    """This rank's zigzag shard of ``x`` along ``dim``: chunks r and 2*CP-1-r concatenated."""
    _check_splittable(x.shape[dim], cp_size, f"size of dim {dim}")
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def zigzag_gather(shards, dim):
    """Inverse of :func:`zigzag_split`: the per-rank shards (rank order) -> the full tensor."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    chunks = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        early, late = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp_size - 1 - rank] = early, late
    return torch.cat(chunks, dim=dim)


def zigzag_all_gather(x, cp_group, dim):
    """Collective, no autograd: every rank gets the full tensor from the zigzag shards."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(shards, x.contiguous(), group=cp_group)
    return zigzag_gather(shards, dim)
