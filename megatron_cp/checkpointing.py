"""Checkpoints: saved atomically, resumed exactly; ``--ckpt-format torch`` here, and the
dispatch to ``--ckpt-format torch_dist`` (:mod:`megatron_cp.dist_checkpoint`), which loads
into any parallel layout. ``--load`` reads either format, whatever ``--ckpt-format`` says.

The torch format has one shard per model-parallel rank (Megatron's layout)::

    <dir>/latest_checkpointed_iteration.txt          "20"
    <dir>/iter_0000020/mp_rank_00/model_optim_rng.pt         (PP = 1)
    <dir>/iter_0000020/mp_rank_01_003/model_optim_rng.pt     (TP rank 1, PP rank 3)
    <dir>/iter_0000020/rng/rank_00005.pt                     (every rank's RNG states)

A save writes into ``iter_N.tmp`` and renames it to ``iter_N`` only when every rank has
written; the tracker file is replaced last. A crash mid-save leaves the previous checkpoint
and tracker untouched. Shards are written by the DP rank 0, CP rank 0 replica of each
model-parallel rank (the others hold identical weights and optimizer states); with the
distributed optimizer its shards are gathered to that rank first, so the file is the same
with or without it and loads into either.

Every file a load reads goes through :func:`load_file` / :func:`read_tracker`: a truncated or
corrupted file (or a tracker naming a missing iteration) is a ValueError naming the file and
the way out (an earlier checkpoint, listed), never an unpickling or zip traceback.
"""
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp import device as device_mod
from megatron_cp.config_flags import checkpoint_args
from megatron_cp.model.config import GPTConfig

TRACKER = "latest_checkpointed_iteration.txt"
# Arguments that change the shape or layout of the saved tensors: must match to resume. The
# model's are the GPTConfig fields marked ``shapes`` (params_dtype among them); the layout's
# are how the layers and their shards are spread over the files.
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers")
MODEL_ONLY_ARGS = checkpoint_args(GPTConfig)
MODEL_ARGS = MODEL_ONLY_ARGS + LAYOUT_ARGS


def iteration_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def shard_name(tp_rank, pp_rank, pp_size):
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _atomic_torch_save(obj, path):
    partial = path + ".partial"
    with open(partial, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _atomic_write_text(path, text):
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


RNG_KEYS = ("python", "numpy", "torch", "device", "tracker")


def _rng_state(trainer):
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "device": device_mod.rng_state(trainer.device),
            "tracker": trainer.model_chunks[0].module.rng_tracker.get_states()}


def _model_states(trainer):
    chunks = [c.module if hasattr(c, "module") else c for c in trainer.model_chunks]
    # the global layer numbers of each chunk let tools/checkpoint_convert.py reshard
    layers = {"layer_numbers": [list(c.decoder.layer_numbers) for c in chunks]}
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict(), **layers}
    return {**{f"model{i}": c.state_dict() for i, c in enumerate(chunks)}, **layers}


def save_checkpoint(trainer, root):
    """Save model, optimizer, scheduler, RNG, consumed samples and arguments atomically,
    in ``--ckpt-format`` (with ``--async-save``, torch_dist, in the background)."""
    args = trainer.args
    if getattr(args, "ckpt_format", "torch") == "torch_dist":
        from megatron_cp.dist_checkpoint import torch_dist
        return torch_dist.save(trainer, root, async_save=getattr(args, "async_save", False))
    st, it = trainer.state, trainer.iteration
    final = iteration_dir(root, it)
    tmp = final + ".tmp"
    trainer.optimizer.finish_param_sync()
    # a collective with the distributed optimizer (its shards are gathered): every rank
    optimizer_state = None if getattr(args, "no_save_optim", False) else trainer.optimizer.state_dict()
    if st.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    dist.barrier()
    if st.rank("dp") == 0 and st.rank("cp") == 0:
        shard = os.path.join(tmp, shard_name(st.rank("tp"), st.rank("pp"), st.size("pp")))
        os.makedirs(shard, exist_ok=True)
        args = {k: v for k, v in vars(trainer.args).items() if _plain(v)}
        args["params_dtype"] = str(trainer.args.params_dtype)
        payload = {"iteration": it, "consumed_samples": trainer.consumed_samples, "args": args,
                   "opt_param_scheduler": trainer.scheduler.state_dict(),
                   "checkpoint_version": 3.0, **_model_states(trainer)}
        if optimizer_state is not None:
            payload["optimizer"] = optimizer_state
        else:
            payload["converted"] = True  # weights only: the schedule resumes, Adam starts fresh
        _atomic_torch_save(payload, os.path.join(shard, "model_optim_rng.pt"))
    _atomic_torch_save(_rng_state(trainer), os.path.join(tmp, "rng", f"rank_{st.global_rank:05d}.pt"))
    dist.barrier()
    if st.global_rank == 0:
        commit_checkpoint(root, it)
    dist.barrier()


