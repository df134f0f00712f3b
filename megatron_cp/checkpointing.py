"""Checkpoints: saved atomically, resumed exactly; ``--ckpt-format torch`` here, and the
dispatch to ``--ckpt-format torch_dist`` (:mod:`megatron_cp.dist_checkpoint`), which loads
into any parallel layout. ``--load`` reads either format, whatever ``--ckpt-format`` says,
into any layout: a torch checkpoint of another layout is read whole by every rank, which
takes its own shards (:mod:`megatron_cp.dist_checkpoint.torch_full`).

The torch format has one shard per (TP, PP, EP, ETP) rank combination (Megatron's layout)::

    <dir>/latest_checkpointed_iteration.txt          "20"
    <dir>/iter_0000020/mp_rank_00/model_optim_rng.pt         (PP = 1)
    <dir>/iter_0000020/mp_rank_01_003/model_optim_rng.pt     (TP rank 1, PP rank 3)
    <dir>/iter_0000020/mp_rank_01_003_002/model_optim_rng.pt (... and EP rank 2, EP > 1)
    <dir>/iter_0000020/mp_rank_00_001_etp01/...              (TP 0, EP 1, ETP rank 1)
    <dir>/iter_0000020/rng/rank_00005.pt                     (every rank's RNG states)

Shard names (:func:`shard_name`): ``mp_rank_TT`` (TP rank), then ``_PPP`` (PP rank) when
PP > 1, then ``_EEE`` (EP rank) when EP > 1, then ``_etpXX`` (ETP rank) when ETP > 1 and
ETP != TP. The parts present follow from the saved sizes, so a name is unambiguous given
the arguments (``_PPP`` and ``_EEE`` are both 3 digits, as in Megatron-LM). The ETP rank is
left out when it is implied: with ETP = TP the expert mesh gives every rank ETP rank = TP
rank, and with ETP = 1 it is 0. A dense model (no ``--num-experts``) names files by TP and
PP only, whatever the expert sizes say. Each file holds everything its ranks hold: the
dense params of its (TP, PP) rank and the experts of its (EP, ETP) rank, with the
optimizer state of all of them. Which combinations exist depends on the sizes only, not
on DP or CP (:func:`shard_names`): with TP = 2, EP = 2, ETP = 1 the expert mesh pairs TP
rank t with EP rank t, so the files are ``mp_rank_00_000`` and ``mp_rank_01_001``.

A save writes into ``iter_N.tmp`` and renames it to ``iter_N`` only when every rank has
written; the tracker file is replaced last. A crash mid-save leaves the previous checkpoint
and tracker untouched; a save that fails (a full disk, a lost rank) also removes its partial
files and stops every rank with one line (:mod:`megatron_cp.checkpoint_faults`). Each file is written by the lowest global rank of its combination
(the other ranks of it -- DP and CP replicas of the dense params, expert-DP replicas of the
experts -- hold identical weights and optimizer states); with the distributed optimizer
its shards (over DP x CP for dense params, over expert-DP for experts) are gathered first,
so the file is the same with or without it and loads into either.

Every file a load reads goes through :func:`load_file` / :func:`read_tracker`: a truncated or
corrupted file (or a tracker naming a missing iteration) is a ValueError naming the file and
the way out (the latest good iteration, to load with ``--ckpt-step``), never an unpickling or
zip traceback.
"""
import math
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp import checkpoint_faults
from megatron_cp import device as device_mod
from megatron_cp.config_flags import checkpoint_args
from megatron_cp.dist_checkpoint import megatron_lm
from megatron_cp.initialize import TP_PP_DP_RANK_ORDER
from megatron_cp.model.config import GPTConfig

TRACKER = "latest_checkpointed_iteration.txt"
# Arguments that shape the saved tensors: a checkpoint loads only into a model with the same
# (the GPTConfig fields marked ``shapes``, params_dtype among them).
SHAPE_ARGS = checkpoint_args(GPTConfig)
# Arguments that spread the layers and their shards over the torch format's files: when
# they differ from the running ones, a torch checkpoint is resharded on load.
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


def iteration_dir(root, iteration):
    return os.path.join(root, f"iter_{iteration:07d}")


