"""Megatron-LM's loss weighting (megatron_cp/pipeline_parallel/loss_weighting.py) is the one-process function
under every layout, including microbatches whose loss tokens are few, absent, or all on one
CP rank.

- The weights: against the objective written out for one process (each microbatch's mean,
  averaged over the microbatches; or the token-weighted mean), with the MTP and MoE terms.
- Training: a corpus of mostly empty documents (EOD only) under ``--eod-mask-loss``, so the
  microbatches' loss-token counts differ widely, some microbatch has none at all, and in some
  microbatch one CP rank's half (zigzag chunks 1 and 2 of 4) has none while the other's has
  some (both checked on the data). CP2, CP2 x DP2, TP2 x SP x CP2 (a2a) and CP2 x PP2 give the
  one-process losses to 1e-5 with Megatron-LM's default weighting, CP2 with
  ``--calculate-per-token-loss`` too, and an MoE model with an MTP depth under DP2 x EP2 with
  both weightings.
"""
import os

import numpy as np
import pytest
import torch

from dist_harness import run_workers
from megatron_cp.data.indexed_dataset import IndexedDatasetBuilder, index_file_path
from megatron_cp.pipeline_parallel.loss_weighting import step_weights
from training_utils import TINY, max_rel_diff, train_losses

MICRO, GLOBAL, SEQ, ITERS = 1, 4, 32, 8
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 "
       "--moe-ffn-hidden-size 16 --expert-model-parallel-size 2 --mtp-num-layers 1 "
       "--mtp-loss-scaling-factor 0.3 --swiglu --disable-bias-linear")


def test_weights_are_the_one_process_objective():
    """sum_m w_m * S_m is the objective for any loss sums S_m: Megatron's default (each
    microbatch's mean, a microbatch without loss tokens adding 0, averaged over the G
    microbatches) and --calculate-per-token-loss (sum / N); MTP and MoE terms as the
    schedule and the router weight them."""
    counts = torch.tensor([[5., 4.], [0., 0.], [3., 1.], [7., 0.]])  # [M, 1 + D]: LM, depth 1
    sums = torch.tensor([[2.0, 1.5], [0.0, 0.0], [0.9, 0.4], [3.1, 0.0]])  # masked loss sums
    factor, tokens, scale = 0.3, 64, 4.0
    default = step_weights(counts, counts.sum(0), 4, tokens, False, factor, scale)
    objective = sum(s[0] / max(n[0], 1) for s, n in zip(sums, counts)) / 4
    mtp = sum(factor * s[1] / max(n[1], 1) for s, n in zip(sums, counts)) / 4
    assert torch.isclose(sum(w * s[0] for w, s in zip(default.lm, sums)), scale * objective)
    assert torch.isclose(sum(w[0] * s[1] for w, s in zip(default.mtp, sums)), scale * mtp)
    assert default.aux == scale / 4 and default.num_tokens == 15.0
    per_token = step_weights(counts, counts.sum(0), 4, tokens, True, factor, scale)
    assert torch.isclose(sum(w * s[0] for w, s in zip(per_token.lm, sums)),
                         scale * sums[:, 0].sum() / 15)
    mtp = sum(factor * s[1] * n[0] / max(n[1], 1) for s, n in zip(sums, counts)) / 15
    assert torch.isclose(sum(w[0] * s[1] for w, s in zip(per_token.mtp, sums)), scale * mtp)
    assert per_token.aux == scale * tokens / 15
    none = step_weights(torch.zeros(2, 1), torch.zeros(1), 2, tokens, True)  # no loss token
    assert none.lm == [1.0, 1.0] and none.num_tokens == 1.0


