"""What a training state holds, collected from a
:class:`~megatron_cp.checkpoint.train_state.TrainState` and restored into one, in no file format.

A checkpoint holds a TrainState's

- model: each param under its canonical name and global shape, this rank holding boxes of it
  (:func:`sharded_state`, :mod:`megatron_cp.checkpoint.canonical`), so any layout reads the
  same full tensors back; the persistent buffers (an MoE router's ``expert_bias``) alike;
- optimizer: the Adam moments (Muon's momentum) and fp32 main params in the same canonical
  form as their weights (``optimizer.<kind>.<name>``), and the scalars of :func:`common`
  (the step count, the param groups' hyper-parameters, the loss scale);
- scheduler: the learning-rate schedule's state;
- RNG: every rank's generators (:func:`rng_state`), restored only on the same rank grid;
- progress: the iteration and the consumed samples;
- args: the arguments it was saved with (:func:`saved_arguments`: Megatron-LM's flat
  namespace, ``train_state.args``, part of the on-disk format), whose model shape a load
  must match (:func:`megatron_cp.checkpoint.files.check_args_match`).

What a save writes and a load restores is decided by the Checkpointer's sections (``ckpt``),
not by ``train_state.args``: the checkpoint section (``ckpt.checkpoint``: ``--finetune``,
``--no-load-optim``, ``--no-load-rng``, ...), the parallel layout (``ckpt.parallel``: the rank
grid) and the optimizer's (``ckpt.optimizer_config``: which optimizer, how the schedule
counts). ``train_state.args`` is what a checkpoint saves as its arguments, and so what the
saved arguments' model shape is compared with. What the TrainState has no object for (its
``optimizer``, ``scheduler`` or ``rerun`` is None: a model for inference) a load leaves
alone, and says nothing of.

:func:`restore` puts a state back from the canonical record (``common``) and a ``read``
that fills this rank's boxes, whichever format and layout the tensors come from.
"""
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp.distributed import device as device_mod
from megatron_cp.checkpoint import files, fp8_state
from megatron_cp.checkpoint.canonical import canonical_name, expert_param_spec, param_spec
from megatron_cp.checkpoint.pieces import Pieces
from megatron_cp.distributed.shards import model_piece
from megatron_cp.optimizer.inner import adam_step, set_adam_step

RNG_KEYS = ("python", "numpy", "torch", "device", "tracker")
GROUP_SETTINGS = ("lr", "weight_decay", "betas", "eps", "momentum", "wd_mult", "lr_mult")
# what tells one param group from another (get_param_groups' key)
GROUP_KEY = ("optimizer", "wd_mult", "is_decoupled_lr", "is_mup_hidden")


def model_chunks(train_state):
    """The TrainState's model chunks (one per virtual stage), without their DDP wrappers."""
    return [c.module if hasattr(c, "module") else c for c in train_state.model_chunks]


def _plain(value):
    return isinstance(value, (int, float, str, bool, type(None), list, tuple))


def saved_arguments(args):
    """The arguments a checkpoint records: the plain values of ``args`` (the run's flat
    argument namespace, Megatron-LM's names: the on-disk format, which Megatron-LM and our
    tools read), the dtype by name."""
    saved = {k: v for k, v in vars(args).items() if _plain(v)}
    saved["params_dtype"] = str(args.params_dtype)
    return saved


# --- RNG ---------------------------------------------------------------------------------

def rng_state(train_state):
    """This rank's RNG states and, while a rerun is pending (the rerun state machine's exit
    16), the machine's verdict so far: a rerun elsewhere needs both (the same dropout)."""
    rng = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": torch.get_rng_state(), "device": device_mod.rng_state(train_state.device),
           "tracker": model_chunks(train_state)[0].rng_tracker.get_states()}
    rerun = train_state.rerun
    pending = rerun.state_dict() if rerun is not None else None
    if pending is not None:
        rng["rerun"] = pending
    return rng


