"""End to end: 5 optimizer steps under TP, TP+SP, DP and TP x DP reproduce the single-process
losses to a relative 1e-5 (fp32, CPU)."""
import pytest

from dist_harness import run_workers
from training_utils import TINY, max_rel_diff, train_losses

STEPS = f"{TINY} --train-iters 5"


@pytest.fixture(scope="module")
def reference():
    return run_workers(train_losses, 1, STEPS)[0]


@pytest.mark.parametrize("world,extra", [
    (2, "--tensor-model-parallel-size 2"),
    (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
    (2, ""),  # DP=2
    (2, "--overlap-grad-reduce"),  # DP=2 with the reduce overlapped with backward
    (4, "--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce"),  # TP=2 x DP=2
])
def test_layout_matches_single_process(reference, world, extra):
    results = run_workers(train_losses, world, f"{STEPS} {extra}")
    assert reference[-1] < reference[0], "the tiny model must learn"
    for losses in results:  # every rank reports the same global loss
        diff = max_rel_diff(losses, reference)
        print(f"{extra or 'DP=2'}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5
