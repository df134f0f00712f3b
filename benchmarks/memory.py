"""Distributed-optimizer memory per rank, and checkpoint save/load time: torch vs torch_dist.

Part 1 (memory): for DP = 1, 2, 4 (pure data parallelism, one gloo process per rank) a
model trains one step with and without --use-distributed-optimizer, in fp32 and bf16, and
the bytes each rank holds in model params, gradient buffers, fp32 main params and Adam
moments (``megatron_cp.optimizer.memory_breakdown``: the tensors' own sizes, bucket padding
included) are compared with the formula: fp32 8 + 8/d (16 replicated), bf16 6 + 12/d (18).
Goal: every measurement within 1% of the formula.

Part 2 (checkpoints): a GPT of a few hundred MB (12 layers, hidden 768: ~86M params, 345 MB
of fp32 weights, ~1 GB with the Adam state) trains one step at DP=2 with the distributed
optimizer, then saves and loads once in each format: ``torch`` (the optimizer shards are
gathered to DP rank 0, which writes one file) and ``torch_dist`` (both ranks write their own
shards in parallel), and saves once with ``--async-save`` (the time the training thread is
stalled: staging copies, versus the background write). Loads read right after the saves,
so mostly from the page cache. Goal: the async save stalls training for at most 50% of a
synchronous torch_dist save.

    PYTHONPATH=.:tests python benchmarks/memory.py [--output benchmarks/results/memory.json] [--quick]

The JSON goes to runs/benchmarks/memory.json (untracked) unless --output says otherwise.
"""
import argparse
import dataclasses
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

from bench_common import RESULTS_DIR, add_output_argument, verdict, write_json
from dist_harness import run_workers

MEMORY_MODEL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 64 "
                "--micro-batch-size 1 --global-batch-size 4 --mock-data --vocab-size 1000 "
                "--lr 1e-4 --train-iters 1 --eval-iters 0 --log-interval 100 --seed 3")
CHECKPOINT_MODEL = ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 128 "
                    "--micro-batch-size 1 --global-batch-size 2 --mock-data --vocab-size 2000 "
                    "--lr 1e-4 --train-iters 100 --eval-iters 0 --log-interval 100 --seed 3 "
                    "--use-distributed-optimizer")
MEMORY_TOLERANCE = 0.01
GOAL_STALL = 0.5  # async stall / synchronous torch_dist save


def _trainer(world, argv):
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.training import Trainer
    from megatron_cp.startup import build_parallel_state, run_config
    args = parse_args(argv.split(), world_size=world)
    run = run_config(args)
    state = build_parallel_state(run.parallel, run.model, run.optimizer, torch.device("cpu"))
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    return trainer


def _memory_worker(rank, world, configs):
    from megatron_cp.optimizer import memory_breakdown
    out = {}
    for name, extra in configs.items():
        trainer = _trainer(world, f"{MEMORY_MODEL} {extra}")
        trainer.train_step()
        out[name] = memory_breakdown(trainer.model_chunks, trainer.optimizer)
    return out


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _save_as(trainer, ckpt_format, async_save):
    """Point ``trainer``'s checkpoint section at ``ckpt_format`` (and ``--async-save``), and
    its Checkpointer with it."""
    from megatron_cp.checkpoint.checkpointer import Checkpointer
    checkpoint = dataclasses.replace(trainer.run.checkpoint, ckpt_format=ckpt_format,
                                     async_save=async_save)
    trainer.run = dataclasses.replace(trainer.run, checkpoint=checkpoint)
    trainer.checkpointer.wait_for_async_save()
    trainer.checkpointer = Checkpointer(checkpoint, trainer.run.parallel, trainer.run.optimizer)


def _checkpoint_worker(rank, world, model, folder):
    trainer = _trainer(world, model)
    trainer.train_step()
    step = _timed(trainer.train_step)
    out = {"params": sum(p.numel() for p in trainer.model.parameters()), "train_step_s": step}
    for fmt in ("torch", "torch_dist"):
        root = os.path.join(folder, fmt)
        _save_as(trainer, fmt, False)
        out[f"{fmt}_save_s"] = _timed(lambda: trainer.checkpointer.save(trainer.train_state(), root))
        out[f"{fmt}_bytes"] = _dir_bytes(root) if rank == 0 else None
        out[f"{fmt}_load_s"] = _timed(lambda: trainer.checkpointer.load(trainer.train_state(), root))
    _save_as(trainer, "torch_dist", True)
    root = os.path.join(folder, "async")
    dist.barrier()
    start = time.perf_counter()
    trainer.checkpointer.save(trainer.train_state(), root)
    out["async_stall_s"] = time.perf_counter() - start  # training may go on from here
    out["async_step_during_write_s"] = time.perf_counter()
    trainer.train_step()  # a step while the background write runs
    out["async_step_during_write_s"] = time.perf_counter() - out["async_step_during_write_s"]
    trainer.checkpointer.wait_for_async_save()
    out["async_total_s"] = time.perf_counter() - start
    dist.barrier()
    return out


