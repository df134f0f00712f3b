"""``--check-weight-hash-across-dp-replicas-interval N``: Megatron-LM's check that every
data-parallel replica holds the same weights.

Every N iterations (and once before the first), each rank hashes each of its parameters
(SHA-1 of its fp32 values on the CPU, Megatron's hash) and gathers the hashes of its
replicas: dense parameters over the DP group, expert parameters over the expert-DP group.
Replicas that differ mean silent corruption (a bit flip in memory or on the network, a
rank that skipped an update): training stops with
:class:`~megatron_cp.resilience.faults.ReplicaMismatchError` on every rank, before the next checkpoint
can save the damage, naming the ranks and parameters that differ from their DP rank 0
(Megatron's ``[Rank r] Hash not matching for <name> in model chunk<i>`` lines also go to
Python's logging at INFO). A passing check prints ``>>> Weight hashes match after N
iterations...`` on rank 0.
"""
import hashlib
import logging

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp.resilience import faults

logger = logging.getLogger(__name__)


def _hash(param):
    """SHA-1 of a parameter's values as fp32 on the CPU: 20 bytes as a uint8 tensor [20]."""
    values = np.ascontiguousarray(param.detach().to("cpu").float().numpy())
    return torch.frombuffer(bytearray(hashlib.sha1(values).digest()), dtype=torch.uint8)


def _gathered_hashes(params, group, device):
    """This rank's hashes of ``params`` [n, 20] and every group rank's, in group order."""
    local = torch.stack([_hash(p) for _, p in params]).to(device)  # [n, 20]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return local, gathered


def _mismatches(params, group, device):
    """Names of ``params`` (``[(name, param)]``, in the same order on every replica) whose
    hash differs from the group's rank 0; True when any replica of the group differs."""
    if not params:
        return [], False
    local, gathered = _gathered_hashes(params, group, device)
    differ = (local != gathered[0]).any(dim=1).tolist()
    names = [name for (name, _), bad in zip(params, differ) if bad]
    return names, any(not torch.equal(local, other) for other in gathered)


def check_replicas_equal(named_params, group, device, where):
    """``--test-mode``: ``named_params`` (``[(name, param)]``) are the same on every rank of
    ``group`` (a collective over it); else :class:`~megatron_cp.resilience.faults.ReplicaMismatchError`
    on every rank of the group, naming ``where`` and the parameters."""
    if not named_params:
        return
    _, gathered = _gathered_hashes(named_params, group, device)
    differ = torch.stack([(other != gathered[0]).any(dim=1) for other in gathered]).any(dim=0)
    names = [name for (name, _), bad in zip(named_params, differ.tolist()) if bad]
    if names:  # the same on every rank of the group: all stop together
        raise faults.ReplicaMismatchError(
            f"--test-mode: {where}: {', '.join(names)} differ across the "
            f"data-parallel replicas (from DP rank 0 of the group): the replicas no longer hold "
            f"the same weights")


def check_weight_hashes(model_chunks, state, iteration):
    """Compare every parameter with its DP replicas (see the module doc); a collective over
    the world. Raises :class:`~megatron_cp.resilience.faults.ReplicaMismatchError` on every rank when
    any replica differs, else prints the match line on global rank 0."""
    dense, expert = [], []
    for i, chunk in enumerate(model_chunks):
        module = chunk.module if hasattr(chunk, "module") else chunk
        for name, param in module.named_parameters():
            (expert if getattr(param, "is_expert", False) else dense).append(
                (f"{name} in model chunk{i}", param))
    names, differs = _mismatches(dense, state.group("dp"), state.device)
    expert_names, expert_differs = _mismatches(expert, state.group("edp"), state.device)
    names += expert_names
    rank = state.global_rank
    for name in names:
        logger.info(f"[Rank {rank}] Hash not matching for {name}")
    bad = faults.ranks_where(differs or expert_differs, state.device)
    if not bad:
        if rank == 0:
            print(f">>> Weight hashes match after {iteration} iterations...", flush=True)
        return
    named = [None] * dist.get_world_size()
    dist.all_gather_object(named, names)
    where = "; ".join(f"rank {r}: {', '.join(n[:4])}{' ...' if len(n) > 4 else ''}"
                      for r, n in enumerate(named) if n)
    raise faults.ReplicaMismatchError(
        f"rank {rank}: Parameter hashes not matching across DP replicas after {iteration} "
        f"iterations (differing from their DP rank 0: {where}); the replicas no longer hold "
        f"the same weights (a memory or network fault?): resume from the last checkpoint "
        f"with --load, on other nodes if it happens again")