def restore_rng(train_state, rng):
    """Set this rank's RNG states from :func:`rng_state`'s dict, and resume the pending
    rerun it holds, if any (and if ``train_state`` has a rerun machine)."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    device_mod.set_rng_state(rng["device"], train_state.device)
    model_chunks(train_state)[0].rng_tracker.set_states(rng["tracker"])
    if "rerun" in rng and train_state.rerun is not None:
        train_state.rerun.load_state_dict(rng["rerun"])


def rng_file(root, it, global_rank):
    """Where our formats keep one rank's RNG states of iteration ``it`` under ``root``."""
    return os.path.join(files.iteration_dir(root, it), "rng", f"rank_{global_rank:05d}.pt")


def load_rng(train_state, ckpt, root, it, saved_layout):
    """Restore this rank's RNG states from iteration ``it`` under ``root`` when the
    checkpoint was saved on the same rank grid (``saved_layout``: its
    :func:`~megatron_cp.checkpoint.files.rank_grid`) and has them; otherwise say in one line
    that the RNG streams start afresh: they are per global rank and cannot follow the ranks
    into another layout."""
    st = train_state.parallel_state
    path = rng_file(root, it, st.global_rank)
    if saved_layout is None or files.rank_grid(saved_layout) != \
            files.rank_grid(ckpt.parallel) or not os.path.exists(path):
        if st.global_rank == 0:
            print(" the checkpoint was saved under another parallel layout (or without RNG "
                  "states): the per-rank RNG streams start afresh; data order, optimizer and "
                  "dropout (drawn from global coordinates, not those streams) resume exactly",
                  flush=True)
        return
    restore_rng(train_state, files.load_file(path, root, it, keys=RNG_KEYS))


# --- schedule and optimizer --------------------------------------------------------------

def resume_schedule_only(train_state, ckpt, root, it, iteration, consumed_samples):
    """After loading weights only (a converted checkpoint, or one saved with
    ``--no-save-optim``): the optimizer and RNG start fresh, but the learning-rate schedule
    goes on at the saved iteration (one step per iteration, or per sample under a batch-size
    schedule), as the iteration count does, instead of warming up again (a TrainState without
    a schedule: nothing to resume). Returns (iteration, consumed samples)."""
    scheduler = train_state.scheduler
    if scheduler is not None:
        scheduler.num_steps = 0
        counts_samples = ckpt.optimizer_config.lr_counts_samples
        scheduler.step(consumed_samples if counts_samples else iteration)
    if train_state.parallel_state.global_rank == 0 and scheduler is not None:
        print(f" loaded weights only from {root} at iteration {it}: optimizer and RNG "
              f"start fresh, the learning-rate schedule resumes at iteration {iteration}",
              flush=True)
    elif train_state.parallel_state.global_rank == 0:
        print(f" loaded weights only from {root} at iteration {it}", flush=True)
    return iteration, consumed_samples


def check_optimizer_matches(saved, optimizer):
    """Refuse to load optimizer state that another ``--optimizer`` saved (Adam's moments are
    not Muon's momentum). ``saved``: the checkpoint's arguments; ``optimizer``: this run's
    OptimizerConfig."""
    saved_optimizer = saved.get("optimizer", "adam")
    if saved_optimizer != optimizer.optimizer:
        raise ValueError(f"the checkpoint holds the optimizer state of --optimizer "
                         f"{saved_optimizer}, but this run uses --optimizer "
                         f"{optimizer.optimizer}; "
                         f"resume with --optimizer {saved_optimizer}, or pass --no-load-optim "
                         f"to start the optimizer afresh")


def _group_key(group):
    return tuple(group.get(k, default) for k, default in zip(GROUP_KEY, ("adam", 1.0, False, False)))


