"""Our ``--ckpt-format torch_dist`` (the default): a TrainState
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
waits) and a background thread writes it, coordinated over a gloo group of its own (the
Checkpointer's, which keeps the save in flight). A failed
save (faults.SaveAttempt) removes its files and raises on every rank; in the
background, at the next save or at the end of training.

What a save writes (``--no-save-optim``, ``--no-save-rng``, ``--async-save``,
``--verify-integrity``, ``--save-retain-interval``) and what a load checks follow the
Checkpointer's checkpoint section (``ckpt.checkpoint``); ``common.pt`` saves
``train_state.args`` as the checkpoint's arguments.

A load first reads ``.metadata`` and checks that every file it indexes is there and long
enough (:func:`~megatron_cp.checkpoint.dcp_files.check_files`), so a truncated or corrupted file is a ValueError naming it (as
is one whose tensors cannot be decoded: DCP reads through faults.reader, which
names the file), never a raw DCP or unpickling traceback.

:func:`read_full` / :func:`write_full`: one process reads a whole checkpoint as full canonical
tensors, or writes one from them (``tools/checkpoint_convert.py``, and the tests that compare
checkpoints saved under different layouts); a checkpoint written so has one chunk per tensor,
which DCP reshards to any layout on load like any other.
"""
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_cp.checkpoint import dcp_files, files, integrity, strictness
from megatron_cp.checkpoint import state as training_state
from megatron_cp.checkpoint.pieces import PiecesLoadPlanner, PiecesSavePlanner

COMMON = "common.pt"


def is_torch_dist(folder):
    """True if the iteration folder ``folder`` holds a torch_dist checkpoint."""
    return os.path.exists(os.path.join(folder, ".metadata"))


def read_common(folder):
    """The common (non-tensor) state of the torch_dist checkpoint in ``folder`` (ValueError
    naming the file when it is missing, truncated or corrupted)."""
    root, it = dcp_files.root_and_iteration(folder)
    return files.load_file(os.path.join(folder, COMMON), root, it,
                           keys=("iteration", "consumed_samples", "args", "has_optimizer"))


def saved_keys(folder):
    """The tensor keys the checkpoint in ``folder`` holds (its DCP index)."""
    return set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)


def save(train_state, ckpt, root):
    """Save ``train_state`` under ``root`` (every rank calls it) as the checkpoint section
    (``ckpt.checkpoint``) says: in the background with ``--async-save`` (returns the save in
    flight, else None); see the module docstring."""
    checkpoint = ckpt.checkpoint
    train_state.optimizer.finish_param_sync()
    with_optimizer = not checkpoint.no_save_optim
    state = training_state.sharded_state(train_state, with_optimizer)
    common = {**training_state.common(train_state, ckpt, with_optimizer),
              "ckpt_format": "torch_dist"}

    def common_file(tmp):
        files.atomic_torch_save(common, os.path.join(tmp, COMMON))

    def manifest(tmp):
        if checkpoint.verify_integrity:
            integrity.write_manifest(tmp)

    return dcp_files.write(train_state, ckpt, root, state, PiecesSavePlanner, common_file,
                           manifest)


def load(train_state, ckpt, root, it):
    """Load the torch_dist checkpoint of iteration ``it`` under ``root`` into ``train_state``,
    whatever layout saved it, as the checkpoint section (``ckpt.checkpoint``) says;
    returns (iteration, consumed samples)."""
    folder = files.iteration_dir(root, it)
    if ckpt.checkpoint.verify_integrity:  # before a byte of it is read
        integrity.verify(folder, ckpt.group(), files.earlier(root, it))
    common = read_common(folder)

    def read(state):
        dcp_files.check_files(folder)
        state = strictness.apply(ckpt.checkpoint.dist_ckpt_strictness, state,
                                 lambda: saved_keys(folder), folder,
                                 training_state.say_on_rank0(train_state), ckpt.group())
        dcp_files.read_dcp(folder, state, PiecesLoadPlanner(), ckpt.group())

    return training_state.restore(train_state, ckpt, root, it, common, read)


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
