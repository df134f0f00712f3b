"""``--ckpt-format torch_dist``: save a trainer's state with torch.distributed.checkpoint so
that ``--load`` restores it under any TP / PP / CP / DP / EP / ETP layout, with or without the
distributed optimizer.

Layout of one iteration's folder::

    iter_0000020/.metadata            DCP's index: every tensor's global shape and chunks
    iter_0000020/__<rank>_0.distcp    the chunks each rank wrote (in parallel)
    iter_0000020/common.pt            iteration, samples, arguments, schedule, loss scale
    iter_0000020/rng/rank_00005.pt    every rank's RNG states (restored under the same layout)
    iter_0000020/integrity.json       with --verify-integrity: every file's SHA-256 (integrity.py)

Tensors are keyed by canonical name (:mod:`megatron_cp.dist_checkpoint.canonical`):
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
save (checkpoint_faults.SaveAttempt) removes its files and raises on every rank; in the
background, at the next save or at the end of training.

A load first reads ``.metadata`` and checks that every file it indexes is there and long
enough (:func:`check_files`), so a truncated or corrupted file is a ValueError naming it (as
is one whose tensors cannot be decoded: DCP reads through checkpoint_faults.reader, which
names the file), never a raw DCP or unpickling traceback.
"""
import os
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_cp import checkpointing as ckpt
from megatron_cp import checkpoint_faults, faults
from megatron_cp.dist_checkpoint import integrity
from megatron_cp.dist_checkpoint.canonical import canonical_name, expert_param_spec, param_spec
from megatron_cp.dist_checkpoint.pieces import Pieces, PiecesLoadPlanner, PiecesSavePlanner
from megatron_cp.optimizer.inner import adam_step, set_adam_step

COMMON = "common.pt"
GROUP_SETTINGS = ("lr", "weight_decay", "betas", "eps", "momentum", "wd_mult", "lr_mult")
# what tells one param group from another (get_param_groups' key)
GROUP_KEY = ("optimizer", "wd_mult", "is_decoupled_lr")


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
    return ckpt.load_file(os.path.join(folder, COMMON), root, it,
                          keys=("iteration", "consumed_samples", "args", "has_optimizer"))


def check_files(folder):
    """Read the DCP index ``.metadata`` of ``folder`` and check that every file it names
    exists and holds the bytes it indexes; ValueError naming the first damaged file."""
    root, it = _root_and_iteration(folder)
    index = os.path.join(folder, ".metadata")
    try:
        needed = checkpoint_faults.distcp_index(folder)
    except Exception as error:  # unpickling errors, or an object of another shape
        raise ValueError(f"checkpoint index {index} cannot be read, it is truncated or corrupted "
                         f"({checkpoint_faults.short_reason(error)}); "
                         f"{ckpt._earlier(root, it)}") from error
    for name, end in sorted(needed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint file {path} (named in {index}) is missing; "
                             f"{ckpt._earlier(root, it)}")
        size = os.path.getsize(path)
        if size < end:
            raise ValueError(f"checkpoint file {path} is {size} bytes but {index} indexes {end}: "
                             f"it is truncated; {ckpt._earlier(root, it)}")


def _chunks(trainer):
    return [c.module if hasattr(c, "module") else c for c in trainer.model_chunks]


def _param_specs(trainer):
    """{id(param): (CanonicalSpec, is the last stage's tied copy)} for this rank's params."""
    st = trainer.state
    out = {}
    for chunk in _chunks(trainer):
        layers = list(chunk.decoder.layer_numbers)
        for name, param in chunk.named_parameters():
            tied_copy = name == "output_layer.weight" and getattr(param, "shared_embedding", False)
            canon = "embedding.word_embeddings.weight" if tied_copy else canonical_name(name, layers)
            if getattr(param, "is_expert", False):
                spec = expert_param_spec(canon, param, st.size("ep"), st.rank("ep"),
                                         st.size("etp"), st.rank("etp"))
            else:
                spec = param_spec(canon, param, st.size("tp"), st.rank("tp"),
                                  trainer.config.vocab_size)
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


def sharded_state(trainer, with_optimizer, for_load=False):
    """``{key: Pieces}`` of this rank: live views of the model params and, with
    ``with_optimizer``, of the optimizer shards. ``for_load`` includes the tied copy (it
    reads the embedding's key); a save leaves it out."""
    specs = _param_specs(trainer)
    state = {}

    def put(key, spec, flat, start, stop):
        if key in state:
            raise AssertionError(f"two pieces of {key} on one rank")
        state[key] = Pieces.of_flat(spec, flat, start, stop)

    for chunk in _chunks(trainer):
        for param in chunk.parameters():
            spec, tied_copy = specs[id(param)]
            if for_load or not tied_copy:
                put(f"model.{spec.name}", spec, param.detach().view(-1), 0, param.numel())
        for canon, buffer in _persistent_buffers(chunk):
            put(f"model.{canon}", param_spec(canon, buffer, 1, 0), buffer.view(-1), 0,
                buffer.numel())
    if with_optimizer:
        for shard in trainer.optimizer.param_shards():
            spec, tied_copy = specs[id(shard.model_param)]
            if tied_copy and not for_load:
                continue
            for kind, flat in {**shard.state, "main_param": shard.main}.items():
                if flat is not None:
                    put(f"optimizer.{kind}.{spec.name}", spec, flat, shard.start, shard.stop)
    return state