def _restore_optimizer(opt, common):
    set_adam_step(opt.optimizer, common["adam_step"])
    saved_groups = {_group_key(saved): saved for saved in common["param_groups"]}
    for group in opt.optimizer.param_groups:  # by key: a stage may lack a group rank 0 has
        saved = saved_groups.get(_group_key(group), {})
        # the hyper-parameters only: kernel switches (fused, foreach) follow this run's device
        group.update({k: v for k, v in saved.items() if k in GROUP_SETTINGS})
    if opt.grad_scaler is not None and common.get("grad_scaler") is not None:
        opt.grad_scaler.load_state_dict(common["grad_scaler"])
    opt.num_skipped_iters = int(common.get("num_skipped_iters", 0))


# --- the canonical state: tensors as boxes, the rest as one record -----------------------

# a last stage's copies of the first stage's word embedding (tied output layer, MTP's table)
COPIES_OF_THE_EMBEDDING = ("output_layer.weight", "mtp_word_embeddings.weight")


def _param_specs(train_state, padded_vocab=False):
    """{id(param): (CanonicalSpec, is the last stage's tied copy)} for this rank's params
    (``padded_vocab``: the vocabulary params with their padded rows, as Megatron-LM saves
    them)."""
    st = train_state.parallel_state
    out = {}
    for chunk in model_chunks(train_state):
        layers = list(chunk.decoder.layer_numbers)
        for name, param in chunk.named_parameters():
            tied_copy = name in COPIES_OF_THE_EMBEDDING and getattr(param, "shared_embedding",
                                                                    False)
            canon = "embedding.word_embeddings.weight" if tied_copy else canonical_name(name, layers)
            if getattr(param, "is_expert", False):
                spec = expert_param_spec(canon, param, st.size("ep"), st.rank("ep"),
                                         st.size("etp"), st.rank("etp"))
            else:
                spec = param_spec(canon, param, st.size("tp"), st.rank("tp"),
                                  None if padded_vocab else train_state.model_config.vocab_size)
            out[id(param)] = (spec, tied_copy)
    return out


def _persistent_buffers(chunk):
    """``(canonical name, buffer)`` of the buffers a chunk's state dict holds (an MoE
    router's ``expert_bias``): replicated state, saved whole like a norm weight."""
    layers = list(chunk.decoder.layer_numbers)
    saved = chunk.state_dict(keep_vars=True)
    for name, buffer in chunk.named_buffers():
        if name in saved:
            yield canonical_name(name, layers), buffer


def sharded_state(train_state, with_optimizer, for_load=False, padded_vocab=False):
    """``{key: Pieces}`` of this rank: live views of the model params and, with
    ``with_optimizer``, of the optimizer shards. ``for_load`` includes the tied copy (it
    reads the embedding's key); a save leaves it out. ``padded_vocab``: the vocabulary
    params whole, padded rows included."""
    specs = _param_specs(train_state, padded_vocab)
    state = {}

    def put(key, spec, flat, start, stop):
        if key in state:
            raise AssertionError(f"two pieces of {key} on one rank")
        state[key] = Pieces.of_flat(spec, flat, start, stop)

    for chunk in model_chunks(train_state):
        for param in chunk.parameters():
            spec, tied_copy = specs[id(param)]
            piece = model_piece(param, for_load, with_optimizer)  # FSDP2: this rank's rows
            if (for_load or not tied_copy) and piece is not None:
                put(f"model.{spec.name}", spec, *piece)
        for canon, buffer in _persistent_buffers(chunk):
            put(f"model.{canon}", param_spec(canon, buffer, 1, 0), buffer.view(-1), 0,
                buffer.numel())
    if with_optimizer:
        for shard in train_state.optimizer.param_shards():
            spec, tied_copy = specs[id(shard.model_param)]
            if tied_copy and not for_load:
                continue
            for kind, flat in {**shard.state, "main_param": shard.main}.items():
                if flat is not None:
                    put(f"optimizer.{kind}.{spec.name}", spec, flat, shard.start, shard.stop)
    return state


