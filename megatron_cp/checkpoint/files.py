"""The on-disk basics every checkpoint format shares; this module knows no format.

Every format keeps Megatron-LM's folder layout::

    <dir>/latest_checkpointed_iteration.txt    "20": the tracker, names the latest iteration
    <dir>/iter_0000020/...                     one folder per saved iteration
    <dir>/iter_0000020/rng/rank_00005.pt       every rank's RNG states (our formats)

A save writes into ``iter_N.tmp`` and renames it to ``iter_N`` only when every rank has
written (:func:`commit_checkpoint`); the tracker file is replaced last. A crash mid-save leaves
the previous checkpoint and tracker untouched; a save that fails (a full disk, a lost rank)
also removes its partial files and stops every rank with one line (:func:`save_attempt`,
:mod:`megatron_cp.checkpoint.faults`).

Every file a load reads goes through :func:`load_file` / :func:`read_tracker`: a truncated or
corrupted file (or a tracker naming a missing iteration) is a ValueError naming the file and
the way out (:func:`earlier`: the latest good iteration, to load with ``--ckpt-step``), never
an unpickling or zip traceback.

And the two rules on saved arguments every format applies: the model's shape must match
(:func:`check_args_match`, :data:`SHAPE_ARGS`); the parallel layout need not, and
:func:`rank_grid` says where a run put every rank (RNG states follow only onto the same grid).
A checkpoint's saved arguments are part of the on-disk format (Megatron-LM's flat argument
names), so these rules read them as dicts; the running side of a comparison is the run's
parallel section (:class:`~megatron_cp.config.parallel.ParallelConfig`), or, for the model's
shape, the arguments the run itself saves.
"""
import os
import re
import shutil

import torch

from megatron_cp.checkpoint import faults
from megatron_cp.config.setting import checkpoint_args
from megatron_cp.config.parallel import DP_OUTER_RANK_ORDER
from megatron_cp.config.model import GPTConfig

TRACKER = "latest_checkpointed_iteration.txt"
# Arguments that shape the saved tensors: a checkpoint loads only into a model with the same
# (the GPTConfig fields marked ``shapes``, params_dtype among them).
SHAPE_ARGS = checkpoint_args(GPTConfig)
# Arguments that spread the layers and their shards over the model-parallel ranks (and so
# over the torch format's files): when they differ from the running ones, a torch checkpoint
# is resharded on load.
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers", "num_virtual_stages_per_pipeline_rank",
               "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
               "account_for_loss_in_pipeline_split", "expert_model_parallel_size",
               "expert_tensor_parallel_size")
EXPERT_LAYOUT_ARGS = ("expert_model_parallel_size", "expert_tensor_parallel_size")
# ... and the rest of the rank grid: each rank's RNG states are restored only when all of
# these are the same (the RNG files are per global rank).
RANK_LAYOUT_ARGS = ("world_size", "context_parallel_size", *LAYOUT_ARGS, "rank_order")


# --- folders and the tracker -------------------------------------------------------------

def iteration_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_iterations(root):
    """The iterations that have a committed folder ``iter_NNNNNNN`` under ``root`` (sorted)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(name[5:]) for name in os.listdir(root) if re.fullmatch(r"iter_\d{7}", name))


def read_tracker(root):
    """The latest iteration saved under ``root`` (None if there is none); ValueError when the
    tracker file is not an iteration number or names an iteration with no folder."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        text = f.read(64).decode("utf-8", errors="replace").strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint tracker {path} holds {text!r}, not an iteration number "
                         f"(truncated or corrupted); {earlier(root, None)}")
    it = int(text)
    if not os.path.isdir(iteration_dir(root, it)):
        raise ValueError(f"checkpoint tracker {path} names iteration {it} but "
                         f"{iteration_dir(root, it)} does not exist; {earlier(root, it)}")
    return it


def load_iteration(root, step=None):
    """The iteration a load reads under ``root``: ``step`` (Megatron's ``--ckpt-step``; None
    or 0: not given) when given, else the tracker's (None: no checkpoint there)."""
    if not step:
        return read_tracker(root)
    if not os.path.isdir(iteration_dir(root, step)):
        saved = ", ".join(map(str, saved_iterations(root))) or "none"
        raise ValueError(f"--ckpt-step {step}: {iteration_dir(root, step)} does not exist "
                         f"(saved iterations under {root}: {saved}); give one of them")
    return step


# --- writing: atomic files, the commit, a save's fault handling ---------------------------

def atomic_torch_save(obj, path):
    """``torch.save`` into ``path.partial``, synced, then renamed to ``path``."""
    partial = path + ".partial"
    with faults.naming(partial):  # torch.save reports ENOSPC without the file
        with open(partial, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    os.replace(partial, path)


def _write_synced(path, text):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path, text):
    """Write ``text`` to ``path`` through a synced ``path.partial`` and a rename."""
    _write_synced(path + ".partial", text)
    os.replace(path + ".partial", path)


def save_attempt(root, it, group=None):
    """The :class:`~megatron_cp.checkpoint.faults.SaveAttempt` of iteration ``it`` under
    ``root`` (the files it may leave behind; the tracker it keeps)."""
    return faults.SaveAttempt(root, it, iteration_dir(root, it) + ".tmp",
                              os.path.join(root, TRACKER) + ".partial",
                              lambda: read_tracker(root), group)