def shard_name(tp_rank, pp_rank, pp_size, ep_rank=0, ep_size=1, etp_rank=0, etp_in_name=False):
    """The folder of one torch-format shard (the scheme is in the module docstring)."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp_size > 1:
        name += f"_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    if etp_in_name:
        name += f"_etp{etp_rank:02d}"
    return name


def file_layout(args):
    """``(TP, PP, EP, ETP)`` sizes that name the files of a run with ``args`` (a namespace
    or the saved dict): a dense model has EP 1 and ETP = TP, whatever the flags say."""
    values = args if isinstance(args, dict) else vars(args)
    tp, pp = values["tensor_model_parallel_size"], values["pipeline_model_parallel_size"]
    if not values.get("num_experts"):
        return tp, pp, 1, tp
    return (tp, pp, values.get("expert_model_parallel_size") or 1,
            values.get("expert_tensor_parallel_size") or tp)


def shard_names(tp, pp, ep=1, etp=None):
    """``{(tp rank, pp rank, ep rank, etp rank): shard folder name}`` of every combination
    that exists under these sizes. Inside a stage, rank ``i`` (in rank order over DP x CP x
    TP) has TP rank ``i % TP``, ETP rank ``i % ETP`` and EP rank ``(i // ETP) % EP``
    (initialize.rank_layout), which repeats with period lcm(TP, EP x ETP): every stage size
    that the sizes allow holds the same combinations."""
    etp = tp if etp is None else etp
    combos = sorted({(i % tp, (i // etp) % ep, i % etp) for i in range(math.lcm(tp, ep * etp))})
    in_name = etp > 1 and etp != tp
    return {(t, p, e, x): shard_name(t, p, pp, e, ep, x, in_name)
            for p in range(pp) for t, e, x in combos}


def _shard_coords(sizes, tp_rank, pp_rank, ep_rank, etp_rank):
    """A rank's key in :func:`shard_names` (EP / ETP ranks that the sizes imply are folded)."""
    tp, _, ep, etp = sizes
    etp_key = tp_rank if etp == tp else etp_rank if etp > 1 else 0
    return tp_rank, pp_rank, ep_rank if ep > 1 else 0, etp_key


def own_shard_name(state, args):
    """The shard folder this rank's state goes to (and loads from)."""
    sizes = file_layout(args)
    key = _shard_coords(sizes, state.rank("tp"), state.rank("pp"), state.rank("ep"),
                        state.rank("etp"))
    names = shard_names(*sizes)
    assert key in names, (key, sorted(names))
    return names[key]


def is_shard_writer(state, args):
    """True on the lowest global rank of this rank's shard combination: the one that writes
    it (every rank of a combination holds the same weights and optimizer state)."""
    sizes, names = file_layout(args), ("tp", "pp", "ep", "etp")
    group_rank = {name: {} for name in names}  # {group name: {global rank: rank in group}}
    for name in names:
        for ranks in state.layout[name]:
            group_rank[name].update((rank, i) for i, rank in enumerate(ranks))

    def key(rank):
        return _shard_coords(sizes, *(group_rank[name][rank] for name in names))

    mine = key(state.global_rank)
    return next(r for r in range(state.world_size) if key(r) == mine) == state.global_rank


def _atomic_torch_save(obj, path):
    partial = path + ".partial"
    with checkpoint_faults.naming(partial):  # torch.save reports ENOSPC without the file
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


def _atomic_write_text(path, text):
    _write_synced(path + ".partial", text)
    os.replace(path + ".partial", path)


RNG_KEYS = ("python", "numpy", "torch", "device", "tracker")


def _rng_state(trainer):
    """This rank's RNG states and, while a rerun is pending (the rerun state machine's exit
    16), the machine's verdict so far: a rerun elsewhere needs both (the same dropout)."""
    rng = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": torch.get_rng_state(), "device": device_mod.rng_state(trainer.device),
           "tracker": trainer.model_chunks[0].module.rng_tracker.get_states()}
    pending = trainer.rerun.state_dict() if hasattr(trainer, "rerun") else None
    if pending is not None:
        rng["rerun"] = pending
    return rng


