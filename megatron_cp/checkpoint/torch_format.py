"""Our ``--ckpt-format torch``: a file per model-parallel rank combination, as Megatron-LM's
torch format keeps them (names: :mod:`megatron_cp.checkpoint.torch_shards`). This module
knows no other format.

Each file holds everything its ranks hold: the dense params of its (TP, PP) rank and the
experts of its (EP, ETP) rank, with the optimizer state of all of them, the schedule, the
iteration, the consumed samples and the arguments; every rank's RNG states go to
``rng/rank_NNNNN.pt``. Each file is written by the lowest global rank of its combination
(the other ranks of it -- DP and CP replicas of the dense params, expert-DP replicas of the
experts -- hold identical weights and optimizer states); with the distributed optimizer its
shards (over DP x CP for dense params, over expert-DP for experts) are gathered first, so the
file is the same with or without it and loads into either.

Two loads: :func:`load_own_file` when the running layout spreads the model over the files as
the saved one did (each rank reads its own file: a bit-exact resume), and
:func:`load_resharded` otherwise (every rank reads the checkpoint whole,
:mod:`megatron_cp.checkpoint.torch_full`, and takes its own pieces).

What a save writes and a load restores follows the Checkpointer's checkpoint section
(``ckpt.checkpoint``) and what the TrainState holds; the files are named by the parallel
layout (``ckpt.parallel``, the model's experts). ``train_state.args`` is only what a file
saves as its arguments.
"""
import os

from megatron_cp.checkpoint import files, fp8_state, torch_shards
from megatron_cp.checkpoint import state as training_state
from megatron_cp.checkpoint.canonical import canonical_tensors
from megatron_cp.checkpoint.pieces import fill_from_full
from megatron_cp.checkpoint.torch_full import common_state, read_torch_full


def _model_states(train_state):
    chunks = training_state.model_chunks(train_state)
    # the global layer numbers of each chunk let a load in another layout reshard (and
    # tools/checkpoint_convert.py)
    layers = {"layer_numbers": [list(c.decoder.layer_numbers) for c in chunks]}
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict(), **layers}
    return {**{f"model{i}": c.state_dict() for i, c in enumerate(chunks)}, **layers}


def _sizes(train_state, ckpt):
    """The (TP, PP, EP, ETP) sizes that name this run's files."""
    return torch_shards.run_file_layout(ckpt.parallel, train_state.model_config)


def save(train_state, ckpt, root):
    """Save ``train_state`` under ``root`` (every rank calls it): each shard writer its
    file, every rank its RNG states, then one rank commits. ``ckpt.checkpoint`` says what
    (``--no-save-optim``) and which older checkpoint to keep (``--save-retain-interval``);
    each file saves ``train_state.args`` as its arguments."""
    checkpoint = ckpt.checkpoint
    st, it = train_state.parallel_state, train_state.iteration
    sizes = _sizes(train_state, ckpt)
    tmp = files.iteration_dir(root, it) + ".tmp"
    train_state.optimizer.finish_param_sync()
    # a collective with the distributed optimizer (its shards are gathered): every rank
    optimizer_state = None if checkpoint.no_save_optim else train_state.optimizer.state_dict()
    attempt = files.save_attempt(root, it)

    def write():
        if torch_shards.is_shard_writer(st, sizes):
            shard = os.path.join(tmp, torch_shards.own_shard_name(st, sizes))
            os.makedirs(shard, exist_ok=True)
            payload = {"iteration": it, "consumed_samples": train_state.consumed_samples,
                       "args": training_state.saved_arguments(train_state.args),
                       "opt_param_scheduler": train_state.scheduler.state_dict(),
                       "checkpoint_version": 3.0, **_model_states(train_state)}
            if optimizer_state is not None:
                payload["optimizer"] = optimizer_state
            else:
                payload["converted"] = True  # weights only: the schedule resumes, Adam starts fresh
            files.atomic_torch_save(payload, os.path.join(shard, torch_shards.SHARD_FILE))
        files.atomic_torch_save(training_state.rng_state(train_state),
                                os.path.join(tmp, "rng", f"rank_{st.global_rank:05d}.pt"))

    def commit():
        if st.global_rank == 0:
            files.commit_checkpoint(root, it, checkpoint.save_retain_interval)

    attempt.start()  # the ranks agree after each phase (where a barrier was)
    attempt.phase(write)
    attempt.phase(commit)


