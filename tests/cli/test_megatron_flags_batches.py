"""Megatron-LM's batch-size flags, each with Megatron's meaning and a test that fails without
it: --step-batch-size-schedule (the global batch size steps with the tokens consumed; the
learning rate then counts samples) and --eval-global-batch-size / --eval-micro-batch-size."""
import contextlib
import io
import math
import re

import pytest

from dist_harness import run_workers
from megatron_cp.cli.arguments import parse_args
from megatron_cp.data.batch import DataParallelBatchSampler
from megatron_cp.data.batch_schedule import BatchSchedule, parse_schedule
from training_utils import TINY, assert_refused, max_rel_diff, train_losses

# The tiny model (32 tokens per sample) with a schedule scaled down from Megatron's
# "0:384 200B:768": 4 samples per batch up to 512 tokens (16 samples), then 8.
SCHEDULED = (TINY.replace("--global-batch-size 8 ", "")
             .replace("--lr-warmup-iters 2", "--lr-warmup-samples 8")
             + " --train-samples 40 --log-interval 1 --step-batch-size-schedule 0:4,0.512K:8")
LOG = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|.*"
                 r"learning rate: (\S+) \| global batch size:\s+(\d+) \| lm loss: (\S+) \|")


# ----- --step-batch-size-schedule: the grammar and the calculator ----------------------------

def test_schedule_grammar_is_megatrons():
    """Suffixes K/M/B/T and fractions, spaces or commas, any order; thresholds are tokens,
    floor-divided by the sequence length into samples."""
    assert parse_schedule("0:384 200B:768 400B:1152", 4096) == [
        (0, 384), (200 * 10 ** 9 // 4096, 768), (400 * 10 ** 9 // 4096, 1152)]
    assert parse_schedule(" 1.5K:1K,0:8 ", 100) == [(0, 8), (15, 1000)]
    for text, line in (
            ("", "--step-batch-size-schedule is empty"),
            ("0:4 64", "--step-batch-size-schedule entry '64' is not THRESHOLD:BATCH_SIZE"),
            ("0:4 1X:8", "--step-batch-size-schedule entry '1X:8': '1X' is not a number"),
            ("64:4", "--step-batch-size-schedule: the first threshold must be 0"),
            ("0:4 32:8 40:16", "--step-batch-size-schedule: entries '32:8' and '40:16' start "
                               "at the same sample (1,"),
            ("0:8 1K:4", "--step-batch-size-schedule: the batch size falls from '0:8' to "
                         "'1K:4'"),
            ("0:0", "--step-batch-size-schedule: batch sizes must be positive")):
        with pytest.raises(ValueError) as error:
            parse_schedule(text, 32)
        assert str(error.value).startswith(line), (text, str(error.value))


def test_schedule_gives_the_batch_size_and_microbatches_of_each_iteration():
    schedule = BatchSchedule([(0, 4), (16, 8), (30, 16)], micro_batch_size=2, data_parallel_size=2)
    assert [schedule.global_batch_size(c) for c in (0, 15, 16, 29, 30, 10 ** 9)] == [4, 4, 8, 8, 16, 16]
    assert [schedule.num_microbatches(c) for c in (0, 16, 30)] == [1, 2, 4]
    # --train-samples 40: 4 batches of 4, then 8, 8 (32), then 16 -> 48 (Megatron overshoots)
    assert schedule.iterations_for(40) == 7 and schedule.samples_after(7) == 48
    assert schedule.samples_after(2, consumed_samples=24) == 24 + 8 + 16
    with pytest.raises(ValueError, match=r"batch size \(6\) \(in use after 16 samples\) must be "
                                         r"divisible by --micro-batch-size \(2\) x data-parallel "
                                         r"size \(2\)"):
        BatchSchedule([(0, 4), (16, 6)], 2, 2).num_microbatches(16)


def test_sampler_follows_the_schedule_on_every_dp_layout():
    """Each global batch starts where the previous one ended and takes the schedule's size;
    the DP ranks split it, so the samples of every batch are the same under any DP size."""
    size_at = BatchSchedule([(0, 4), (8, 8)], 1, 1).global_batch_size

    def batches(dp, consumed):
        per_rank = [list(DataParallelBatchSampler(40, consumed, size_at, 2, rank, dp))
                    for rank in range(dp)]
        return per_rank

    one = batches(1, 0)[0]
    assert [b[0] for b in one] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32,
                                   34, 36, 38]
    two = batches(2, 0)  # batches [0,4) [4,8) [8,16) [16,24) ...: 2 + 2, then 4 + 4 samples
    assert two[0][:4] == [[0, 1], [4, 5], [8, 9], [10, 11]]
    assert two[1][:4] == [[2, 3], [6, 7], [12, 13], [14, 15]]
    assert batches(2, 8)[0][:2] == [[8, 9], [10, 11]]  # resumed mid-schedule


def test_schedule_arguments_are_checked_before_start():
    for extra, line in (
            (" --global-batch-size 8", "--step-batch-size-schedule and --global-batch-size (8) "
                                       "both give the global batch size; give one"),
            (" --step-batch-size-schedule 0:4,0.512K:6", "the --step-batch-size-schedule batch "
                                                         "size (6) must be divisible by"),
            (" --lr-warmup-samples 0 --lr-decay-iters 5",
             "with --step-batch-size-schedule and --train-samples the learning-rate schedule "
             "counts samples")):
        assert_refused(SCHEDULED + extra, line, world_size=2)
    args = parse_args(SCHEDULED.split(), world_size=1)
    assert args.train_iters == 7 and args.global_batch_size == 2 and args.lr_counts_samples
    assert (args.lr_warmup_steps, args.lr_decay_steps) == (8, 40)


# ----- --step-batch-size-schedule: training runs ---------------------------------------------

def _logged(rank, world, argv):
    """(losses, [(iteration, consumed samples, learning rate, global batch size, loss)],
    printed text) of a training run."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train_losses(rank, world, argv)
    rows = [(int(i), int(c), float(lr), int(g), float(loss))
            for i, _, c, lr, g, loss in LOG.findall(out.getvalue())]
    return losses, rows, out.getvalue()


@pytest.fixture(scope="module")
def scheduled_reference():
    return run_workers(_logged, 1, SCHEDULED)[0]


def _cosine_lr(samples, peak=3e-3, low=3e-4, warmup=8, decay=40):
    """Megatron's warmup + cosine decay, in samples."""
    if samples <= warmup:
        return peak * samples / warmup
    ratio = (samples - warmup) / (decay - warmup)
    return low + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - low)


