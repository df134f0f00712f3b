"""Checkpoint faults, each explained in one line: a save that cannot write its files (a full
disk, a quota, a permission, a lost rank) and a load that meets a damaged file.

A save runs in phases, each ending where the ranks used to meet at a barrier: prepare the
``iter_N.tmp`` folder, write every rank's files, commit (rename the folder, move the
tracker). :class:`SaveAttempt` runs each phase on every rank and then makes the ranks agree
on its outcome (one collective), so no rank waits alone at the next barrier and none goes on
training after another failed. A failure removes the partial files (the ``.tmp`` folder, a
half-written tracker) and every rank raises the same :class:`SaveFailedError`, which global
rank 0 prints as ``error: ...`` (megatron_cp.resilience.faults.report): the file, what the system said,
and that the tracker still names the previous checkpoint. A lost rank breaks the agreement
itself: the partial files go as well and the lost-contact error of ``training.pretrain`` is
the line.

A failure that is not the file system's (no ``OSError`` in it: a bug) keeps its traceback on
the rank that met it; the ranks still agree, so none hangs.

Loading, a damaged file must be named, not its folder: :class:`NamingFileSystem` is DCP's
file system with errors that carry the file they happened in (:class:`UnreadableFile` for a
read), and :func:`latest_intact` finds the newest other iteration that looks whole, for the
message's way out (``--ckpt-step N``).
"""
import contextlib
import errno
import os
import shutil
import zipfile

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.filesystem import FileSystem

from megatron_cp.resilience import faults  # the training's faults: a SaveFailedError is one

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
REASON_CHARS = 100  # a reason quoted from an exception is cut here: a few words, one line


class SaveFailedError(faults.TrainingFault):
    """A checkpoint save failed on some rank. Every rank raises it (they agreed), so global
    rank 0 is alive to print it and the others stay silent."""
    printed_by_rank_0 = True


class UnreadableFile(Exception):
    """A checkpoint file whose bytes do not decode (``path``, ``reason``: a few words)."""

    def __init__(self, path, reason):
        super().__init__(path, reason)
        self.path, self.reason = path, reason

    def __str__(self):
        return f"checkpoint file {self.path} is damaged ({self.reason})"


def short_reason(error):
    """``error`` in a few words on one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = " ".join(lines[0].split()) if lines else ""
    if len(text) > REASON_CHARS:
        text = text[:REASON_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _causes(error, rank):
    """``(rank, exception)`` for ``error`` and everything inside it: its causes and, for a DCP
    CheckpointException, each failing rank's exception (depth first)."""
    seen, todo = set(), [(rank, error)]
    while todo:
        rank, current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield rank, current
        if isinstance(current, CheckpointException):
            todo += [(r, failure[0]) for r, failure in sorted(current.failures.items())]
        todo += [(rank, current.__cause__), (rank, current.__context__)]


def find(error, kind, rank=None):
    """The first ``(rank, exception of type kind)`` inside ``error`` (rank: where it was
    raised, ``rank`` unless a CheckpointException says another), or None."""
    return next(((r, e) for r, e in _causes(error, rank) if isinstance(e, kind)), None)


@contextlib.contextmanager
def naming(path):
    """Let an OSError raised inside name ``path`` when it names no file (torch.save into an
    open file reports ENOSPC as a RuntimeError whose context is a nameless OSError)."""
    try:
        yield
    except Exception as error:
        found = find(error, OSError)
        if found is None or found[1].filename:
            raise
        raise OSError(found[1].errno, found[1].strerror or str(found[1]), path) from error


class NamingFileSystem(FileSystem):
    """DCP's local file system, whose errors name their file: a write's OSError gets the
    path (:func:`naming`), and anything raised while a file is read becomes
    :class:`UnreadableFile` naming it (DCP reports only the folder)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "r" not in mode:
            with naming(str(path)), super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as error:
            reason = (short_reason(error) if isinstance(error, OSError) else
                      f"its bytes do not decode: {short_reason(error)}")
            raise UnreadableFile(str(path), reason) from error


def writer(folder):
    """DCP's FileSystemWriter into ``folder``, naming the file of a failed write."""
    storage = dcp.FileSystemWriter(folder)
    storage.fs = NamingFileSystem()
    return storage


def reader(folder):
    """DCP's FileSystemReader of ``folder``, naming a file it cannot decode."""
    storage = dcp.FileSystemReader(folder)
    storage.fs = NamingFileSystem()
    return storage