def _common(trainer, with_optimizer):
    """The non-tensor state; a collective (the Adam step count is agreed by every rank)."""
    opt = trainer.optimizer
    step = torch.tensor([adam_step(opt.optimizer)], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a distributed-optimizer rank may own nothing
    args = {k: v for k, v in vars(trainer.args).items() if ckpt._plain(v)}
    args["params_dtype"] = str(trainer.args.params_dtype)
    common = {"iteration": trainer.iteration, "consumed_samples": trainer.consumed_samples,
              "args": args, "checkpoint_version": 3.0, "ckpt_format": "torch_dist",
              "layout": ckpt.rank_grid(trainer.args), "has_optimizer": with_optimizer,
              "opt_param_scheduler": trainer.scheduler.state_dict()}
    if with_optimizer:
        common.update(adam_step=step.item(), num_skipped_iters=opt.num_skipped_iters,
                      grad_scaler=None if opt.grad_scaler is None else opt.grad_scaler.state_dict(),
                      param_groups=[{k: v for k, v in g.items() if k != "params"}
                                    for g in opt.optimizer.param_groups])
    return common


def checkpoint_group(trainer):
    """A gloo group over every rank for checkpoint coordination (created once, collectively),
    so a background save never shares a communicator with training."""
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


def wait_for_async_save(trainer):
    """Block until the background save in flight (if any) has written and committed."""
    pending, trainer.pending_save = getattr(trainer, "pending_save", None), None
    if pending is not None:
        pending.wait()


def save(trainer, root, async_save=False):
    """Save ``trainer`` under ``root`` (every rank calls it); see the module docstring."""
    st, args = trainer.state, trainer.args
    wait_for_async_save(trainer)
    trainer.optimizer.finish_param_sync()
    with_optimizer = not getattr(args, "no_save_optim", False)
    state = sharded_state(trainer, with_optimizer)
    common = _common(trainer, with_optimizer)
    rng = None if getattr(args, "no_save_rng", False) else ckpt._rng_state(trainer)
    it = trainer.iteration
    tmp = ckpt.iteration_dir(root, it) + ".tmp"
    group = checkpoint_group(trainer)
    attempt = ckpt.save_attempt(root, it, group)
    attempt.start()  # the ranks agree after each phase (where a barrier was)
    if async_save:
        state = {key: pieces.staged() for key, pieces in state.items()}

    def write_files():
        dcp.save(state, storage_writer=checkpoint_faults.writer(tmp),
                 planner=PiecesSavePlanner(), process_group=group)
        if rng is not None:
            ckpt._atomic_torch_save(rng, os.path.join(tmp, "rng", f"rank_{st.global_rank:05d}.pt"))
        if st.global_rank == 0:
            ckpt._atomic_torch_save(common, os.path.join(tmp, COMMON))

    def commit():  # every rank has written: only now may the tracker move
        if st.global_rank == 0:
            if args.verify_integrity:
                integrity.write_manifest(tmp)
            ckpt.commit_checkpoint(root, it, getattr(args, "save_retain_interval", None))

    def write():
        attempt.phase(write_files)
        attempt.phase(commit)

    if async_save:
        trainer.pending_save = AsyncSave(write)
    else:
        write()


def load(trainer, root, it):
    """Load the torch_dist checkpoint of iteration ``it`` under ``root`` into ``trainer``,
    whatever layout saved it; returns (iteration, consumed samples)."""
    folder = ckpt.iteration_dir(root, it)
    if trainer.args.verify_integrity:  # before a byte of it is read
        integrity.verify(folder, checkpoint_group(trainer), ckpt._earlier(root, it))
    common = read_common(folder)

    def read(state):
        check_files(folder)
        try:
            dcp.load(state, storage_reader=checkpoint_faults.reader(folder),
                     planner=PiecesLoadPlanner(), process_group=checkpoint_group(trainer))
        except (Exception, CheckpointException) as error:  # DCP gathers every rank's read error
            if faults.is_lost_contact(error):
                raise
            found = checkpoint_faults.find(error, checkpoint_faults.UnreadableFile)
            damage = (str(found[1]) if found else f"the tensors of checkpoint {folder} cannot be "
                      f"read ({checkpoint_faults.short_reason(error)})")
            raise ValueError(f"{damage}; {ckpt._earlier(root, it)}") from error

    return load_state(trainer, root, it, common, read)


def load_state(trainer, root, it, common, read):
    """Load a checkpoint held as canonical tensors into ``trainer``: ``common`` is its
    non-tensor state (as :func:`_common` writes it), ``read(state)`` fills this rank's
    :func:`sharded_state` (``{key: Pieces}``) from its tensors, whichever layout saved them.
    Returns (iteration, consumed samples)."""
    st, args = trainer.state, trainer.args
    ckpt.check_args_match(common["args"], args)
    wait_for_async_save(trainer)
    trainer.optimizer.finish_param_sync()
    with_optimizer = common["has_optimizer"] and not args.finetune and not args.no_load_optim
    if with_optimizer:
        ckpt.check_optimizer_matches(common["args"], args)
    read(sharded_state(trainer, with_optimizer, for_load=True))
    if not with_optimizer:
        trainer.optimizer.reload_model_params()
    if args.finetune:
        return 0, 0
    if not common["has_optimizer"]:
        return ckpt.resume_schedule_only(trainer, root, it, common["iteration"],
                                         common["consumed_samples"])
    if with_optimizer:
        trainer.scheduler.load_state_dict(common["opt_param_scheduler"])
        _restore_optimizer(trainer.optimizer, common)
    if not args.no_load_rng:
        ckpt.load_rng(trainer, root, it, common.get("layout"))
    if st.global_rank == 0:
        print(f" loaded checkpoint from {root} at iteration {it}", flush=True)
    return common["iteration"], common["consumed_samples"]


def _group_key(group):
    return tuple(group.get(k, default) for k, default in zip(GROUP_KEY, ("adam", 1.0, False)))


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