def commit_checkpoint(root, it):
    """Rename ``iter_N.tmp`` to ``iter_N`` (keeping an older ``iter_N`` until the swap), then
    point the tracker at it: the last step of every save, run by one rank after all wrote."""
    final = iteration_dir(root, it)
    tmp = final + ".tmp"
    if os.path.exists(final):  # re-saving an iteration: keep the old copy until the swap
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _atomic_write_text(os.path.join(root, TRACKER), str(it))
    print(f" saved checkpoint at iteration {it} to {root}", flush=True)


def wait_for_async_save(trainer):
    """Block until a background (``--async-save``) save has written and committed."""
    from megatron_cp.dist_checkpoint import torch_dist
    torch_dist.wait_for_async_save(trainer)


def resume_schedule_only(trainer, root, it, iteration, consumed_samples):
    """After loading weights only (a converted checkpoint, or one saved with
    ``--no-save-optim``): the optimizer and RNG start fresh, but the learning-rate schedule
    goes on at the saved iteration (one step per iteration), as the iteration count does,
    instead of warming up again. Returns (iteration, consumed samples)."""
    trainer.scheduler.num_steps = 0
    trainer.scheduler.step(iteration)
    if trainer.state.global_rank == 0:
        print(f" loaded weights only from {root} at iteration {it}: optimizer and RNG "
              f"start fresh, the learning-rate schedule resumes at iteration {iteration}",
              flush=True)
    return iteration, consumed_samples


def _plain(value):
    return isinstance(value, (int, float, str, bool, type(None), list, tuple))