def own_file(train_state, ckpt, root, it):
    """The path of this rank's file of iteration ``it`` under ``root``, in this run's layout."""
    folder = files.iteration_dir(root, it)
    name = torch_shards.own_shard_name(train_state.parallel_state, _sizes(train_state, ckpt))
    return os.path.join(folder, name, torch_shards.SHARD_FILE)


def read_own_file(train_state, ckpt, root, it):
    """This rank's file of iteration ``it`` under ``root`` in this run's layout (or a
    namesake of another layout's), read; None when there is no file of that name."""
    path = own_file(train_state, ckpt, root, it)
    if not os.path.exists(path):
        return None
    return files.load_file(path, root, it, train_state.device,
                           keys=("args", "iteration", "consumed_samples"))


def saved_args(root, it):
    """The arguments the torch checkpoint of iteration ``it`` under ``root`` was saved with."""
    path = torch_shards.first_file(files.iteration_dir(root, it))
    return files.load_file(path, root, it, keys=("args",))["args"]


def load_own_file(train_state, ckpt, root, it, payload):
    """Load ``payload``, this rank's file of iteration ``it`` under ``root`` saved in this
    run's layout, into ``train_state``: weights, then the optimizer, schedule and RNG states
    as the checkpoint section (``ckpt.checkpoint``) allows and the TrainState has objects
    for. Returns (iteration, consumed samples)."""
    st, checkpoint, opt = train_state.parallel_state, ckpt.checkpoint, train_state.optimizer
    chunks = training_state.model_chunks(train_state)
    with_fp8 = training_state.loads_fp8(train_state, payload["args"])
    for i, chunk in enumerate(chunks):
        weights = payload["model"] if len(chunks) == 1 else payload[f"model{i}"]
        if not with_fp8:  # this run's FP8 buffers (fresh, or none) instead of the saved ones
            weights = {**fp8_state.without_fp8(weights),
                       **{k: v for k, v in chunk.state_dict().items()
                          if fp8_state.is_fp8_buffer(k)}}
        chunk.load_state_dict(weights)
    if opt is not None:
        opt.reload_model_params()  # fp32 main params follow the loaded weights
    if checkpoint.finetune:
        return 0, 0
    if payload.get("converted") or "opt_param_scheduler" not in payload:
        return training_state.resume_schedule_only(train_state, ckpt, root, it,
                                                   payload["iteration"],
                                                   payload["consumed_samples"])
    if not checkpoint.no_load_optim and opt is not None:
        training_state.check_optimizer_matches(payload["args"], ckpt.optimizer_config)
        if train_state.scheduler is not None:  # names the flags
            train_state.scheduler.load_state_dict(payload["opt_param_scheduler"])
        opt.load_state_dict(payload["optimizer"])
    if not checkpoint.no_load_rng:
        # a conversion to another layout (tools/checkpoint_convert.py) carries no RNG states
        training_state.load_rng(train_state, ckpt, root, it,
                                None if payload.get("no_rng") else payload["args"])
    if st.global_rank == 0:
        print(f" loaded checkpoint from {root} at iteration {it}", flush=True)
    return payload["iteration"], payload["consumed_samples"]


def load_resharded(train_state, ckpt, root, it):
    """Load the torch checkpoint of iteration ``it`` under ``root`` into ``train_state``, whose
    layout differs from the saved one: every rank reads it whole (:func:`read_torch_full`)
    and copies out its pieces, then restores the state as from any canonical tensors (the
    weights, Adam state, schedule, iteration and samples carry; the RNG states cannot follow
    the ranks into another layout). Returns (iteration, consumed samples)."""
    full, args, meta = read_torch_full(root, it)
    tensors = canonical_tensors(full, args, meta.get("optimizer"))
    return training_state.restore(train_state, ckpt, root, it, common_state(args, meta),
                                  lambda state: fill_from_full(state, tensors))
