"""The ltor batch builder (EOD masks, position resets, document ids) and the DP iterator."""
import multiprocessing
import os
import socket
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron_cp.data.batch import (DataParallelBatchSampler, build_data_iterator,
                                    close_data_iterator, get_ltor_batch)
from training_utils import TINY

EOD = 2


def test_hand_made_batch():
    text = torch.tensor([[5, 6, EOD, 7, 8, EOD, EOD, 9, 4],
                         [1, 3, 4, 5, 6, 7, 8, 9, EOD]])
    out = get_ltor_batch(text, EOD, reset_position_ids=True, reset_attention_mask=True,
                         eod_mask_loss=True)
    assert out["tokens"].tolist() == [[5, 6, EOD, 7, 8, EOD, EOD, 9], [1, 3, 4, 5, 6, 7, 8, 9]]
    assert out["labels"].tolist() == [[6, EOD, 7, 8, EOD, EOD, 9, 4], [3, 4, 5, 6, 7, 8, 9, EOD]]
    assert out["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 0, 1], [1] * 8]
    # The EOD ends its document; the token after it starts a new one at position 0.
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 0], list(range(8))]
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2, 3], [0] * 8]
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64),
                       ("loss_mask", torch.float32), ("position_ids", torch.int64),
                       ("document_ids", torch.int64)):
        assert out[key].dtype == dtype and out[key].shape == (2, 8)

    plain = get_ltor_batch(text, EOD, False, False, False)
    assert plain["document_ids"] is None
    assert plain["loss_mask"].eq(1).all()
    assert plain["position_ids"].tolist() == [list(range(8))] * 2


def reference_ltor(text, eod):
    """Megatron's loop: walk the EOD positions and shift the positions after each."""
    tokens = text[:, :-1]
    b, s = tokens.shape
    position_ids = torch.arange(s).repeat(b, 1)
    document_ids = torch.zeros(b, s, dtype=torch.long)
    for row in range(b):
        prev = 0
        for i in (tokens[row] == eod).nonzero().flatten().tolist():
            position_ids[row, i + 1:] -= i + 1 - prev
            document_ids[row, i + 1:] += 1
            prev = i + 1
    loss_mask = (tokens != eod).float()
    return position_ids, document_ids, loss_mask


def test_matches_reference_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 6, (5, 33), generator=gen)
    out = get_ltor_batch(text, 0, True, True, True)
    position_ids, document_ids, loss_mask = reference_ltor(text, 0)
    assert torch.equal(out["position_ids"], position_ids)
    assert torch.equal(out["document_ids"], document_ids)
    assert torch.equal(out["loss_mask"], loss_mask)


def test_bad_shape():
    with pytest.raises(ValueError, match="seq_length"):
        get_ltor_batch(torch.zeros(4, dtype=torch.long), EOD)


class Numbered:
    """Sample i is [i] * (s + 1)."""

    def __init__(self, n, s=3):
        self.n, self.s = n, s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"text": np.full(self.s + 1, i, dtype=np.int64)}


