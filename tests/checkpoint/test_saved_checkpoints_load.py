"""Checkpoints written by earlier code still load: the fixtures under tests/fixtures/checkpoints/
were saved (2 of 4 iterations of a tiny GPT, each on-disk format) by the commit named in their
fixtures.json, before the house's modules moved. A resume from each today gives the losses the
resume gave then; torch_dist's also under TP=2 (its layout-free load)."""
import json
import os

import pytest

from dist_harness import run_workers
from training_utils import max_rel_diff, train_losses

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                    "checkpoints")
with open(os.path.join(HERE, "fixtures.json")) as f:
    FIXTURES = json.load(f)

# fp32 throughout; the recorded losses came from another machine's kernels, so the bound is a
# few fp32 roundings of a sum over a few thousand terms, not bit equality.
FP32_BOUND = 1e-5


@pytest.mark.parametrize("fmt,world", [("torch", 1), ("torch_dist", 1), ("torch_dist", 2)])
def test_fixture_checkpoint_resumes_to_the_recorded_losses(fmt, world, tmp_path):
    argv = FIXTURES["argv"] + f" --load {os.path.join(HERE, fmt)} --ckpt-format {fmt}"
    if world == 2:
        argv += " --tensor-model-parallel-size 2"
    losses = run_workers(train_losses, world, argv)[0]
    recorded = FIXTURES["formats"][fmt]["resumed_losses"]
    assert len(losses) == 2, losses  # resumed at iteration 2 of 4
    assert max_rel_diff(losses, recorded) < FP32_BOUND, (losses, recorded)
