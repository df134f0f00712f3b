"""Faults of a running job, each turned into one clear line: a lost peer, a NaN or inf.

A fault is not a bug, so it gets no traceback: ``training.main`` prints the message of a
:class:`TrainingFault` as ``error: <message>`` and exits with :data:`FAULT_EXIT_STATUS`.

* :class:`LostContactError`: a collective failed because another rank is gone. Gloo raises
  at once when a peer's process dies (its sockets close: "Connection closed by peer") and
  after ``--distributed-timeout-minutes`` when a peer stops answering (a hung process, a
  network partition); :func:`is_lost_contact` recognises both. Every surviving rank names
  itself, what the job was doing and the checkpoint to resume from.
* :class:`NonFiniteError`: the training loss or the gradient norm is NaN or inf. Both are
  values every rank holds identically (the loss after its all-reduce, the norm after its
  reductions), so every rank stops at the same point and no collective is left waiting.
* :class:`ReplicaMismatchError`: data-parallel replicas hold different weights
  (``--check-weight-hash-across-dp-replicas-interval``); the ranks agree before raising.
* ``checkpoint.faults.SaveFailedError``: a checkpoint save could not write its files; the
  ranks agree, and rank 0 alone prints it (``printed_by_rank_0``).

:func:`raise_on_every_rank` is the same idea for user errors that may hit some ranks only
(one rank's checkpoint shard is corrupted): after a step that may fail locally, the ranks
agree, and every rank raises the first failing rank's error, which rank 0 prints.
"""
import contextlib
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

# Not argparse's usage status (2): the command was right, the job met a fault.
FAULT_EXIT_STATUS = 1

# How gloo, the c10d store and NCCL word a peer that died or stopped answering. (NCCL's
# watchdog usually ends the process itself once --distributed-timeout-minutes pass.)
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe",
           "connection refused", "econnreset", "epipe", "remote process exited",
           "communicator was aborted")
_TIMED_OUT = ("timed out waiting", "socket timeout", "operation timeout", "wait timeout")


class TrainingFault(RuntimeError):
    """A fault of the running job (message already names the rank): one line, no traceback."""


class LostContactError(TrainingFault):
    """A collective failed because another rank died or the network failed."""


class NonFiniteError(TrainingFault):
    """The training loss or the gradient norm is NaN or inf."""


class ReplicaMismatchError(TrainingFault):
    """Data-parallel replicas hold different weights (megatron_cp.resilience.weight_hash)."""


class Progress:
    """What the job is doing now, in words ("iteration 5"): named by a lost-contact error."""

    def __init__(self, activity="start-up"):
        self.activity = activity


def is_lost_contact(error):
    """True if ``error`` (raised by a collective) means a peer is gone or not answering."""
    if isinstance(error, getattr(dist, "DistNetworkError", ())):
        return True
    if not isinstance(error, RuntimeError) or isinstance(error, TrainingFault):
        return False
    text = str(error).lower()
    return any(word in text for word in _CLOSED + _TIMED_OUT)


def _cause(error, timeout_minutes):
    text = str(error).lower()
    if any(word in text for word in _CLOSED):
        return "the connection to it was closed"
    return f"no answer within --distributed-timeout-minutes {timeout_minutes}"


def lost_contact(error, rank, activity, checkpoint, parallel, latest=None):
    """The :class:`LostContactError` for gloo/store ``error`` seen by ``rank`` during
    ``activity``; ``checkpoint``: the checkpoint section (--save, --load: where to resume);
    ``parallel``: the parallel section (--distributed-timeout-minutes); ``latest`` is the last
    saved iteration under ``--save`` (None: unknown)."""
    cause = _cause(error, parallel.distributed_timeout_minutes)
    save, load = checkpoint.save, checkpoint.load
    if save and latest is not None:
        fix = f"re-run with --load {save} to continue from the last checkpoint (iteration {latest})"
    elif save:
        fix = f"re-run with --load {save} (no checkpoint is there yet: it starts from scratch)"
    elif load:
        fix = f"re-run with --load {load} to start again from the checkpoint it was loaded from"
    else:
        fix = ("nothing was saved (no --save): re-run, with --save DIR --save-interval N to "
               "keep checkpoints")
    return LostContactError(f"rank {rank}: lost contact with another rank during {activity} "
                            f"({cause}: a process died or the network failed); {fix}")


def non_finite(what, value, iteration, rank, ranks):
    """The :class:`NonFiniteError` for ``what`` ("loss", "gradient norm") being ``value`` at
    ``iteration``; ``ranks`` are the ranks whose own part of it is not finite."""
    where = f"not finite on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" \
        if ranks else "each rank's part is finite: their sum overflowed"
    return NonFiniteError(
        f"rank {rank}: the {what} is {value} at iteration {iteration} ({where}); "
        f"stopped before the update, so the last checkpoint holds finite weights: resume from "
        f"it with --load <save dir>, with a lower --lr or a longer --lr-warmup-iters, or pass "
        f"--no-check-for-nan-in-loss-and-grad to train on regardless")


def ranks_where(flag, device):
    """Collective over the world: the global ranks whose ``flag`` is true (sorted)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.float32, device=device)
    flags[dist.get_rank()] = 1.0 if flag else 0.0
    dist.all_reduce(flags)
    return [r for r, value in enumerate(flags.tolist()) if value > 0]


def raise_on_every_rank(error, device):
    """Collective over the world, after a step that may fail on some ranks only: if any rank
    got a ``ValueError``, every rank raises (its own, else the first failing rank's message
    prefixed with that rank), so rank 0 always has the line to print. ``error`` is this
    rank's ValueError or None."""
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() == 0:
        return
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else str(error))
    if error is not None:
        raise error
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise ValueError(f"rank {rank}: {message}")


def print_error_lines(lines):
    """``error: <line>`` on stderr for each line, also written to torchrun's error file."""
    record_for_torchrun(lines)
    print("\n".join(f"error: {line}" for line in lines), file=sys.stderr, flush=True)


def record_for_torchrun(lines):
    """Write ``lines`` to torchrun's error file for this worker, when there is one: its
    failure summary then shows them (as the traceback it would otherwise lack)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = "\n".join(f"error: {line}" for line in lines)
    data = {"message": {"message": text,
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        with open(path, "w") as file:
            json.dump(data, file)


def report(fault, grace_seconds):
    """Print ``error: <message>`` on stderr and return :data:`FAULT_EXIT_STATUS`.

    Global rank 0 prints at once. Another rank first waits ``grace_seconds``: when rank 0
    saw the same fault it has printed and exited, and the launcher (torchrun, srun
    --kill-on-bad-exit) ends the others quietly; a rank still alive then prints its own
    line (its message names it), which matters when rank 0 is the one that died. A fault
    the ranks agreed on (``printed_by_rank_0``, e.g. a failed checkpoint save) is printed by
    rank 0 only."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0 and getattr(fault, "printed_by_rank_0", False):
        return FAULT_EXIT_STATUS  # every rank agreed on it: rank 0 is alive and prints it
    if rank != 0:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher may end us while we wait
        time.sleep(grace_seconds)
    print_error_lines([" ".join(str(fault).split())])
    return FAULT_EXIT_STATUS
