"""How a save picks its format, and how a load picks the format and the layout: the one place.

A save writes ``--ckpt-format``: ``torch_dist`` (the default, as in Megatron-LM; with
``--async-save`` in the background), ``fsdp_dtensor`` (Megatron-FSDP's layout) or ``torch``.

A load reads whatever ``--load`` holds, whatever ``--ckpt-format`` says, into the layout this
run was started in:

1. the iteration: ``--ckpt-step``, else the tracker's (none: start from scratch);
2. the format, told by the iteration folder: Megatron-LM's own (its ``metadata.json``),
   ``fsdp_dtensor`` (a DCP ``.metadata`` holding ``checkpoint_version``; ours or Megatron-LM's),
   ours ``torch_dist`` (a DCP ``.metadata``), else ours ``torch`` (``mp_rank_*`` files);
3. the layout: ``torch_dist`` and Megatron-LM's load into any layout (each rank reads its
   boxes of the canonical tensors); a ``torch`` checkpoint saved in this run's layout is read
   file by file, each rank its own (a bit-exact resume), and one of another layout is read
   whole by every rank, which takes its own pieces (resharded on load).

What is saved and loaded is a :class:`~megatron_cp.checkpoint.train_state.TrainState`
(``train_state``); every decision here and in the formats is read from the
:class:`~megatron_cp.checkpoint.checkpointer.Checkpointer` (``ckpt``) and its sections: the
checkpoint section (``ckpt.checkpoint``: where, the format, what to load, async, integrity,
the retain interval, ``--finetune``, ``--no-load-*``), the parallel layout (``ckpt.parallel``)
and the optimizer's (``ckpt.optimizer_config``), with the model's config from the TrainState.
``train_state.args``, Megatron-LM's flat argument namespace, is only what a checkpoint saves as
its arguments (part of the on-disk format, which Megatron-LM and our tools read), and so what a
load compares a checkpoint's saved arguments with for the model's shape, name for name.

The Checkpointer calls :func:`save` and :func:`load`; the formats live in their own modules and
know nothing of each other, of this one or of the Checkpointer's module.
"""
import dataclasses
import os

from megatron_cp.checkpoint import files, fsdp_dtensor_format, megatron_lm_format, megatron_lm_load
from megatron_cp.checkpoint import torch_dist_format, torch_format
from megatron_cp.checkpoint.state import saved_arguments
from megatron_cp.checkpoint.torch_shards import first_file


def save(train_state, ckpt, root):
    """Save ``train_state`` under ``root`` in ``ckpt``'s ``--ckpt-format``; returns the
    background save in flight (``--async-save``; the Checkpointer keeps it) or None."""
    fmt = ckpt.checkpoint.ckpt_format
    if fmt == "torch_dist":
        return torch_dist_format.save(train_state, ckpt, root)
    if fmt == "fsdp_dtensor":
        return fsdp_dtensor_format.save(train_state, ckpt, root)
    torch_format.save(train_state, ckpt, root)
    return None


def weights_only(checkpoint):
    """The checkpoint section ``checkpoint`` (a CheckpointConfig) that loads a model's weights
    and nothing else: no optimizer, schedule, RNG, iteration or samples (a model for
    inference)."""
    return dataclasses.replace(checkpoint, finetune=True, no_load_optim=True, no_load_rng=True)


