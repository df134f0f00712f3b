"""Our ``--ckpt-format torch_dist`` (the default): a trainer's state
(:mod:`megatron_cp.checkpoint.state`) saved with torch.distributed.checkpoint so that
``--load`` restores it under any TP / PP / CP / DP / EP / ETP layout, with or without the
distributed optimizer. This module knows no other format.

Layout of one iteration's folder::

    iter_0000020/.metadata            DCP's index: every tensor's global shape and chunks
    iter_0000020/__<rank>_0.distcp    the chunks each rank wrote (in parallel)
    iter_0000020/common.pt            iteration, samples, arguments, schedule, loss scale
    iter_0000020/rng/rank_00005.pt    every rank's RNG states (restored under the same layout)
    iter_0000020/integrity.json       with --verify-integrity: every file's SHA-256 (integrity.py)

Tensors are keyed by canonical name (:mod:`megatron_cp.checkpoint.canonical`):
``model.<name>`` holds the model weights, ``optimizer.exp_avg.<name>`` /
``optimizer.exp_avg_sq.<name>`` the Adam moments (``optimizer.momentum_buffer.<name>``
Muon's momentum) and ``optimizer.main_param.<name>`` the
fp32 main params of a bf16/fp16 model, each in the same canonical form as its weight, so
any layout reads back the same full tensors. Expert (MoE) params are stored whole, with the
global expert dimension first (``[E, ...]``); each rank writes its (EP slice, ETP slice),
and a persistent buffer (the router's ``expert_bias``) is stored like a replicated param.
Replicas (DP, CP, TP-replicated params; expert-DP and ETP-replicated expert params) give
DCP identical chunks, which it writes once; the tied output-layer copy of the last
pipeline stage is not saved (it loads from ``model.embedding.word_embeddings.weight``).

A save goes into ``iter_N.tmp`` and becomes ``iter_N`` (tracker file last) only when every
rank has written; with ``--async-save`` the state is first copied (the only time training
waits) and a background thread writes it, coordinated over a gloo group of its own. A failed
save (faults.SaveAttempt) removes its files and raises on every rank; in the
background, at the next save or at the end of training.

What a save writes (``--no-save-optim``, ``--no-save-rng``, ``--async-save``,
``--verify-integrity``, ``--save-retain-interval``) and what a load checks follow the
trainer's checkpoint section (``trainer.run.checkpoint``); ``common.pt`` saves
``trainer.args`` as the checkpoint's arguments.

A load first reads ``.metadata`` and checks that every file it indexes is there and long
enough (:func:`check_files`), so a truncated or corrupted file is a ValueError naming it (as
is one whose tensors cannot be decoded: DCP reads through faults.reader, which
names the file), never a raw DCP or unpickling traceback.

:func:`read_full` / :func:`write_full`: one process reads a whole checkpoint as full canonical
tensors, or writes one from them (``tools/checkpoint_convert.py``, and the tests that compare
checkpoints saved under different layouts); a checkpoint written so has one chunk per tensor,
which DCP reshards to any layout on load like any other.
"""
import os
import shutil
import threading
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_cp import faults as training_faults
from megatron_cp.checkpoint import faults, files, integrity, strictness
from megatron_cp.checkpoint import state as training_state
from megatron_cp.checkpoint.pieces import PiecesLoadPlanner, PiecesSavePlanner

COMMON = "common.pt"


def is_torch_dist(folder):
    """True if the iteration folder ``folder`` holds a torch_dist checkpoint."""
    return os.path.exists(os.path.join(folder, ".metadata"))


def _root_and_iteration(folder):
    name = os.path.basename(os.path.normpath(folder))
    it = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
    return os.path.dirname(os.path.normpath(folder)), it


def read_common(folder):
    """The common (non-tensor) state of the torch_dist checkpoint in ``folder`` (ValueError
    naming the file when it is missing, truncated or corrupted)."""
    root, it = _root_and_iteration(folder)
    return files.load_file(os.path.join(folder, COMMON), root, it,
                           keys=("iteration", "consumed_samples", "args", "has_optimizer"))


def check_files(folder):
    """Read the DCP index ``.metadata`` of ``folder`` and check that every file it names
    exists and holds the bytes it indexes; ValueError naming the first damaged file."""
    root, it = _root_and_iteration(folder)
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


def saved_keys(folder):
    """The tensor keys the checkpoint in ``folder`` holds (its DCP index)."""
    return set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)


def _say(trainer):
    def say(line):
        if trainer.state.global_rank == 0:
            print(f" {line}", flush=True)
    return say


def checkpoint_group(trainer):
    """A gloo group over every rank for checkpoint coordination (created once, collectively),
    so a background save never shares a communicator with training; the default group (None)
    under --disable-gloo-process-groups, which writes an --async-save synchronously."""
    if not trainer.run.parallel.use_gloo_process_groups:
        return None
    group = getattr(trainer, "_checkpoint_group", None)
    if group is None:
        group = dist.new_group(backend="gloo")
        trainer._checkpoint_group = group
    return group


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