def test_global_batch_size_and_learning_rate_follow_the_schedule(scheduled_reference):
    losses, rows, text = scheduled_reference
    assert [r[0] for r in rows] == list(range(1, 8)) and len(losses) == 7
    assert [r[3] for r in rows] == [4, 4, 4, 4, 8, 8, 8]
    assert [r[1] for r in rows] == [4, 8, 12, 16, 24, 32, 40]
    for _, consumed, lr, _, _ in rows:  # the scheduler steps by each iteration's batch
        assert lr == pytest.approx(_cosine_lr(consumed), rel=1e-6), (consumed, lr)
    assert "using step batch size schedule: 0:4,0.512K:8" in text
    assert ">= 512 tokens (16 samples) -> batch_size=8, num_microbatches=4" in text


@pytest.mark.parametrize("world,layout", [(2, ""), (2, "--pipeline-model-parallel-size 2")])
def test_schedule_under_dp_and_pp_matches_one_process(scheduled_reference, world, layout):
    reference, rows, _ = scheduled_reference
    results = run_workers(_logged, world, f"{SCHEDULED} {layout}")
    for losses, _, _ in results:  # every rank holds the global loss
        assert max_rel_diff(losses, reference) < 1e-5, (layout, losses, reference)
    assert [r[3] for r in results[0][1]] == [r[3] for r in rows]  # rank 0 prints


def test_resume_in_the_middle_of_the_schedule_continues_it(scheduled_reference, tmp_path):
    """Stopped after iteration 3 (batch 4), resumed: the batch steps to 8 after 16 samples,
    a checkpoint is saved just before (Megatron's save on a new number of microbatches), and
    losses and learning rates are those of the uninterrupted run."""
    from megatron_cp.checkpoint.files import saved_iterations
    reference, rows, _ = scheduled_reference
    save = tmp_path / "ckpt"
    first = run_workers(_logged, 1, f"{SCHEDULED} --save {save} --exit-interval 3")[0]
    assert first[0] == reference[:3] and saved_iterations(str(save)) == [3]
    losses, resumed, _ = run_workers(_logged, 1, f"{SCHEDULED} --save {save} --load {save}")[0]
    assert max_rel_diff(losses, reference[3:]) < 1e-6
    assert [r[:4] for r in resumed] == [r[:4] for r in rows[3:]]
    assert saved_iterations(str(save)) == [3, 4, 7]


# ----- --eval-global-batch-size / --eval-micro-batch-size --------------------------------------

EVAL = TINY + " --train-iters 3 --eval-interval 3 --eval-iters 2"  # 2 x 8 validation samples
VALIDATION = re.compile(r"validation loss at iteration 3 \| lm loss value: (\S+) \|")


def _validation(rank, world, argv):
    """(validation loss, samples this rank read from the validation split)."""
    from megatron_cp.data.feed import DataFeed
    read, real = [0], DataFeed.validation_iterator

    def counting(feed):
        for text in real(feed):
            read[0] += text.shape[0]
            yield text
    DataFeed.validation_iterator = counting
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_losses(rank, world, argv)
    return [float(v) for v in VALIDATION.findall(out.getvalue())], read[0]


def test_eval_batch_sizes_read_the_same_samples_in_other_batches():
    """One evaluation batch of 16 (microbatches of 4 per DP rank) covers the samples of two
    training-sized batches of 8: the same validation loss, and 16 samples read."""
    reference = run_workers(_validation, 2, EVAL)
    assert sum(read for _, read in reference) == 16
    ours = run_workers(_validation, 2, EVAL + " --eval-iters 1 --eval-global-batch-size 16 "
                                              "--eval-micro-batch-size 4")
    assert sum(read for _, read in ours) == 16 and [read for _, read in ours] == [8, 8]
    (expected,), (loss,) = reference[0][0], ours[0][0]
    assert loss == pytest.approx(expected, rel=1e-6)


def test_eval_batch_sizes_are_checked_before_start():
    args = parse_args(EVAL.split(), world_size=2)
    assert (args.eval_global_batch_size, args.eval_micro_batch_size) == (8, 2)
    assert_refused(EVAL + " --eval-global-batch-size 6", "--eval-global-batch-size (6) must be "
                   "divisible by --eval-micro-batch-size (2) x data-parallel size (2)", 2)
    assert_refused(EVAL + " --eval-micro-batch-size 0", "--eval-micro-batch-size (0) must be at "
                   "least 1", 2)