def commit_checkpoint(root, it, retain_interval=None):
    """Rename ``iter_N.tmp`` to ``iter_N`` (keeping an older ``iter_N`` until the swap), then
    point the tracker at it: the last step of every save, run by one rank after all wrote.

    ``retain_interval`` (Megatron's ``--save-retain-interval``): once the tracker points at
    the new checkpoint, the one it pointed at before is deleted unless its iteration is a
    multiple of the interval (or a symbolic link), so the latest checkpoint and every
    retained one remain."""
    previous = None
    if retain_interval and os.path.isfile(os.path.join(root, TRACKER)):
        with open(os.path.join(root, TRACKER)) as file:
            text = file.read().strip()
        previous = int(text) if text.isdigit() else None
    final = iteration_dir(root, it)
    tmp = final + ".tmp"
    tracker = os.path.join(root, TRACKER)
    _write_synced(tracker + ".partial", str(it))  # the one write: before anything moves
    if os.path.exists(final):  # re-saving an iteration: keep the old copy until the swap
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    os.replace(tracker + ".partial", tracker)
    print(f" saved checkpoint at iteration {it} to {root}", flush=True)
    if previous is not None and previous != it and previous % retain_interval != 0:
        old = iteration_dir(root, previous)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
            print(f" deleted checkpoint at iteration {previous} (--save-retain-interval "
                  f"{retain_interval} keeps multiples of it and the latest)", flush=True)


# --- reading, with one line per damaged file ---------------------------------------------

def earlier(root, it):
    """How to resume from another checkpoint than iteration ``it``: one sentence naming the
    newest other iteration that looks whole (faults.latest_intact)."""
    others = {i: iteration_dir(root, i) for i in saved_iterations(root) if i != it}
    good = faults.latest_intact(others)
    if good is None:
        return (f"there is no other intact checkpoint under {root}: restore the file from a "
                f"copy, or start again without --load")
    return (f"iteration {good} is the latest good one: load it with --ckpt-step {good} (or "
            f"restore the file from a copy)")


def load_file(path, root, it, map_location="cpu", keys=(), mmap=False):
    """``torch.load(path)`` of a checkpoint file of iteration ``it`` under ``root``; a
    missing, truncated or corrupted file, or one without ``keys``, is a ValueError naming it.
    ``mmap``: map the tensors' storages instead of reading them (for a caller that only
    wants the file's small entries, such as its arguments)."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {path} is missing (a partial copy, or saved on "
                         f"another number of ranks?); {earlier(root, it)}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as error:  # unpickling, zip, EOF and storage errors: the file is damaged
        raise ValueError(f"checkpoint file {path} cannot be read, it is truncated or corrupted "
                         f"({faults.short_reason(error)}); {earlier(root, it)}") from error
    missing = [k for k in keys if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise ValueError(f"checkpoint file {path} has no {', '.join(missing)}: not a megatron_cp "
                         f"checkpoint file, or a corrupted one; {earlier(root, it)}")
    return payload


# --- the rules on saved arguments --------------------------------------------------------

def check_args_match(saved, current):
    """Refuse a checkpoint whose model shape (:data:`SHAPE_ARGS`) differs from this run's,
    naming every mismatch. ``saved``: the checkpoint's arguments; ``current``: the arguments
    this run's checkpoints save (:func:`megatron_cp.checkpoint.state.saved_arguments`), so
    both sides are compared as the on-disk format names and writes them (the dtype by name).
    The parallel layout never has to match: a torch_dist checkpoint loads into any layout, a
    torch one is resharded."""
    differ = [k for k in SHAPE_ARGS if k in saved and saved.get(k) != current.get(k)]
    if differ:
        diffs = "; ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
                          for k in differ)
        raise ValueError(f"checkpoint was saved with other model arguments: {diffs}. Give "
                         f"the model's own arguments, or take them from it with "
                         f"--use-checkpoint-args")


def same_model_layout(saved, parallel):
    """True when ``saved`` (a checkpoint's args) spread the layers and their shards over the
    model-parallel ranks as this run does (``parallel``: its ParallelConfig;
    :data:`LAYOUT_ARGS`, its field names; a dense model has no expert layout), so each rank's
    pieces are where this run expects them."""
    skip = () if saved.get("num_experts") else EXPERT_LAYOUT_ARGS
    return all(saved.get(k) == getattr(parallel, k) for k in LAYOUT_ARGS if k not in skip)


def rank_grid(layout):
    """Where ``layout`` put every rank: the values of :data:`RANK_LAYOUT_ARGS` of a running
    ParallelConfig (they are its field names), or of a checkpoint's saved arguments (a dict:
    saved data, read as the file format names it; a key it lacks reads None). The rank order
    counts only when it moves ranks (PP > 1 and DP > 1); checkpoints that predate the setting
    were saved with data parallel outermost."""
    if isinstance(layout, dict):
        grid = {k: layout.get(k) for k in RANK_LAYOUT_ARGS}
    else:
        grid = {k: getattr(layout, k) for k in RANK_LAYOUT_ARGS}
    model = ((grid["tensor_model_parallel_size"] or 1) * (grid["context_parallel_size"] or 1)
             * (grid["pipeline_model_parallel_size"] or 1))
    dp = (grid["world_size"] or model) // model
    moves = (grid["pipeline_model_parallel_size"] or 1) > 1 and dp > 1
    grid["rank_order"] = (grid["rank_order"] or DP_OUTER_RANK_ORDER) if moves else None
    return grid