def _what_happened(error):
    """``(what, errno)`` of an OSError in words: "no space left on device"."""
    if error.errno:
        words = os.strerror(error.errno)
        return words[:1].lower() + words[1:], error.errno
    return " ".join(str(error.strerror or error).split()), None


class SaveAttempt:
    """One save of iteration ``iteration`` under ``root``, written into ``tmp`` (and, while
    committing, the tracker's ``tracker_partial``). ``latest()`` reads the iteration the
    tracker names (None: none yet); ``group`` is the group of every rank that agrees."""

    def __init__(self, root, iteration, tmp, tracker_partial, latest, group=None):
        self.root, self.iteration, self.tmp = root, iteration, tmp
        self.tracker_partial, self.latest, self.group = tracker_partial, latest, group

    def start(self):
        """The first phase: global rank 0 makes ``tmp`` afresh, with its ``rng/`` folder."""
        def prepare():
            if dist.get_rank() == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
                os.makedirs(os.path.join(self.tmp, "rng"), exist_ok=True)
        self.phase(prepare)

    def phase(self, step):
        """Run ``step()`` here, then agree with every rank on how it went (a collective, in
        place of a barrier). Returns when it went well everywhere; else removes the partial
        files and raises on every rank (see the module docstring)."""
        error, outcome = None, None
        try:
            step()
        except (Exception, CheckpointException) as failure:
            error, outcome = failure, self._outcome(failure)
        outcomes = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(outcomes, outcome, group=self.group)
        except Exception:  # a rank is gone: training.pretrain names it
            self.remove_partial_files()
            raise
        failed = [o for o in outcomes if o is not None]
        if not failed:
            return
        if dist.get_rank() == 0:
            self.remove_partial_files()
        if outcome is not None and outcome[0] == "bug":
            raise error  # with its traceback
        kind, rank, text = next((o for o in failed if o[0] == "fault"), failed[0])
        if kind == "bug":
            text = f"{text} (a bug: its traceback is in rank {rank}'s output)"
        raise SaveFailedError(self._message(rank, text))

    def _outcome(self, failure):
        """What this rank tells the others: ("fault", rank, words) for a file-system error,
        ("bug", rank, words) for anything else."""
        found = find(failure, OSError, dist.get_rank())
        if found is None:
            return "bug", dist.get_rank(), short_reason(failure)
        rank, error = found
        what, number = _what_happened(error)
        where = f" while writing {error.filename}" if error.filename else ""
        advice = ("free space there, or give --save another folder" if number in _FULL else
                  "make it writable, or give --save another folder" if number in _NOT_WRITABLE
                  else "check that file system, or give --save another folder")
        return "fault", rank, f"{what}{where}; {advice}"

    def _message(self, rank, text):
        try:
            latest = self.latest()
        except (OSError, ValueError):
            latest = None
        kept = (f"the latest checkpoint is still iteration {latest}: --load {self.root} "
                f"resumes from it" if latest is not None else
                "no earlier checkpoint is there")
        return (f"the checkpoint save at iteration {self.iteration} under {self.root} failed "
                f"on rank {rank}: {text}. Its partial files ({self.tmp}) are removed and {kept}")

    def remove_partial_files(self):
        """Delete what this save wrote: the ``.tmp`` folder and a tracker not yet in place."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(self.tracker_partial)


def distcp_index(folder):
    """``{relative file name: bytes it must hold}`` from the DCP index ``folder/.metadata``
    (raises what unpickling raises when the index is damaged)."""
    needed = {}
    for info in dcp.FileSystemReader(folder).read_metadata().storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def _looks_intact(folder):
    """Whether an iteration folder looks whole at a glance: its DCP index reads and its
    files hold the bytes it indexes, and every ``.pt`` file's zip directory reads (which
    catches truncation; a garbled middle shows only when the file is loaded)."""
    try:
        if os.path.exists(os.path.join(folder, ".metadata")):
            for name, end in distcp_index(folder).items():
                if os.path.getsize(os.path.join(folder, name)) < end:
                    return False
        found = False
        for directory, _, names in os.walk(folder):
            for name in names:
                if name.endswith(".pt"):
                    with zipfile.ZipFile(os.path.join(directory, name)):
                        found = True
        return found
    except Exception:  # noqa: BLE001 - any error reading it: not intact
        return False


def latest_intact(candidates):
    """The newest iteration of ``candidates`` (``{iteration: folder}``) whose folder looks
    whole (:func:`_looks_intact`), or None."""
    return next((it for it in sorted(candidates, reverse=True)
                 if _looks_intact(candidates[it])), None)