def _memory_rows(quick):
    configs = {f"{dtype}_{opt}": f"{flag} {opt_flag}"
               for dtype, flag in (("fp32", ""), ("bf16", "--bf16"))
               for opt, opt_flag in (("distributed", "--use-distributed-optimizer"), ("replicated", ""))}
    from megatron_cp.optimizer import expected_bytes_per_param
    rows = []
    for d in ((1, 2) if quick else (1, 2, 4)):
        results = run_workers(_memory_worker, d, configs, timeout=600)
        for name, measured in results[0].items():
            dtype, opt = name.split("_")
            formula = expected_bytes_per_param(torch.bfloat16 if dtype == "bf16" else torch.float32,
                                               d, opt == "distributed")
            worst = max(r[name]["bytes_per_param"] for r in results)
            rows.append({"dp": d, "dtype": dtype, "optimizer": opt, "formula": formula,
                         "measured": worst, "params_per_rank": measured["num_params"],
                         **{k: measured[k] for k in ("params", "grads", "main_params",
                                                     "optimizer_state")},
                         "ok": abs(worst - formula) <= MEMORY_TOLERANCE * formula})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_argument(parser, "memory")
    parser.add_argument("--quick", action="store_true",
                        help="DP 1 and 2 only, and a 4-layer model for the checkpoint part")
    a = parser.parse_args(argv)
    memory = _memory_rows(a.quick)
    print(f"{'DP':>3} {'dtype':>5} {'optimizer':>12} {'formula B/param':>16} {'measured':>9} "
          f"{'params':>10} {'grads':>10} {'main':>10} {'Adam':>10}")
    for r in memory:
        print(f"{r['dp']:>3} {r['dtype']:>5} {r['optimizer']:>12} {r['formula']:>16.3f} "
              f"{r['measured']:>9.3f} {r['params']:>10} {r['grads']:>10} {r['main_params']:>10} "
              f"{r['optimizer_state']:>10}")
    folder = os.path.join(RESULTS_DIR, "memory_checkpoints")
    shutil.rmtree(folder, ignore_errors=True)
    model = CHECKPOINT_MODEL.replace("--num-layers 12", "--num-layers 4") if a.quick else CHECKPOINT_MODEL
    try:
        ck = run_workers(_checkpoint_worker, 2, model, folder, timeout=1200)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stall = ck["async_stall_s"] / ck["torch_dist_save_s"]
    print(f"\ncheckpoints of a {ck['params'] / 1e6:.1f}M-parameter GPT (DP=2, distributed optimizer; "
          f"one train step {ck['train_step_s']:.2f} s):")
    print(f"{'format':>12} {'size (MB)':>10} {'save (s)':>9} {'load (s)':>9}")
    for fmt in ("torch", "torch_dist"):
        print(f"{fmt:>12} {ck[f'{fmt}_bytes'] / 2**20:>10.0f} {ck[f'{fmt}_save_s']:>9.2f} "
              f"{ck[f'{fmt}_load_s']:>9.2f}")
    print(f"async torch_dist save: training stalled {ck['async_stall_s']:.2f} s "
          f"({stall:.0%} of a synchronous save), background write done after "
          f"{ck['async_total_s']:.2f} s, a train step during the write took "
          f"{ck['async_step_during_write_s']:.2f} s")
    memory_ok = all(r["ok"] for r in memory)
    passed = memory_ok and stall <= GOAL_STALL
    print(f"memory within {MEMORY_TOLERANCE:.0%} of the formula: {verdict(memory_ok)}; async stall "
          f"<= {GOAL_STALL:.0%} of a synchronous save: {verdict(stall <= GOAL_STALL)}")
    print(verdict(passed))
    write_json(a.output, {"memory": memory, "checkpoint": ck, "async_stall_fraction": stall,
                          "goals": {"memory_tolerance": MEMORY_TOLERANCE, "async_stall": GOAL_STALL},
                          "passed": passed, "quick": a.quick})
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