def load(train_state, ckpt, root):
    """Load the latest checkpoint under ``root`` (``--ckpt-step``'s iteration when given)
    into ``train_state``, whatever its format and parallel layout (the module docstring), as
    ``ckpt.checkpoint`` says; returns (iteration, consumed samples)."""
    st, checkpoint = train_state.parallel_state, ckpt.checkpoint
    it = files.load_iteration(root, checkpoint.ckpt_step)
    if it is None:
        if checkpoint.exit_on_missing_checkpoint:
            raise ValueError(f"--exit-on-missing-checkpoint: no checkpoint under --load {root} "
                             f"(no {files.TRACKER}); check the path, or drop the flag to start "
                             f"fresh")
        if st.global_rank == 0:
            print(f" no checkpoint under {root} (no {files.TRACKER}); starting from scratch",
                  flush=True)
        return 0, 0
    folder = files.iteration_dir(root, it)
    if megatron_lm_format.is_megatron_lm(folder):  # written by Megatron-LM itself
        return megatron_lm_load.load(train_state, ckpt, root, it)
    if fsdp_dtensor_format.is_fsdp_dtensor(folder):  # Megatron-FSDP's layout, ours or its own
        return fsdp_dtensor_format.load(train_state, ckpt, root, it)
    if torch_dist_format.is_torch_dist(folder):
        return torch_dist_format.load(train_state, ckpt, root, it)
    return _load_torch(train_state, ckpt, root, it)


def _load_torch(train_state, ckpt, root, it):
    """A ``torch`` checkpoint: each rank its own file when the saved layout spread the model
    over the files as this run does (``ckpt.parallel``), else every rank reads it whole and
    reshards."""
    st = train_state.parallel_state
    if ckpt.checkpoint.verify_integrity and st.global_rank == 0:
        print(f" --verify-integrity: the checkpoint under {root} is --ckpt-format torch, which "
              f"has no integrity manifest (Megatron-LM hashes torch_dist checkpoints only); "
              f"loading it unverified", flush=True)
    # this rank's file, or a namesake of another layout's
    payload = torch_format.read_own_file(train_state, ckpt, root, it)
    saved = payload["args"] if payload is not None else torch_format.saved_args(root, it)
    files.check_args_match(saved, saved_arguments(train_state.args))
    same_layout = files.same_model_layout(saved, ckpt.parallel)
    if payload is None and same_layout:
        raise ValueError(f"checkpoint file {torch_format.own_file(train_state, ckpt, root, it)} "
                         f"is missing (the same layout saved it: the copy is incomplete); "
                         f"{files.earlier(root, it)}")
    if payload is None or not same_layout:
        if st.global_rank == 0:
            print(f" the torch checkpoint under {root} was saved under another parallel layout: "
                  f"every rank reads it whole and takes its own shards", flush=True)
        return torch_format.load_resharded(train_state, ckpt, root, it)
    return torch_format.load_own_file(train_state, ckpt, root, it, payload)


def args_file(root, step=None):
    """Path of the file that holds the arguments of the latest checkpoint under ``root``
    (of iteration ``step`` when given: ``--ckpt-step``): a torch_dist checkpoint's (ours or
    Megatron-LM's) ``common.pt``, a torch one's (TP 0, PP 0) file; None if there is none."""
    it = files.load_iteration(root, step)
    if it is None:
        return None
    folder = files.iteration_dir(root, it)
    if torch_dist_format.is_torch_dist(folder):
        return os.path.join(folder, torch_dist_format.COMMON)
    return first_file(folder)


def saved_args(root, step=None):
    """The arguments the latest checkpoint under ``root`` (iteration ``step`` when given) was
    saved with (a dict; for one Megatron-LM wrote, its Namespace in our names). Argument
    parsing calls it (``--use-checkpoint-args``, before any section exists), so it takes
    ``--load`` and ``--ckpt-step`` as values."""
    it = files.load_iteration(root, step)
    if it is not None and fsdp_dtensor_format.is_fsdp_dtensor(files.iteration_dir(root, it)):
        return fsdp_dtensor_format.saved_args(files.iteration_dir(root, it))
    if it is not None and megatron_lm_format.is_megatron_lm(files.iteration_dir(root, it)):
        return megatron_lm_format.our_args(
            megatron_lm_format.read_common(files.iteration_dir(root, it))["args"])
    path = args_file(root, step)
    if path is None:
        raise ValueError(f"no checkpoint under {root} (no {files.TRACKER}); train one first, or "
                         f"drop --use-checkpoint-args and give the model flags")
    # a torch checkpoint's arguments share a file with its weights and optimizer state:
    # mapped, not read
    return files.load_file(path, root, it, keys=("args",), mmap=True)["args"]