def common(train_state, ckpt, with_optimizer):
    """The record of everything but the tensors: progress, args (``train_state.args``, the
    saved namespace), the rank grid (of ``ckpt.parallel``), schedule and the optimizer's
    scalars. A collective (the Adam step count is agreed by every rank)."""
    opt = train_state.optimizer
    step = torch.tensor([adam_step(opt.optimizer)], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a distributed-optimizer rank may own nothing
    record = {"iteration": train_state.iteration,
              "consumed_samples": train_state.consumed_samples,
              "args": saved_arguments(train_state.args), "checkpoint_version": 3.0,
              "layout": files.rank_grid(ckpt.parallel), "has_optimizer": with_optimizer,
              "opt_param_scheduler": train_state.scheduler.state_dict()}
    if with_optimizer:
        record.update(adam_step=step.item(), num_skipped_iters=opt.num_skipped_iters,
                      grad_scaler=None if opt.grad_scaler is None else opt.grad_scaler.state_dict(),
                      param_groups=[{k: v for k, v in g.items() if k != "params"}
                                    for g in opt.optimizer.param_groups])
    return record


def say_on_rank0(train_state):
    """``say(line)``: print a start-up note on global rank 0."""
    def say(line):
        if train_state.parallel_state.global_rank == 0:
            print(f" {line}", flush=True)
    return say


def loads_fp8(train_state, saved_args):
    """Whether this run loads the FP8 delayed-scaling buffers of a checkpoint saved with
    ``saved_args`` ({}: it holds none) (:func:`megatron_cp.checkpoint.fp8_state.carries`)."""
    return fp8_state.carries(saved_args, saved_arguments(train_state.args),
                             say_on_rank0(train_state))


def restore(train_state, ckpt, root, it, record, read, saved_fp8=True):
    """Restore ``train_state`` from a checkpoint held as canonical tensors: ``record`` is its
    :func:`common` record, ``read(state)`` fills this rank's :func:`sharded_state`
    (``{key: Pieces}``) from its tensors, whichever layout saved them; what it restores
    follows ``ckpt.checkpoint`` and what ``train_state`` holds (no optimizer: the weights,
    no optimizer state). ``saved_fp8``: False for a checkpoint that holds no FP8 buffers
    whatever its arguments say (Megatron-LM's). Returns (iteration, consumed samples)."""
    st, checkpoint, opt = train_state.parallel_state, ckpt.checkpoint, train_state.optimizer
    files.check_args_match(record["args"], saved_arguments(train_state.args))
    if opt is not None:
        opt.finish_param_sync()
    with_optimizer = (record["has_optimizer"] and not checkpoint.finetune
                      and not checkpoint.no_load_optim and opt is not None)
    if with_optimizer:
        check_optimizer_matches(record["args"], ckpt.optimizer_config)
    state = sharded_state(train_state, with_optimizer, for_load=True)
    if not loads_fp8(train_state, record["args"] if saved_fp8 else {}):
        state = fp8_state.without_fp8(state)  # a fresh history, or the saved one unused
    read(state)
    if opt is not None and not with_optimizer:
        opt.reload_model_params()
    elif opt is not None:
        opt.after_load()  # --optimizer-cpu-offload: host main params of fp32 params
    if checkpoint.finetune:
        return 0, 0
    if not record["has_optimizer"]:
        return resume_schedule_only(train_state, ckpt, root, it, record["iteration"],
                                    record["consumed_samples"])
    if with_optimizer:
        if train_state.scheduler is not None:
            train_state.scheduler.load_state_dict(record["opt_param_scheduler"])
        _restore_optimizer(opt, record)
    if not checkpoint.no_load_rng:
        load_rng(train_state, ckpt, root, it, record.get("layout"))
    if st.global_rank == 0:
        print(f" loaded checkpoint from {root} at iteration {it}", flush=True)
    return record["iteration"], record["consumed_samples"]