def global_batches(dataset, gbs, mbs, dp, consumed=0):
    """Per global batch, the sample ids in DP-rank order (rank 0's microbatches first)."""
    per_rank = []
    for rank in range(dp):
        it = build_data_iterator(dataset, gbs, mbs, rank, dp, consumed)
        per_rank.append([batch[:, 0].tolist() for batch in it])
    num_micro = gbs // (mbs * dp)
    out = []
    for k in range(len(per_rank[0]) // num_micro):
        batch = []
        for rank in range(dp):
            for micro in per_rank[rank][k * num_micro:(k + 1) * num_micro]:
                batch += micro
        out.append(batch)
    return out


def test_same_global_batches_for_every_dp_layout():
    dataset = Numbered(53)
    reference = global_batches(dataset, 8, 2, 1)
    assert reference == [list(range(k * 8, (k + 1) * 8)) for k in range(6)]  # partial dropped
    assert global_batches(dataset, 8, 2, 2) == reference
    assert global_batches(dataset, 8, 1, 4) == reference
    assert global_batches(dataset, 8, 4, 2) == reference
    # DP rank 1 of 2 gets the second half of each global batch, in microbatches.
    it = build_data_iterator(dataset, 8, 2, 1, 2, 0)
    first = [next(it) for _ in range(2)]
    assert [b[:, 0].tolist() for b in first] == [[4, 5], [6, 7]]
    assert first[0].shape == (2, 4) and first[0].dtype == torch.int64


def test_resume_from_consumed_samples():
    dataset = Numbered(64)
    full = global_batches(dataset, 8, 2, 2)
    assert global_batches(dataset, 8, 2, 2, consumed=24) == full[3:]
    assert global_batches(dataset, 8, 1, 1, consumed=24) == full[3:]
    # Interrupting an iterator and resuming from its count gives the same stream.
    it = build_data_iterator(dataset, 8, 2, 0, 2, 0)
    seen = [next(it)[:, 0].tolist() for _ in range(4)]  # 2 global batches on rank 0
    resumed = build_data_iterator(dataset, 8, 2, 0, 2, 16)
    rest = [b[:, 0].tolist() for b in resumed]
    assert seen + rest == [b[:, 0].tolist() for b in build_data_iterator(dataset, 8, 2, 0, 2, 0)]


def test_sampler_validation_and_workers():
    with pytest.raises(ValueError, match="divisible"):
        DataParallelBatchSampler(100, 0, 10, 4, 0, 1)
    with pytest.raises(ValueError, match="dp_rank"):
        DataParallelBatchSampler(100, 0, 8, 2, 2, 2)
    assert len(DataParallelBatchSampler(100, 20, 8, 2, 0, 2)) == 20  # 10 batches x 2 micro
    assert build_data_iterator(None, 8, 2, 0, 1) is None
    with_workers = [b[:, 0].tolist() for b in build_data_iterator(Numbered(16), 8, 2, 1, 2, 0,
                                                                  num_workers=1)]
    assert with_workers == [[4, 5], [6, 7], [12, 13], [14, 15]]


def test_closing_an_iterator_ends_its_loader_processes():
    """close_data_iterator ends the workers at once, though a reference keeps the iterator."""
    it = build_data_iterator(Numbered(16), 8, 2, 0, 1, 0, num_workers=2)
    assert next(it)[:, 0].tolist() == [0, 1]
    workers = multiprocessing.active_children()
    assert len(workers) == 2
    close_data_iterator(it)
    assert not any(w.is_alive() for w in workers)
    close_data_iterator(it)  # again, and on None: nothing to do
    close_data_iterator(None)


def test_loader_processes_outlive_sigterm_under_exit_signal_handler():
    """SLURM's SIGTERM reaches every process of the job step: under --exit-signal-handler the
    loader processes ignore it, so the batches go on until the loop saves and exits."""
    it = build_data_iterator(Numbered(16), 8, 2, 0, 1, 0, num_workers=2, keep_on_sigterm=True)
    # one batch from each worker: both have run their start-up (where the signal is ignored)
    assert [next(it)[:, 0].tolist() for _ in range(2)] == [[0, 1], [2, 3]]
    workers = multiprocessing.active_children()
    assert len(workers) == 2
    for w in workers:
        os.kill(w.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert all(w.is_alive() for w in workers)
    assert [b[:, 0].tolist() for b in it] == [[4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                              [14, 15]]
    close_data_iterator(it)


RUN_AND_COUNT = """
import gc, multiprocessing, sys
from megatron_cp.cli.arguments import parse_args
from megatron_cp.training import pretrain
gc.disable()  # the trainer sits in reference cycles: only an explicit close ends its workers
pretrain(parse_args(sys.argv[1:], world_size=1))
print("loader processes left:", len(multiprocessing.active_children()))
"""


def test_a_run_ends_its_loader_processes():
    """pretrain() ends the DataLoader workers of its training and validation iterators before
    it returns: a rank that then ends with os._exit (a forked rank, a rank that lost a peer)
    runs no finaliser that would. (A process of its own: a test worker may not have any.)"""
    argv = TINY + " --train-iters 3 --eval-iters 1 --eval-interval 2 --num-workers 2"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    done = subprocess.run([sys.executable, "-c", RUN_AND_COUNT, *argv.split()], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loader processes left: 0" in done.stdout, done.stdout