def restore_rng(trainer, rng):
    """Set this rank's RNG states from :func:`_rng_state`'s dict (both formats), and resume
    the pending rerun it holds, if any."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    device_mod.set_rng_state(rng["device"], trainer.device)
    first = trainer.model_chunks[0]
    getattr(first, "module", first).rng_tracker.set_states(rng["tracker"])
    if "rerun" in rng and hasattr(trainer, "rerun"):
        trainer.rerun.load_state_dict(rng["rerun"])


def _model_states(trainer):
    chunks = [c.module if hasattr(c, "module") else c for c in trainer.model_chunks]
    # the global layer numbers of each chunk let a load in another layout reshard (and
    # tools/checkpoint_convert.py)
    layers = {"layer_numbers": [list(c.decoder.layer_numbers) for c in chunks]}
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict(), **layers}
    return {**{f"model{i}": c.state_dict() for i, c in enumerate(chunks)}, **layers}


def save_checkpoint(trainer, root):
    """Save model, optimizer, scheduler, RNG, consumed samples and arguments atomically,
    in ``--ckpt-format`` (with ``--async-save``, torch_dist, in the background)."""
    args = trainer.args
    if getattr(args, "ckpt_format", "torch_dist") == "torch_dist":
        from megatron_cp.dist_checkpoint import torch_dist
        return torch_dist.save(trainer, root, async_save=getattr(args, "async_save", False))
    st, it = trainer.state, trainer.iteration
    tmp = iteration_dir(root, it) + ".tmp"
    trainer.optimizer.finish_param_sync()
    # a collective with the distributed optimizer (its shards are gathered): every rank
    optimizer_state = None if getattr(args, "no_save_optim", False) else trainer.optimizer.state_dict()
    attempt = save_attempt(root, it)

    def write():
        if is_shard_writer(st, args):
            shard = os.path.join(tmp, own_shard_name(st, args))
            os.makedirs(shard, exist_ok=True)
            saved = {k: v for k, v in vars(args).items() if _plain(v)}
            saved["params_dtype"] = str(args.params_dtype)
            payload = {"iteration": it, "consumed_samples": trainer.consumed_samples,
                       "args": saved, "opt_param_scheduler": trainer.scheduler.state_dict(),
                       "checkpoint_version": 3.0, **_model_states(trainer)}
            if optimizer_state is not None:
                payload["optimizer"] = optimizer_state
            else:
                payload["converted"] = True  # weights only: the schedule resumes, Adam starts fresh
            _atomic_torch_save(payload, os.path.join(shard, "model_optim_rng.pt"))
        _atomic_torch_save(_rng_state(trainer),
                           os.path.join(tmp, "rng", f"rank_{st.global_rank:05d}.pt"))

    def commit():
        if st.global_rank == 0:
            commit_checkpoint(root, it, getattr(args, "save_retain_interval", None))

    attempt.start()  # the ranks agree after each phase (where a barrier was)
    attempt.phase(write)
    attempt.phase(commit)


def save_attempt(root, it, group=None):
    """The :class:`~megatron_cp.checkpoint_faults.SaveAttempt` of iteration ``it`` under
    ``root`` (the files it may leave behind; the tracker it keeps)."""
    return checkpoint_faults.SaveAttempt(root, it, iteration_dir(root, it) + ".tmp",
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


def wait_for_async_save(trainer):
    """Block until a background (``--async-save``) save has written and committed."""
    from megatron_cp.dist_checkpoint import torch_dist
    torch_dist.wait_for_async_save(trainer)


def resume_schedule_only(trainer, root, it, iteration, consumed_samples):
    """After loading weights only (a converted checkpoint, or one saved with
    ``--no-save-optim``): the optimizer and RNG start fresh, but the learning-rate schedule
    goes on at the saved iteration (one step per iteration, or per sample under a batch-size
    schedule), as the iteration count does, instead of warming up again. Returns (iteration,
    consumed samples)."""
    trainer.scheduler.num_steps = 0
    trainer.scheduler.step(consumed_samples if trainer.args.lr_counts_samples else iteration)
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
    """How to resume from another checkpoint than iteration ``it``: one sentence naming the
    newest other iteration that looks whole (checkpoint_faults.latest_intact)."""
    others = {i: iteration_dir(root, i) for i in saved_iterations(root) if i != it}
    good = checkpoint_faults.latest_intact(others)
    if good is None:
        return (f"there is no other intact checkpoint under {root}: restore the file from a "
                f"copy, or start again without --load")
    return (f"iteration {good} is the latest good one: load it with --ckpt-step {good} (or "
            f"restore the file from a copy)")


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
        raise ValueError(f"checkpoint file {path} cannot be read, it is truncated or corrupted "
                         f"({checkpoint_faults.short_reason(error)}); "
                         f"{_earlier(root, it)}") from error
    missing = [k for k in keys if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise ValueError(f"checkpoint file {path} has no {', '.join(missing)}: not a megatron_cp "
                         f"checkpoint file, or a corrupted one; {_earlier(root, it)}")
    return payload


def latest_first_shard(root, step=None):
    """Path of the (TP 0, PP 0) shard of the latest checkpoint under ``root`` (of iteration
    ``step`` when given: ``--ckpt-step``; None if none; for a torch_dist checkpoint its
    ``common.pt``)."""
    it = load_iteration(root, step)
    if it is None:
        return None
    folder = iteration_dir(root, it)
    if os.path.exists(os.path.join(folder, ".metadata")):
        return os.path.join(folder, "common.pt")
    # mp_rank_00, mp_rank_00_000 or mp_rank_00_000_000 (PP, EP) sort first
    for name in sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_")):
        path = os.path.join(folder, name, "model_optim_rng.pt")
        if os.path.exists(path):
            return path
    raise ValueError(f"{folder} holds no mp_rank_00 shard: not a megatron_cp checkpoint, or a "
                     f"partial copy of one")


def saved_args(root, step=None):
    """The arguments the latest checkpoint under ``root`` (iteration ``step`` when given) was
    saved with (a dict; for one Megatron-LM wrote, its Namespace in our names)."""
    it = load_iteration(root, step)
    if it is not None and megatron_lm.is_megatron_lm(iteration_dir(root, it)):
        return megatron_lm.our_args(megatron_lm.read_common(iteration_dir(root, it))["args"])
    path = latest_first_shard(root, step)
    if path is None:
        raise ValueError(f"no checkpoint under {root} (no {TRACKER}); train one first, or drop "
                         f"--use-checkpoint-args and give the model flags")
    return load_file(path, root, load_iteration(root, step), keys=("args",))["args"]


def check_args_match(saved, args):
    """Refuse a checkpoint whose model shape (:data:`SHAPE_ARGS`) differs from this run's,
    naming every mismatch. The parallel layout never has to match: a torch_dist checkpoint
    loads into any layout, a torch one is resharded (:func:`load_checkpoint`)."""
    current = dict(vars(args), params_dtype=str(args.params_dtype))
    differ = [k for k in SHAPE_ARGS if k in saved and saved.get(k) != current.get(k)]
    if differ:
        diffs = "; ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
                          for k in differ)
        raise ValueError(f"checkpoint was saved with other model arguments: {diffs}. Give "
                         f"the model's own arguments, or take them from it with "
                         f"--use-checkpoint-args")


def same_files(saved, args):
    """True when a torch checkpoint saved with ``saved`` (its args) spreads the layers and
    their shards over its files as this run does (:data:`LAYOUT_ARGS`; a dense model has no
    expert layout), so each rank reads its own file."""
    skip = () if saved.get("num_experts") else EXPERT_LAYOUT_ARGS
    current = vars(args)
    return all(saved.get(k) == current.get(k) for k in LAYOUT_ARGS if k not in skip)


def rank_grid(args):
    """Where ``args`` (a namespace or the saved dict) put every rank: the values of
    :data:`RANK_LAYOUT_ARGS`. The rank order counts only when it moves ranks (PP > 1 and
    DP > 1); checkpoints that predate the setting were saved with data parallel outermost."""
    values = args if isinstance(args, dict) else vars(args)
    grid = {k: values.get(k) for k in RANK_LAYOUT_ARGS}
    model = ((grid["tensor_model_parallel_size"] or 1) * (grid["context_parallel_size"] or 1)
             * (grid["pipeline_model_parallel_size"] or 1))
    dp = (grid["world_size"] or model) // model
    moves = (grid["pipeline_model_parallel_size"] or 1) > 1 and dp > 1
    grid["rank_order"] = (grid["rank_order"] or TP_PP_DP_RANK_ORDER) if moves else None
    return grid


def load_rng(trainer, root, it, saved_layout):
    """Restore this rank's RNG states from iteration ``it`` under ``root`` (either format)
    when the checkpoint was saved on the same rank grid (``saved_layout``: its
    :func:`rank_grid`) and has them; otherwise say in one line that the RNG streams start
    afresh: they are per global rank and cannot follow the ranks into another layout."""
    st = trainer.state
    path = os.path.join(iteration_dir(root, it), "rng", f"rank_{st.global_rank:05d}.pt")
    if saved_layout is None or rank_grid(saved_layout) != rank_grid(trainer.args) \
            or not os.path.exists(path):
        if st.global_rank == 0:
            print(" the checkpoint was saved under another parallel layout (or without RNG "
                  "states): data order and optimizer resume exactly, the RNG streams (dropout) "
                  "start afresh", flush=True)
        return
    restore_rng(trainer, load_file(path, root, it, keys=RNG_KEYS))


def check_optimizer_matches(saved, args):
    """Refuse to load optimizer state that another ``--optimizer`` saved (Adam's moments are
    not Muon's momentum)."""
    saved_optimizer = saved.get("optimizer", "adam")
    if saved_optimizer != args.optimizer:
        raise ValueError(f"the checkpoint holds the optimizer state of --optimizer "
                         f"{saved_optimizer}, but this run uses --optimizer {args.optimizer}; "
                         f"resume with --optimizer {saved_optimizer}, or pass --no-load-optim "
                         f"to start the optimizer afresh")


def load_checkpoint(trainer, root):
    """Load the latest checkpoint under ``root`` into ``trainer``, whatever its format and
    parallel layout; returns (iteration, consumed samples).

    The format is told by the iteration folder (a DCP ``.metadata``: torch_dist). A torch
    checkpoint saved in this run's file layout is read file by file, each rank its own
    (bit-exact resume); in another layout every rank reads it whole and takes its pieces
    (:mod:`megatron_cp.dist_checkpoint.torch_full`), as a torch_dist load does."""
    st, args = trainer.state, trainer.args
    it = load_iteration(root, getattr(args, "ckpt_step", None))
    if it is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise ValueError(f"--exit-on-missing-checkpoint: no checkpoint under --load {root} "
                             f"(no {TRACKER}); check the path, or drop the flag to start fresh")
        if st.global_rank == 0:
            print(f" no checkpoint under {root} (no {TRACKER}); starting from scratch", flush=True)
        return 0, 0
    if megatron_lm.is_megatron_lm(iteration_dir(root, it)):  # written by Megatron-LM itself
        from megatron_cp.dist_checkpoint import megatron_load
        return megatron_load.load(trainer, root, it)
    if os.path.exists(os.path.join(iteration_dir(root, it), ".metadata")):
        from megatron_cp.dist_checkpoint import torch_dist
        return torch_dist.load(trainer, root, it)
    if getattr(args, "verify_integrity", False) and st.global_rank == 0:
        print(f" --verify-integrity: the checkpoint under {root} is --ckpt-format torch, which "
              f"has no integrity manifest (Megatron-LM hashes torch_dist checkpoints only); "
              f"loading it unverified", flush=True)
    path = os.path.join(iteration_dir(root, it), own_shard_name(st, args), "model_optim_rng.pt")
    payload = None
    if os.path.exists(path):  # this rank's file in this run's layout, or a namesake
        payload = load_file(path, root, it, trainer.device,
                            keys=("args", "iteration", "consumed_samples"))
    saved = (payload or load_file(latest_first_shard(root, it), root, it, keys=("args",)))["args"]
    check_args_match(saved, args)
    if payload is None and same_files(saved, args):
        raise ValueError(f"checkpoint file {path} is missing (the same layout saved it: the "
                         f"copy is incomplete); {_earlier(root, it)}")
    if payload is None or not same_files(saved, args):
        from megatron_cp.dist_checkpoint import torch_full
        if st.global_rank == 0:
            print(f" the torch checkpoint under {root} was saved under another parallel layout: "
                  f"every rank reads it whole and takes its own shards", flush=True)
        return torch_full.load_resharded(trainer, root, it)
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
        check_optimizer_matches(payload["args"], args)
        trainer.scheduler.load_state_dict(payload["opt_param_scheduler"])  # names the flags
        trainer.optimizer.load_state_dict(payload["optimizer"])
    if not args.no_load_rng:
        # a conversion to another layout (tools/checkpoint_convert.py) carries no RNG states
        load_rng(trainer, root, it, None if payload.get("no_rng") else payload["args"])
    if st.global_rank == 0:
        print(f" loaded checkpoint from {root} at iteration {it}", flush=True)
    return payload["iteration"], payload["consumed_samples"]
