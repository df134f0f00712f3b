"""The harness itself: results come back, and a failing worker's traceback reaches the test."""
import pytest
import torch
import torch.distributed as dist

from dist_harness import WorkerError, run_workers


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom from rank one")
    dist.barrier()


def test_results_and_tracebacks():
    assert run_workers(_sum_ranks, 3) == [3.0, 3.0, 3.0]
    with pytest.raises(WorkerError, match="boom from rank one"):
        run_workers(_fail_on_one, 2, timeout=20)