def saved_iterations(root):
    """The iterations that have a committed folder ``iter_NNNNNNN`` under ``root`` (sorted)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(name[5:]) for name in os.listdir(root) if re.fullmatch(r"iter_\d{7}", name))


def _earlier(root, it):
    """How to resume from another checkpoint than iteration ``it``: one sentence."""
    others = [i for i in saved_iterations(root) if i != it]
    tracker = os.path.join(root, TRACKER)
    if not others:
        return (f"there is no other checkpoint under {root}: restore the file from a copy, or "
                f"start again without --load")
    return (f"restore the file from a copy, or resume from another checkpoint by writing its "
            f"iteration (saved: {', '.join(map(str, others))}) into {tracker}")


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
                         f"(truncated or corrupted); {_earlier(root, None)}")
    it = int(text)
    if not os.path.isdir(iteration_dir(root, it)):
        raise ValueError(f"checkpoint tracker {path} names iteration {it} but "
                         f"{iteration_dir(root, it)} does not exist; {_earlier(root, it)}")
    return it


def load_file(path, root, it, map_location="cpu", keys=()):
    """``torch.load(path)`` of a checkpoint file of iteration ``it`` under ``root``; a
    missing, truncated or corrupted file, or one without ``keys``, is a ValueError naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {path} is missing (a partial copy, or saved on "
                         f"another number of ranks?); {_earlier(root, it)}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as error:  # unpickling, zip, EOF and storage errors: the file is damaged
        reason = " ".join(str(error).split())[:160] or type(error).__name__
        raise ValueError(f"checkpoint file {path} cannot be read, it is truncated or corrupted "
                         f"({type(error).__name__}: {reason}); {_earlier(root, it)}") from error
    missing = [k for k in keys if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise ValueError(f"checkpoint file {path} has no {', '.join(missing)}: not a megatron_cp "
                         f"checkpoint file, or a corrupted one; {_earlier(root, it)}")
    return payload


def latest_first_shard(root):
    """Path of the (TP 0, PP 0) shard of the latest checkpoint under ``root`` (None if none;
    for a torch_dist checkpoint its ``common.pt``)."""
    it = read_tracker(root)
    if it is None:
        return None
    folder = iteration_dir(root, it)
    if os.path.exists(os.path.join(folder, ".metadata")):
        return os.path.join(folder, "common.pt")
    for pp_size in (1, 2):  # mp_rank_00 without PP, mp_rank_00_000 with
        path = os.path.join(folder, shard_name(0, 0, pp_size), "model_optim_rng.pt")
        if os.path.exists(path):
            return path
    raise ValueError(f"{folder} holds no mp_rank_00 shard: not a megatron_cp checkpoint, or a "
                     f"partial copy of one")


def saved_args(root):
    """The arguments the latest checkpoint under ``root`` was saved with (a dict)."""
    path = latest_first_shard(root)
    if path is None:
        raise ValueError(f"no checkpoint under {root} (no {TRACKER}); train one first, or drop "
                         f"--use-checkpoint-args and give the model flags")
    return load_file(path, root, read_tracker(root), keys=("args",))["args"]


def check_args_match(saved, args, names=MODEL_ARGS):
    """Refuse a checkpoint whose model arguments (``names``) differ, naming every mismatch."""
    current = dict(vars(args), params_dtype=str(args.params_dtype))
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
             for k in names if k in saved and saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError("checkpoint was saved with other model arguments: " + "; ".join(diffs) +
                         ". Use the same arguments, or convert it with tools/checkpoint_convert.py")


def load_checkpoint(trainer, root):
    """Load the latest checkpoint under ``root`` into ``trainer``; returns (iteration, consumed)."""
    st, args = trainer.state, trainer.args
    it = read_tracker(root)
    if it is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise ValueError(f"--exit-on-missing-checkpoint: no checkpoint under --load {root} "
                             f"(no {TRACKER}); check the path, or drop the flag to start fresh")
        if st.global_rank == 0:
            print(f" no checkpoint under {root} (no {TRACKER}); starting from scratch", flush=True)
        return 0, 0
    if os.path.exists(os.path.join(iteration_dir(root, it), ".metadata")):
        from megatron_cp.dist_checkpoint import torch_dist
        return torch_dist.load(trainer, root, it)
    path = os.path.join(iteration_dir(root, it), shard_name(st.rank("tp"), st.rank("pp"),
                                                            st.size("pp")), "model_optim_rng.pt")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint shard {path} is missing: was it saved with another TP/PP "
                         f"layout? Convert it with tools/checkpoint_convert.py")
    payload = load_file(path, root, it, trainer.device,
                        keys=("args", "iteration", "consumed_samples"))
    check_args_match(payload["args"], args)
    chunks = [c.module if hasattr(c, "module") else c for c in trainer.model_chunks]
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(payload["model"] if len(chunks) == 1 else payload[f"model{i}"])
    trainer.optimizer.reload_model_params()  # fp32 main params follow the loaded weights
    if args.finetune:
        return 0, 0
    if payload.get("converted") or "opt_param_scheduler" not in payload:
        return resume_schedule_only(trainer, root, it, payload["iteration"],
                                    payload["consumed_samples"])
    if not args.no_load_optim:
        trainer.optimizer.load_state_dict(payload["optimizer"])
        trainer.scheduler.load_state_dict(payload["opt_param_scheduler"])
    if payload.get("no_rng") and not args.no_load_rng and st.global_rank == 0:
        print(" the checkpoint was converted to another layout without RNG states: the RNG "
              "streams (dropout) start afresh", flush=True)
    if not args.no_load_rng and not payload.get("no_rng"):
        rng_path = os.path.join(iteration_dir(root, it), "rng", f"rank_{st.global_rank:05d}.pt")
        if not os.path.exists(rng_path):
            raise ValueError(f"{rng_path} is missing (saved on another number of ranks?); "
                             f"resume with --no-load-rng")
        rng = load_file(rng_path, root, it, keys=RNG_KEYS)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        device_mod.set_rng_state(rng["device"], trainer.device)
        chunks[0].rng_tracker.set_states(rng["tracker"])
    if st.global_rank == 0:
        print(f" loaded checkpoint from {root} at iteration {it}", flush=True)
    return payload["iteration"], payload["consumed_samples"]
