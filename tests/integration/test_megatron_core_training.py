"""Megatron-LM's numbers, continued: megatron-core 0.16.1's own training loop (its GPTDataset,
DDP, Adam, LR schedule and schedule's loss weighting: tests/megatron_core_training.py) trains
and saves at iteration 3; ``--load`` of that checkpoint then trains iterations 4 to 8 here and
logs megatron-core's next 5 losses within 1e-5 relative, in one process and under TP2 with SP,
CP2, DP2 and PP2, with Megatron-LM's default loss weighting (each microbatch's mean, averaged
over the microbatches) and with ``--calculate-per-token-loss``.

Both Megatron's GPT defaults (learned absolute positions, tied embeddings, LayerNorm, its
tanh GELU with biases) and a Llama-style model (RMSNorm, SwiGLU, rotary, untied, GQA); 4
microbatches of 2 samples a global batch (2 per DP rank at DP2); ``--eod-mask-loss`` over
documents of 2 to 30 tokens, so samples, microbatches and CP halves have different numbers
of loss tokens; dropout 0; a 128-token vocabulary (127 + EOD) that no layout pads, since
megatron-core's softmax runs over padded rows and ours does not.
"""
import os

import pytest
import torch

import megatron.core  # noqa: F401  (a test requirement: scripts/env.sh installs it)
from dist_harness import run_workers
import megatron_core_training as mct

TOL = 1e-5  # relative: fp32 losses after five Adam steps from the same state
LAYOUTS = {
    "one process": (1, ""),
    "TP2 SP": (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
    "CP2": (2, "--context-parallel-size 2"),
    "DP2": (2, ""),
    "PP2": (2, "--pipeline-model-parallel-size 2"),
}


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """(corpus prefix, checkpoint root, {(kind, per token): megatron-core's 8 losses})."""
    root = str(tmp_path_factory.mktemp("mcore_training"))
    prefix = os.path.join(root, "corpus")
    mct.write_corpus(prefix)
    return prefix, root, run_workers(mct.train_all, 1, prefix, root)[0]


def _continue_all(rank, world, prefix, root, layout):
    """Worker: for each megatron-core run, --load its checkpoint and train to the end in
    ``layout``; {run: our logged losses}."""
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.training import pretrain
    from training_utils import parallel_state
    losses = {}
    for kind, per_token in mct.RUNS:
        argv = (f"{mct.our_flags(prefix)} --load {mct.checkpoint_dir(root, kind, per_token)} "
                f"--use-checkpoint-args {layout}"
                + (" --calculate-per-token-loss" if per_token else "")).split()
        args = parse_args(argv, world_size=world)
        losses[kind, per_token] = pretrain(args, parallel_state(args))
    return losses


def test_the_weightings_differ(megatron_run):
    """The two weightings give megatron-core losses that differ by far more than TOL, so
    the comparisons below tell them apart."""
    _, _, theirs = megatron_run
    for kind in ("gpt", "llama"):
        default, per_token = (torch.tensor(theirs[kind, p], dtype=torch.float64)
                              for p in (False, True))
        assert ((default - per_token).abs() / default).max() > 4 * TOL, (default, per_token)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_continues_megatron_cores_losses(megatron_run, layout):
    prefix, root, theirs = megatron_run
    world, flags = LAYOUTS[layout]
    ours = run_workers(_continue_all, world, prefix, root, flags)[0]
    for run in mct.RUNS:
        expected = torch.tensor(theirs[run][mct.SAVED_AT:], dtype=torch.float64)
        got = torch.tensor(ours[run], dtype=torch.float64)
        assert got.shape == expected.shape, (run, ours[run])
        diff = ((got - expected).abs() / expected.abs()).max().item()
        print(f"{layout} {run}: max relative difference from megatron-core {diff:.1e}")
        torch.testing.assert_close(got, expected, rtol=TOL, atol=0, msg=f"{layout} {run}")
