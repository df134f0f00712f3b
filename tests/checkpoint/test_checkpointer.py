"""The Checkpointer (megatron_cp/checkpoint/checkpointer.py) owns what lives between saves, and
a load fills only what its TrainState holds.

- Two --async-save saves in a row: the second waits for the first (committed, the tracker at
  its iteration) before it starts; the checkpoint group is created once, on the first save,
  and serves every later save and load.
- A TrainState without optimizer, schedule or rerun machine (a model alone, as inference
  loads one) loads the weights of a full checkpoint, torch and torch_dist alike, under a
  checkpoint section that asks for everything: the weights are the saved ones, nothing else
  is touched (a fresh optimizer and schedule beside it stay fresh), and the progress comes
  back. Saving such a TrainState is refused before a file is written.
"""
import os
import time

import torch
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.checkpoint import dcp_files, files
from megatron_cp.checkpoint.train_state import TrainState
from megatron_cp.optimizer.inner import adam_step
from training_utils import TINY, trainer_of

ASYNC = f"{TINY} --train-iters 4 --ckpt-format torch_dist --async-save"


def _two_async_saves(rank, world, root):
    created = []
    real_group = dist.new_group

    def new_group(*a, **kw):
        created.append(kw.get("backend"))
        return real_group(*a, **kw)

    dist.new_group = new_group
    real_init = dcp_files.AsyncSave.__init__

    def slow_init(self, target):  # the background write takes its time
        def slowly():
            time.sleep(0.5)
            target()
        real_init(self, slowly)

    dcp_files.AsyncSave.__init__ = slow_init
    trainer = trainer_of(ASYNC, world)
    ckpt = trainer.checkpointer
    trainer.train_step()
    before = len(created)
    ckpt.save(trainer.train_state(), root)
    pending_after_first = ckpt.async_save_pending
    tracker_after_first = files.read_tracker(root)  # still being written
    trainer.train_step()
    ckpt.save(trainer.train_state(), root)  # waits for the first, then writes in the background
    tracker_after_second = files.read_tracker(root)
    first_folder = os.path.isdir(files.iteration_dir(root, 1))
    ckpt.wait_for_async_save()
    tracker_at_end = files.read_tracker(root)
    made = created[before:]
    group = ckpt.group()
    fresh = trainer_of(ASYNC, world)
    iteration, _ = fresh.checkpointer.load(fresh.train_state(), root)
    return (pending_after_first, tracker_after_first, tracker_after_second, first_folder,
            tracker_at_end, ckpt.async_save_pending, group is ckpt.group(), made, iteration)


def test_a_second_async_save_waits_for_the_first_and_the_group_is_made_once(tmp_path):
    for out in run_workers(_two_async_saves, 2, str(tmp_path)):
        (pending, after_first, after_second, first_folder, at_end, pending_at_end, same_group,
         made, iteration) = out
        assert pending and after_first is None  # the first save runs in the background
        assert after_second == 1 and first_folder  # the second waited for it
        assert at_end == 2 and not pending_at_end
        assert same_group and made == ["gloo"]  # one group, made by the first save
        assert iteration == 2


def _weights(chunks):
    return {n: p.detach().clone() for c in chunks
            for n, p in getattr(c, "module", c).named_parameters()}


def _load_into_a_bare_model(rank, world, argv, root):
    saver = trainer_of(argv, world)
    for _ in range(3):  # past the warm-up's first step (learning rate 0)
        saver.train_step()
    saver.checkpointer.save(saver.train_state(), root)
    saver.checkpointer.wait_for_async_save()
    saved = _weights(saver.model_chunks)

    loader = trainer_of(argv, world)
    before = _weights(loader.model_chunks)
    inner = loader.optimizer.optimizer
    state_before, steps_before = len(inner.state), loader.scheduler.num_steps
    bare = TrainState(model_chunks=loader.model_chunks, parallel_state=loader.state,
                      model_config=loader.config, args=loader.args)
    progress = loader.checkpointer.load(bare, root)
    loaded = _weights(loader.model_chunks)
    same = all(torch.equal(loaded[n], saved[n]) for n in saved)
    moved = any(not torch.equal(before[n], saved[n]) for n in saved)
    untouched = (loader.scheduler.num_steps == steps_before and state_before == 0
                 and len(inner.state) == 0 and adam_step(inner) == 0
                 and adam_step(saver.optimizer.optimizer) == 3)
    try:
        loader.checkpointer.save(bare, root + "_bare")
        refused = None
    except ValueError as error:
        refused = str(error)
    return same, moved, untouched, progress, refused, os.path.exists(root + "_bare")


def test_a_train_state_without_optimizer_loads_the_weights_and_nothing_else(tmp_path):
    for fmt in ("torch", "torch_dist"):
        argv = f"{TINY} --train-iters 4 --ckpt-format {fmt} --use-distributed-optimizer"
        root = str(tmp_path / fmt)
        for same, moved, untouched, progress, refused, written in run_workers(
                _load_into_a_bare_model, 2, argv, root):
            assert same and moved, fmt  # the saved weights, which differ from the fresh ones
            assert untouched, fmt
            assert progress == (3, 24), fmt
            assert refused and "optimizer" in refused and not written, fmt
