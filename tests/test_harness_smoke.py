"""The harness itself: results come back, and a failing worker's traceback reaches the test."""
import os

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


def _say_hello(rank, world_size, name):
    print(f"hello from rank {rank}, {os.environ.get('HARNESS_SMOKE')}", flush=True)
    return rank


def test_workers_write_to_the_tests_output_and_take_its_environment(capfd, monkeypatch):
    """Workers fork from a server started once; they must still print into the capture of
    the test that runs them and see the variables it set, as spawned processes would."""
    with capfd.disabled():  # the server (if not running yet) starts with other stdio
        run_workers(_say_hello, 1, "warm-up")
    capfd.readouterr()
    monkeypatch.setenv("HARNESS_SMOKE", "set by the test")
    assert run_workers(_say_hello, 2, "checked") == [0, 1]
    out = capfd.readouterr().out
    assert "hello from rank 0, set by the test" in out, out
    assert "hello from rank 1, set by the test" in out, out
