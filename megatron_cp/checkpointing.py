"""Checkpoints: saved atomically, resumed exactly; ``--ckpt-format torch`` here, and the
dispatch to ``--ckpt-format torch_dist`` (:mod:`megatron_cp.dist_checkpoint`), which loads
into any parallel layout. ``--load`` reads either format, whatever ``--ckpt-format`` says.

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
and tracker untouched. Each file is written by the lowest global rank of its combination
(the other ranks of it -- DP and CP replicas of the dense params, expert-DP replicas of the
experts -- hold identical weights and optimizer states); with the distributed optimizer
its shards (over DP x CP for dense params, over expert-DP for experts) are gathered first,
so the file is the same with or without it and loads into either.

Every file a load reads goes through :func:`load_file` / :func:`read_tracker`: a truncated or
corrupted file (or a tracker naming a missing iteration) is a ValueError naming the file and
the way out (an earlier checkpoint, listed), never an unpickling or zip traceback.
"""
import math
import os
import random
import re
import shlex
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp import device as device_mod
from megatron_cp.config_flags import checkpoint_args
from megatron_cp.dist_checkpoint import megatron_lm
from megatron_cp.initialize import TP_PP_DP_RANK_ORDER
from megatron_cp.model.config import GPTConfig

TRACKER = "latest_checkpointed_iteration.txt"
# Arguments that change the shape or layout of the saved tensors: must match to resume. The
# model's are the GPTConfig fields marked ``shapes`` (params_dtype among them); the layout's
# are how the layers and their shards are spread over the files.
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers", "num_virtual_stages_per_pipeline_rank",
               "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
               "account_for_loss_in_pipeline_split", "expert_model_parallel_size",
               "expert_tensor_parallel_size")
EXPERT_LAYOUT_ARGS = ("expert_model_parallel_size", "expert_tensor_parallel_size")
MODEL_ONLY_ARGS = checkpoint_args(GPTConfig)
MODEL_ARGS = MODEL_ONLY_ARGS + LAYOUT_ARGS


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
    # the global layer numbers of each chunk let tools/checkpoint_convert.py reshard
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
    final = iteration_dir(root, it)
    tmp = final + ".tmp"
    trainer.optimizer.finish_param_sync()
    # a collective with the distributed optimizer (its shards are gathered): every rank
    optimizer_state = None if getattr(args, "no_save_optim", False) else trainer.optimizer.state_dict()
    if st.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    dist.barrier()
    if is_shard_writer(st, args):
        shard = os.path.join(tmp, own_shard_name(st, args))
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
        commit_checkpoint(root, it, getattr(trainer.args, "save_retain_interval", None))
    dist.barrier()


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
    # mp_rank_00, mp_rank_00_000 or mp_rank_00_000_000 (PP, EP) sort first
    for name in sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_")):
        path = os.path.join(folder, name, "model_optim_rng.pt")
        if os.path.exists(path):
            return path
    raise ValueError(f"{folder} holds no mp_rank_00 shard: not a megatron_cp checkpoint, or a "
                     f"partial copy of one")


def saved_args(root):
    """The arguments the latest checkpoint under ``root`` was saved with (a dict; for one
    Megatron-LM wrote, its Namespace in our names)."""
    it = read_tracker(root)
    if it is not None and megatron_lm.is_megatron_lm(iteration_dir(root, it)):
        return megatron_lm.our_args(megatron_lm.read_common(iteration_dir(root, it))["args"])
    path = latest_first_shard(root)
    if path is None:
        raise ValueError(f"no checkpoint under {root} (no {TRACKER}); train one first, or drop "
                         f"--use-checkpoint-args and give the model flags")
    return load_file(path, root, read_tracker(root), keys=("args",))["args"]


def _target_flag(name):
    """The tools/checkpoint_convert.py flag that sets layout argument ``name``."""
    short = {"tensor_model_parallel_size": "tensor_parallel_size",
             "pipeline_model_parallel_size": "pipeline_parallel_size"}.get(name, name)
    return "--target-" + short.replace("_", "-")


def check_args_match(saved, args, names=MODEL_ARGS):
    """Refuse a checkpoint whose model arguments (``names``) differ, naming every mismatch;
    when only the parallel layout differs, name the conversion that fixes it."""
    current = dict(vars(args), params_dtype=str(args.params_dtype))
    skip = () if saved.get("num_experts") else EXPERT_LAYOUT_ARGS  # no experts: no expert layout
    differ = [k for k in names if k in saved and k not in skip and saved.get(k) != current.get(k)]
    diffs = "; ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}" for k in differ)
    if any(k not in LAYOUT_ARGS for k in differ):
        raise ValueError(f"checkpoint was saved with other model arguments: {diffs}. Use the same "
                         f"arguments, or convert it with tools/checkpoint_convert.py")
    if differ:
        flags = " ".join(_target_flag(k) + ("" if current[k] is True else f" {shlex.quote(str(current[k]))}")
                         for k in differ  # None, False: leave the flag out
                         if current.get(k) is not None and current.get(k) is not False)
        raise ValueError(f"checkpoint was saved under another parallel layout ({diffs}): resume "
                         f"with that layout, or convert it with tools/checkpoint_convert.py "
                         f"{flags}")


def _ranks_moved(saved, args, state):
    """The saved rank order when it puts this run's (pp, dp) positions on other global ranks
    (the RNG files are per global rank), else None. Checkpoints that predate the setting
    were saved with data parallel outermost."""
    saved_order = saved.get("rank_order", TP_PP_DP_RANK_ORDER)
    if saved_order == args.rank_order or state.size("pp") == 1 or state.size("dp") == 1:
        return None
    return saved_order


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
    if not os.path.exists(path):
        first = latest_first_shard(root)  # another layout names its files otherwise: say which
        check_args_match(load_file(first, root, it, keys=("args",))["args"], args)
        raise ValueError(f"checkpoint shard {path} is missing: was it saved with another "
                         f"TP/PP/EP layout? Convert it with tools/checkpoint_convert.py")
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
        check_optimizer_matches(payload["args"], args)
        trainer.scheduler.load_state_dict(payload["opt_param_scheduler"])  # names the flags
        trainer.optimizer.load_state_dict(payload["optimizer"])
    if payload.get("no_rng") and not args.no_load_rng and st.global_rank == 0:
        print(" the checkpoint was converted to another layout without RNG states: the RNG "
              "streams (dropout) start afresh", flush=True)
    moved = _ranks_moved(payload["args"], args, st)
    if moved and not args.no_load_rng and st.global_rank == 0:
        print(f" the checkpoint was saved with rank order {moved}, this run uses "
              f"{args.rank_order}: each rank's RNG file belongs to another rank, so the RNG "
              f"streams (dropout) start afresh", flush=True)
    if not args.no_load_rng and not payload.get("no_rng") and not moved:
        rng_path = os.path.join(iteration_dir(root, it), "rng", f"rank_{st.global_rank:05d}.pt")
        if not os.path.exists(rng_path):
            raise ValueError(f"{rng_path} is missing (saved on another number of ranks?); "
                             f"resume with --no-load-rng")
        restore_rng(trainer, load_file(rng_path, root, it, keys=RNG_KEYS))
    if st.global_rank == 0:
        print(f" loaded checkpoint from {root} at iteration {it}", flush=True)
    return payload["iteration"], payload["consumed_samples"]
