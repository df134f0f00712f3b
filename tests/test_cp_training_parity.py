"""End to end: 10 training steps under context parallelism (every comm type, with TP, SP and DP,
with and without packed documents) reproduce the single-process losses to a relative 1e-5;
the layers use the default "auto" attention kernel (CPU flash), and a few layouts run again
with the plain-PyTorch "torch" kernel against the same references."""
import pytest

from dist_harness import run_workers
from training_utils import TINY, max_rel_diff, train_losses

STEPS = f"{TINY} --train-iters 10"
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss"


@pytest.fixture(scope="module")
def references():
    return {packed: run_workers(train_losses, 1, f"{STEPS} {PACKED if packed else ''}")[0]
            for packed in (False, True)}


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("world,extra", [
    (2, "--context-parallel-size 2 --cp-comm-type p2p"),
    (4, "--context-parallel-size 4 --cp-comm-type p2p"),
    (4, "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 "
        "--cp-comm-type a2a"),
    (4, "--context-parallel-size 2 --cp-comm-type all_gather"),  # CP=2 x DP=2
    (4, "--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2"),
    (2, "--context-parallel-size 2 --cp-comm-type auto --group-query-attention --num-query-groups 2"),
], ids=["cp2-p2p", "cp4-p2p", "tp2sp-cp2-a2a", "cp2-dp2-allgather", "cp4-hybrid", "cp2-auto-gqa"])
def test_cp_layout_matches_single_process(references, world, extra, packed):
    reference = references[packed]
    if "--num-query-groups" in extra:  # GQA changes the model: its own reference
        reference = run_workers(train_losses, 1, f"{STEPS} {PACKED if packed else ''} "
                                                 "--group-query-attention --num-query-groups 2")[0]
    results = run_workers(train_losses, world, f"{STEPS} {extra} {PACKED if packed else ''}")
    for losses in results:
        diff = max_rel_diff(losses, reference)
        print(f"{extra} packed={packed}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5


@pytest.mark.parametrize("world,extra,packed", [
    (2, "--context-parallel-size 2 --cp-comm-type p2p", True),
    (2, "--context-parallel-size 2 --cp-comm-type a2a", True),
    (2, "--context-parallel-size 2 --cp-comm-type all_gather", False),
], ids=["cp2-p2p-packed", "cp2-a2a-packed", "cp2-allgather-plain"])
def test_torch_kernel_matches_single_process(references, world, extra, packed):
    argv = f"{STEPS} {extra} {PACKED if packed else ''} --attention-kernel torch"
    for losses in run_workers(train_losses, world, argv):
        diff = max_rel_diff(losses, references[packed])
        print(f"torch kernel {extra} packed={packed}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5
