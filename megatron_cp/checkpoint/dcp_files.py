"""What the two DCP formats (ours ``torch_dist``, Megatron-FSDP's ``fsdp_dtensor``) share:
an iteration folder written atomically by every rank (in the background with
``--async-save``), its DCP index checked before a load reads it, and a load's errors as one
line naming the damaged file. It knows neither format.
"""
import os
import threading

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_cp.resilience import faults as training_faults
from megatron_cp.checkpoint import faults, files
from megatron_cp.checkpoint import state as training_state


def root_and_iteration(folder):
    """``(root, iteration)`` of an iteration folder ``root/iter_<N>`` (None: not one)."""
    name = os.path.basename(os.path.normpath(folder))
    it = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
    return os.path.dirname(os.path.normpath(folder)), it


def check_files(folder):
    """Read the DCP index ``.metadata`` of ``folder`` and check that every file it names
    exists and holds the bytes it indexes; ValueError naming the first damaged file."""
    root, it = root_and_iteration(folder)
    index = os.path.join(folder, ".metadata")
    try:
        needed = faults.distcp_index(folder)
    except Exception as error:  # unpickling errors, or an object of another shape
        raise ValueError(f"checkpoint index {index} cannot be read, it is truncated or corrupted "
                         f"({faults.short_reason(error)}); "
                         f"{files.earlier(root, it)}") from error
    for name, end in sorted(needed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint file {path} (named in {index}) is missing; "
                             f"{files.earlier(root, it)}")
        size = os.path.getsize(path)
        if size < end:
            raise ValueError(f"checkpoint file {path} is {size} bytes but {index} indexes {end}: "
                             f"it is truncated; {files.earlier(root, it)}")


class AsyncSave:
    """One background save: a thread writing staged copies; :meth:`wait` re-raises its error."""

    def __init__(self, target):
        self.error = None

        def run():
            try:
                target()
            except BaseException as error:  # reported by wait() on the training thread
                self.error = error

        self.thread = threading.Thread(target=run, name="async-checkpoint-save", daemon=True)
        self.thread.start()

    def wait(self):
        self.thread.join()
        if self.error is not None:
            raise self.error


def write(train_state, ckpt, root, state, planner, rank0_files=None, before_commit=None):
    """Write ``state`` (what ``planner``, a DCP save planner class, takes) with DCP and this
    rank's RNG states (unless --no-save-rng) as iteration ``train_state.iteration`` under
    ``root``: into ``iter_N.tmp``, which becomes ``iter_N`` (the tracker last) once every rank
    has written, coordinated over the Checkpointer ``ckpt``'s group; in the background with
    ``--async-save`` (the state staged first), returning the :class:`AsyncSave` in flight
    (else None). ``rank0_files(tmp)`` writes rank 0's further files; ``before_commit(tmp)``
    runs on rank 0 once every rank has written."""
    st, checkpoint = train_state.parallel_state, ckpt.checkpoint
    # a background writer coordinates over a gloo group of its own: without gloo groups
    # (--disable-gloo-process-groups) the save is written before training goes on
    async_save = checkpoint.async_save and ckpt.parallel.use_gloo_process_groups
    rng = None if checkpoint.no_save_rng else training_state.rng_state(train_state)
    it = train_state.iteration
    tmp = files.iteration_dir(root, it) + ".tmp"
    group = ckpt.group()
    attempt = files.save_attempt(root, it, group)
    attempt.start()  # the ranks agree after each phase (where a barrier was)
    if async_save:
        state = {key: value.staged() if hasattr(value, "staged") else value
                 for key, value in state.items()}

    def write_files():
        dcp.save(state, storage_writer=faults.writer(tmp), planner=planner(), process_group=group)
        if rng is not None:
            files.atomic_torch_save(rng, os.path.join(tmp, "rng", f"rank_{st.global_rank:05d}.pt"))
        if st.global_rank == 0 and rank0_files is not None:
            rank0_files(tmp)

    def commit():  # every rank has written: only now may the tracker move
        if st.global_rank == 0:
            if before_commit is not None:
                before_commit(tmp)
            files.commit_checkpoint(root, it, checkpoint.save_retain_interval)

    def write_all():
        attempt.phase(write_files)
        attempt.phase(commit)

    if async_save:
        return AsyncSave(write_all)
    write_all()
    return None


def read_dcp(folder, state, planner, group):
    """DCP's load of ``state`` from the iteration folder ``folder`` with ``planner`` over
    ``group``; a damaged or unreadable file is a ValueError naming it."""
    root, it = root_and_iteration(folder)
    try:
        dcp.load(state, storage_reader=faults.reader(folder), planner=planner,
                 process_group=group)
    except (Exception, CheckpointException) as error:  # DCP gathers every rank's read error
        if training_faults.is_lost_contact(error):
            raise
        found = faults.find(error, faults.UnreadableFile)
        damage = (str(found[1]) if found else f"the tensors of checkpoint {folder} cannot be "
                  f"read ({faults.short_reason(error)})")
        raise ValueError(f"{damage}; {files.earlier(root, it)}") from error