def _write_sparse_corpus(prefix, num_docs=1500, seed=3):
    """Mostly empty documents (EOD only), a few of 1 to 8 tokens."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(num_docs):
        length = int(rng.integers(1, 9)) if rng.random() < 0.08 else 0
        builder.add_document(rng.integers(0, 200, size=length).tolist() + [200])  # EOD: 200
    builder.finalize(index_file_path(prefix))


def _loss_masks(rank, world, argv):
    """Worker: the [b, s] loss mask of every microbatch the run trains on, in order."""
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.training import Trainer
    from training_utils import run_and_state
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    masks = []
    for _ in range(args.train_iters):
        for batch in trainer.data.microbatches(trainer.data.train_iter, GLOBAL // MICRO, MICRO):
            masks.append(batch["loss_mask"].clone())
    return masks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The run's flags over the sparse corpus: (argv, {weighting: one-process losses})."""
    prefix = os.path.join(str(tmp_path_factory.mktemp("sparse")), "corpus")
    _write_sparse_corpus(prefix)
    base = (f"{TINY.replace('--mock-data', '')} --data-path {prefix} --split 100,0,0 "
            f"--tokenizer-type NullTokenizer --micro-batch-size {MICRO} "
            f"--global-batch-size {GLOBAL} --train-iters {ITERS} --eod-mask-loss "
            f"--num-workers 0")
    masks = run_workers(_loss_masks, 1, base)[0]
    per_microbatch = torch.stack([m.sum() for m in masks])
    chunks = torch.stack([m.reshape(4, SEQ // 4).sum(1) for m in masks])  # [microbatches, 4]
    second_rank = chunks[:, 1] + chunks[:, 2]  # zigzag: CP rank 1 of 2 holds chunks 1 and 2
    assert (per_microbatch == 0).any(), "a microbatch without loss tokens"
    assert ((second_rank == 0) & (per_microbatch > 0)).any(), "a CP rank without loss tokens"
    assert len(set(per_microbatch.tolist())) > 3, per_microbatch
    references = {weighting: run_workers(train_losses, 1, f"{base} {weighting}")[0]
                  for weighting in ("", "--calculate-per-token-loss")}
    return base, references


@pytest.mark.parametrize("world,extra,weighting", [
    (2, "--context-parallel-size 2 --cp-comm-type p2p", ""),
    (2, "--context-parallel-size 2 --cp-comm-type p2p", "--calculate-per-token-loss"),
    (4, "--context-parallel-size 2 --cp-comm-type all_gather", ""),  # CP2 x DP2
    (4, "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 "
        "--cp-comm-type a2a", ""),
    (4, "--context-parallel-size 2 --pipeline-model-parallel-size 2", ""),
], ids=["cp2", "cp2-per-token", "cp2-dp2", "tp2sp-cp2-a2a", "cp2-pp2"])
def test_sparse_loss_tokens_match_one_process(corpus, world, extra, weighting):
    base, references = corpus
    for losses in run_workers(train_losses, world, f"{base} {extra} {weighting}"):
        diff = max_rel_diff(losses, references[weighting])
        print(f"{extra} {weighting}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5


@pytest.mark.parametrize("weighting", ["", "--calculate-per-token-loss"])
def test_moe_and_mtp_weighting_match_one_process(corpus, weighting):
    """The MoE balancing / z-losses and the MTP loss weighted per microbatch (or per token)
    under DP2 x EP2 equal one process (EP1), where the loss tokens differ by microbatch."""
    base, _ = corpus
    argv = f"{base} {MOE} {weighting}"
    reference = run_workers(train_losses, 1, argv.replace("--expert-model-parallel-size 2",
                                                          ""))[0]
    for losses in run_workers(train_losses, 2, argv):
        diff = max_rel_diff(losses, reference)
        print(f"MoE + MTP {weighting}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5


def _resume(rank, world, argv):
    """Worker: (the banner notes, the losses) of training ``argv``."""
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.observability.run_report import format_compat_notes
    from megatron_cp.training import pretrain
    from training_utils import parallel_state
    args = parse_args(argv.split(), world_size=world)
    notes = format_compat_notes(args.compat_notes)
    return notes, pretrain(args, parallel_state(args))


def test_checkpoint_of_the_old_default_resumes_with_the_token_weighted_loss(corpus, tmp_path):
    """A checkpoint saved before the setting existed (no calculate_per_token_loss in its saved
    arguments) resumes with the token-weighted loss it was trained with, saying so in one
    line: the losses of --calculate-per-token-loss, not those of the default."""
    base, _ = corpus
    ck = tmp_path / "ck"
    run = f"{base} --ckpt-format torch --lr-decay-iters {ITERS}"
    run_workers(train_losses, 1, f"{run} --train-iters 3 --save {ck}")
    _, default = run_workers(_resume, 1, f"{run} --load {ck}")[0]
    _, per_token = run_workers(_resume, 1, f"{run} --load {ck} --calculate-per-token-loss")[0]
    assert max_rel_diff(default, per_token) > 1e-5  # the two weightings differ on this data
    shard = ck / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    payload = torch.load(shard, weights_only=False)
    assert payload["args"]["calculate_per_token_loss"] is False
    del payload["args"]["calculate_per_token_loss"]
    torch.save(payload, shard)
    notes, old = run_workers(_resume, 1, f"{run} --load {ck}")[0]
    assert old == per_token
    lines = [line for line in notes.splitlines() if "token-weighted loss" in line]
    assert len(lines) == 1 and "megatron_cp's earlier default" in lines[0], notes