def save(trainer, root):
    """Save ``trainer`` under ``root`` (every rank calls it) as its checkpoint section
    (``trainer.run.checkpoint``) says: in the background with ``--async-save``; see the
    module docstring."""
    st, checkpoint = trainer.state, trainer.run.checkpoint
    # a background writer coordinates over a gloo group of its own: without gloo groups
    # (--disable-gloo-process-groups) the save is written before training goes on
    async_save = checkpoint.async_save and trainer.run.parallel.use_gloo_process_groups
    training_state.wait_for_async_save(trainer)
    trainer.optimizer.finish_param_sync()
    with_optimizer = not checkpoint.no_save_optim
    state = training_state.sharded_state(trainer, with_optimizer)
    common = {**training_state.common(trainer, with_optimizer), "ckpt_format": "torch_dist"}
    rng = None if checkpoint.no_save_rng else training_state.rng_state(trainer)
    it = trainer.iteration
    tmp = files.iteration_dir(root, it) + ".tmp"
    group = checkpoint_group(trainer)
    attempt = files.save_attempt(root, it, group)
    attempt.start()  # the ranks agree after each phase (where a barrier was)
    if async_save:
        state = {key: pieces.staged() for key, pieces in state.items()}

    def write_files():
        dcp.save(state, storage_writer=faults.writer(tmp),
                 planner=PiecesSavePlanner(), process_group=group)
        if rng is not None:
            files.atomic_torch_save(rng, os.path.join(tmp, "rng", f"rank_{st.global_rank:05d}.pt"))
        if st.global_rank == 0:
            files.atomic_torch_save(common, os.path.join(tmp, COMMON))

    def commit():  # every rank has written: only now may the tracker move
        if st.global_rank == 0:
            if checkpoint.verify_integrity:
                integrity.write_manifest(tmp)
            files.commit_checkpoint(root, it, checkpoint.save_retain_interval)

    def write():
        attempt.phase(write_files)
        attempt.phase(commit)

    if async_save:
        trainer.pending_save = AsyncSave(write)
    else:
        write()


def load(trainer, root, it):
    """Load the torch_dist checkpoint of iteration ``it`` under ``root`` into ``trainer``,
    whatever layout saved it, as its checkpoint section (``trainer.run.checkpoint``) says;
    returns (iteration, consumed samples)."""
    folder = files.iteration_dir(root, it)
    if trainer.run.checkpoint.verify_integrity:  # before a byte of it is read
        integrity.verify(folder, checkpoint_group(trainer), files.earlier(root, it))
    common = read_common(folder)

    def read(state):
        check_files(folder)
        state = strictness.apply(trainer.run.checkpoint.dist_ckpt_strictness, state,
                                 saved_keys(folder), folder, _say(trainer),
                                 checkpoint_group(trainer))
        try:
            dcp.load(state, storage_reader=faults.reader(folder),
                     planner=PiecesLoadPlanner(), process_group=checkpoint_group(trainer))
        except (Exception, CheckpointException) as error:  # DCP gathers every rank's read error
            if training_faults.is_lost_contact(error):
                raise
            found = faults.find(error, faults.UnreadableFile)
            damage = (str(found[1]) if found else f"the tensors of checkpoint {folder} cannot be "
                      f"read ({faults.short_reason(error)})")
            raise ValueError(f"{damage}; {files.earlier(root, it)}") from error

    return training_state.restore(trainer, root, it, common, read)


# --- one process, whole tensors -----------------------------------------------------------

def read_full(folder):
    """``({key: full tensor}, common)`` of the torch_dist checkpoint in the iteration
    folder ``folder`` (keys ``model.<name>``, ``optimizer.<kind>.<name>``)."""
    reader = dcp.FileSystemReader(folder)
    metadata = reader.read_metadata()
    tensors = {key: torch.empty(md.size, dtype=md.properties.dtype)
               for key, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader,
                 planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
    return tensors, read_common(folder)


def write_full(folder, tensors, common, rng_from=None):
    """Write ``tensors`` (full canonical tensors by key) and ``common`` as a torch_dist
    iteration folder ``folder`` (replaced if it exists); ``rng_from``: an iteration folder
    whose ``rng/`` states to copy along."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({k: v.contiguous() for k, v in tensors.items()},
                 storage_writer=dcp.FileSystemWriter(folder),
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
    if rng_from and os.path.isdir(os.path.join(rng_from, "rng")):
        shutil.copytree(os.path.join(rng_from, "rng"), os.path.join(folder, "rng"))
    torch.save({**common, "ckpt_format": "torch_dist"}, os.path.join(folder, COMMON))
