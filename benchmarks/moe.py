"""MoE: training throughput at EP = 1, 2, 4, the bytes the all-to-all dispatcher moves against
the formula, and grouped expert matmuls against the per-expert loop (and, on a GPU, against
one dense matmul of the same FLOPs).

Part 1 (training): a small Llama-style MoE GPT (8 experts, top-2, ``--moe-token-dispatcher-type
alltoall``, every layer MoE) trains through ``megatron_cp.training.pretrain`` (the real loop,
parsed arguments, mock data) on gloo, one process per rank and ``--threads-per-rank`` threads
each, at EP = 1, 2, 4 with world = EP = DP and the same global batch. A step's time is the
slowest rank's ``Trainer.train_step`` (forward, backward, gradient all-reduce, Adam); tokens/s
= global batch tokens / median step time after the warm-up steps, and the ratio is to EP=1
of the same run. Goal: EP=2 at least 1.0x EP=1 (two ranks, each with half the experts and
half the batch, are not slower than one rank doing it all), checked where the machine has a
core for each thread of EP=2; EP=4 is shown for reference (on a 2-core machine its 4 ranks
share 2 cores).

Part 2 (dispatcher bytes): in the same runs every rank counts the bytes it sends to other
ranks through ``torch.distributed.all_to_all_single`` (token rows, and the small int64 count
exchanges apart) and records the routing map of every dispatcher call. A rank r sends, per
MoE layer call, the rows of its own (token, expert) pairs whose expert lives on another EP
rank (S_out, dispatch) and the rows it received for its own experts back (S_in, combine);
backward sends the gradients of both the other way, so the exact formula is::

    bytes sent by rank r = sum over calls of 2 (S_out + S_in) x h x element size

counted from the routing maps of all ranks. Goal: equal to the measured bytes, exactly, for
every rank and every timed step. For reference, uniform routing expects
``S_out = S_in = T k (EP-1)/EP`` rows per call (T tokens of a microbatch), i.e.
``4 T k (EP-1)/EP x h x bytes`` per layer and microbatch.

Part 3 (grouped matmul): ``megatron_cp.moe.experts.grouped_linear`` (one
``torch.nn.functional.grouped_mm`` call) against its per-expert loop (what runs where
grouped_mm does not apply: one ``F.linear`` per expert over ``weight.unbind(0)``), forward +
backward, on expert shapes (rows spread at random over the experts), fp32 and bf16. On the
CPU: one thread, the thread's CPU time, min over repeats (the box is shared). Goal, for every
shape and dtype where grouped_mm supports the case: grouped no slower than the loop within
timing noise (>= 0.95x: for large experts both do the same matmuls, so parity is expected;
many small experts are where one call wins).

Part 4 (``--device cuda``, bf16): the same grouped calls in TFLOP/s against ONE dense
``torch.mm`` of [rows, in] x [in, out] (same FLOPs), forward + backward, wall time between
device synchronizations. Goal: grouped >= 80% of the dense TFLOP/s. With ``--device cuda``
parts 3 and 4 run on the GPU; parts 1 and 2 stay on gloo CPU ranks (one GPU cannot hold
several NCCL ranks).

    python benchmarks/moe.py                       # parts 1-3 on this machine
    python benchmarks/moe.py --device cuda         # parts 3-4 on the GPU (and 1-2 on CPU)
    python benchmarks/moe.py --smoke               # tiny sizes: the script's logic (< 40 s)

``--smoke`` figures mean nothing: it also runs part 4's code on the CPU, and exits non-zero
only if the exact byte count fails. The JSON goes to runs/benchmarks/moe.json (untracked)
unless --output says otherwise.
"""
import argparse
import contextlib
import datetime
import io
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_common import add_output_argument, min_thread_time, verdict, write_json
from megatron_cp.distributed import device as device_mod
import megatron_cp.moe.experts

experts_mod = megatron_cp.moe.experts

GOAL_EP2 = 1.0  # tokens/s of EP=2 over EP=1
GOAL_GROUPED = 0.95  # grouped matmul speed over grouped_linear's per-expert loop (noise allowed)
GOAL_DENSE = 0.8  # grouped TFLOP/s over one dense matmul of the same FLOPs (GPU)

MODEL = dict(layers=2, hidden=256, heads=8, seq=256, experts=8, topk=2, moe_ffn=512,
             micro_batch=2, global_batch=8, vocab=1024, warmup=3, steps=8)
MODEL_SMOKE = dict(layers=2, hidden=64, heads=4, seq=64, experts=8, topk=2, moe_ffn=128,
                   micro_batch=2, global_batch=4, vocab=256, warmup=1, steps=2)
EP_SIZES, EP_SMOKE = (1, 2, 4), (1, 2)
# (experts, routed rows, in features, out features): fc1 and fc2 of 8 experts at h 1024,
# ffn 2816; a fine-grained 64-expert fc1; a small layer where per-call costs show
MATMUL_SHAPES = [(8, 4096, 1024, 2816), (8, 4096, 2816, 1024), (64, 4096, 1024, 256),
                 (8, 1024, 256, 704)]
MATMUL_SMOKE = [(8, 256, 64, 176), (4, 64, 32, 48)]


# ----------------------------------------------------------------------------- processes
def _entry(fn, rank, world, store, args, results, timeout):
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world, *args, timeout=600):
    """``fn(rank, world, *args)`` on ``world`` spawned gloo processes; their return values in
    rank order. A failing rank raises its traceback here, as does a wait of ``timeout``
    seconds with no rank finishing; the ranks left are then killed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, args, results, timeout),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        done = {}
        try:
            while len(done) < world:
                try:
                    rank, ok, payload = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(done))
                    raise RuntimeError(f"ranks {missing} of {world} did not finish within "
                                       f"{timeout} s") from None
                if not ok:
                    raise RuntimeError(f"rank {rank} of {world} failed:\n{payload}")
                done[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=5 if len(done) == world else 0.5)
                if p.is_alive():
                    p.kill()
    return [done[r] for r in range(world)]


# ----------------------------------------------------------------------------- parts 1 + 2
def training_argv(m, ep):
    """pretrain's flags: the MoE model ``m`` at EP = DP = ``ep``."""
    flags = (f"--num-layers {m['layers']} --hidden-size {m['hidden']} "
             f"--num-attention-heads {m['heads']} --seq-length {m['seq']} "
             f"--max-position-embeddings {m['seq']} --micro-batch-size {m['micro_batch']} "
             f"--global-batch-size {m['global_batch']} --train-iters {m['warmup'] + m['steps']} "
             f"--lr 1e-4 --eval-iters 0 --log-interval 1000 --hidden-dropout 0 "
             f"--attention-dropout 0 --mock-data --tokenizer-type NullTokenizer "
             f"--vocab-size {m['vocab'] - 1} --normalization RMSNorm --swiglu "
             f"--disable-bias-linear --position-embedding-type rope "
             f"--untie-embeddings-and-output-weights --num-experts {m['experts']} "
             f"--moe-router-topk {m['topk']} --moe-ffn-hidden-size {m['moe_ffn']} "
             f"--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 "
             f"--expert-model-parallel-size {ep} --distributed-backend gloo --seed 5")
    return flags.split()


def _instrument(record):
    """Count, per train step, the bytes this rank sends to other ranks by all_to_all_single
    and the routing map of every all-to-all dispatcher call; time each train step."""
    from megatron_cp import training
    from megatron_cp.moe import dispatcher

    a2a = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):
        size, me = dist.get_world_size(group), dist.get_rank(group)
        splits = list(input_split_sizes) if input_split_sizes else [input.shape[0] // size] * size
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        kind = "row_bytes" if input.is_floating_point() else "count_bytes"
        record["step"][kind] += (sum(splits) - splits[me]) * row
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group,
                   async_op=async_op)

    dispatch = dispatcher.AllToAllDispatcher.__call__

    def recorded(self, tokens, probs, routing_map, experts):
        record["step"]["calls"].append(routing_map.sum(dim=0).tolist())  # [E] pairs per expert
        return dispatch(self, tokens, probs, routing_map, experts)

    train_step = training.Trainer.train_step

    def timed(self):
        record["step"] = {"row_bytes": 0, "count_bytes": 0, "calls": []}
        start = time.perf_counter()
        out = train_step(self)
        record["step"]["seconds"] = time.perf_counter() - start
        record["steps"].append(record["step"])
        return out

    dist.all_to_all_single = counted
    dispatcher.AllToAllDispatcher.__call__ = recorded
    training.Trainer.train_step = timed


def _train_worker(rank, world, argv, threads):
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.training import pretrain
    from megatron_cp.startup import build_parallel_state, run_config
    torch.set_num_threads(threads)
    args = parse_args(argv, world_size=world)
    run = run_config(args)
    state = build_parallel_state(run.parallel, run.model, run.optimizer, torch.device("cpu"))
    record = {"steps": [], "step": {"row_bytes": 0, "count_bytes": 0, "calls": []}}
    _instrument(record)
    with contextlib.redirect_stdout(io.StringIO()):  # the banner and log lines of rank 0
        losses = pretrain(args, state)
    return {"steps": record["steps"], "losses": losses,
            "element_size": torch.empty((), dtype=args.params_dtype).element_size()}


def exact_bytes(calls_by_rank, rank, ep, hidden, element_size):
    """Bytes ``rank`` sends in one step by the module docstring's formula, from every rank's
    [E] pair counts of each dispatcher call (the same calls in the same order on each rank)."""
    experts = len(calls_by_rank[rank][0]) if calls_by_rank[rank] else 0
    local = experts // ep
    mine = slice(rank * local, (rank + 1) * local)
    rows = 0
    for c, own in enumerate(calls_by_rank[rank]):
        s_out = sum(own) - sum(own[mine])
        s_in = sum(sum(calls_by_rank[q][c][mine]) for q in range(ep) if q != rank)
        rows += 2 * (s_out + s_in)
    return rows * hidden * element_size


def training_rows(m, ep_sizes, threads, timeout):
    rows = []
    tokens = m["global_batch"] * m["seq"]
    for ep in ep_sizes:
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        results = launch(_train_worker, ep, training_argv(m, ep), threads, timeout=timeout)
        steps = [r["steps"][m["warmup"]:] for r in results]
        seconds = [max(s[i]["seconds"] for s in steps) for i in range(len(steps[0]))]
        element_size = results[0]["element_size"]
        microbatches = m["global_batch"] // (m["micro_batch"] * ep)
        calls = microbatches * m["layers"]
        uniform = 4 * calls * m["micro_batch"] * m["seq"] * m["topk"] * (ep - 1) / ep \
            * m["hidden"] * element_size
        exact, measured = [], []
        for i in range(len(seconds)):
            by_rank = [s[i]["calls"] for s in steps]
            exact.append([exact_bytes(by_rank, r, ep, m["hidden"], element_size) for r in range(ep)])
            measured.append([s[i]["row_bytes"] for s in steps])
        median = statistics.median(seconds)
        rows.append({"ep": ep, "world": ep, "dp": ep, "step_seconds": seconds,
                     "median_step_seconds": median, "tokens_per_s": tokens / median,
                     "final_loss": results[0]["losses"][-1],
                     "dispatcher_calls_per_step": len(steps[0][-1]["calls"]),
                     "expected_calls_per_step": calls,
                     "rank0_last_step": {"measured_row_bytes": measured[-1][0],
                                         "exact_row_bytes": exact[-1][0],
                                         "uniform_row_bytes": uniform,
                                         "count_bytes": steps[0][-1]["count_bytes"]},
                     "measured_row_bytes": measured, "exact_row_bytes": exact,
                     "bytes_exact": measured == exact, "wall_seconds": time.perf_counter() - started,
                     "load_average_1min": [load_before, os.getloadavg()[0]]})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_ep1"] = r["tokens_per_s"] / base
    return rows


# ----------------------------------------------------------------------------- parts 3 + 4
@contextlib.contextmanager
def loop_only():
    """grouped_linear takes its own per-expert loop (as where grouped_mm does not apply)."""
    supported = experts_mod.grouped_mm_supported
    experts_mod.grouped_mm_supported = lambda x, weight: False
    try:
        yield
    finally:
        experts_mod.grouped_mm_supported = supported


def timed(fn, device, repeats, warmup=1, inner=1):
    """Seconds per call of ``fn``: the thread's CPU time on the CPU, wall time between device
    synchronizations on a GPU (min over ``repeats`` rounds of ``inner`` calls)."""
    if device.type == "cpu":
        return min_thread_time(fn, repeats, warmup)
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        device_mod.synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        device_mod.synchronize(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def _rel_diff(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def matmul_row(shape, dtype, device, repeats, dense):
    """Forward + backward seconds of one expert shape: grouped_linear (grouped_mm), its
    per-expert loop, and (``dense``) one ``torch.mm`` of the same FLOPs."""
    experts, rows, n_in, n_out = shape
    gen = torch.Generator().manual_seed(sum(shape))
    counts = torch.bincount(torch.randint(experts, (rows,), generator=gen), minlength=experts).tolist()
    x = torch.randn(rows, n_in, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(experts, n_out, n_in, generator=gen) * n_in ** -0.5).to(device, dtype) \
        .requires_grad_()
    g = torch.randn(rows, n_out, generator=gen).to(device, dtype)
    flops = 3 * 2 * rows * n_in * n_out  # forward + the two backward matmuls
    row = {"experts": experts, "rows": rows, "in": n_in, "out": n_out,
           "dtype": str(dtype).split(".")[-1], "counts_min": min(counts),
           "counts_max": max(counts), "flops": flops,
           "grouped_mm": experts_mod.grouped_mm_supported(x, w)}
    inner = 10 if device.type == "cuda" else 1

    def run(linear):
        return lambda: torch.autograd.grad(linear(x, w, counts), (x, w), g)

    if row["grouped_mm"]:
        with torch.no_grad(), loop_only():
            reference = experts_mod.grouped_linear(x, w, counts)
        with torch.no_grad():
            row["max_rel_diff"] = _rel_diff(experts_mod.grouped_linear(x, w, counts), reference)
        row["grouped_s"] = timed(run(experts_mod.grouped_linear), device, repeats, inner=inner)
    with loop_only():
        row["loop_s"] = timed(run(experts_mod.grouped_linear), device, repeats, inner=inner)
    if row["grouped_mm"]:
        row["grouped_vs_loop"] = row["loop_s"] / row["grouped_s"]
        row["grouped_tflops"] = flops / row["grouped_s"] / 1e12
    if dense:
        a = torch.randn(rows, n_in, generator=gen).to(device, dtype).requires_grad_()
        b = (torch.randn(n_in, n_out, generator=gen) * n_in ** -0.5).to(device, dtype) \
            .requires_grad_()
        row["dense_s"] = timed(lambda: torch.autograd.grad(torch.mm(a, b), (a, b), g), device,
                               repeats, inner=inner)
        row["dense_tflops"] = flops / row["dense_s"] / 1e12
        if row["grouped_mm"]:
            row["grouped_vs_dense"] = row["grouped_tflops"] / row["dense_tflops"]
    return row


def matmul_rows(shapes, dtypes, device, repeats, dense):
    return [matmul_row(shape, dtype, device, repeats, dense) for dtype in dtypes for shape in shapes]


# ----------------------------------------------------------------------------- main
def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def print_training(rows, m, threads):
    print(f"MoE GPT training through pretrain (gloo, {threads} thread(s) per rank, {_cores()} cores): "
          f"{m['layers']} layers, h {m['hidden']}, seq {m['seq']}, {m['experts']} experts top-"
          f"{m['topk']} (ffn {m['moe_ffn']}, SwiGLU), alltoall, global batch {m['global_batch']} "
          f"x {m['seq']} tokens; median of {m['steps']} steps after {m['warmup']}")
    print(f"{'EP=DP':>5} {'step ms':>9} {'tokens/s':>10} {'vs EP=1':>8} {'final loss':>10} "
          f"{'load avg (before-after)':>24}")
    for r in rows:
        load = "{:.1f}-{:.1f}".format(*r["load_average_1min"])
        print(f"{r['ep']:>5} {r['median_step_seconds'] * 1e3:>9.1f} {r['tokens_per_s']:>10.0f} "
              f"{r['vs_ep1']:>7.2f}x {r['final_loss']:>10.4f} {load:>24}")
    print("\nall-to-all bytes one rank sends per step (rank 0, last step; forward + backward, "
          "all MoE layers):")
    print(f"{'EP':>3} {'calls':>5} {'measured B':>11} {'exact formula B':>15} {'uniform exp. B':>14} "
          f"{'count B':>8} {'exact, all ranks & steps':>25}")
    for r in rows:
        b = r["rank0_last_step"]
        print(f"{r['ep']:>3} {r['dispatcher_calls_per_step']:>5} {b['measured_row_bytes']:>11} "
              f"{b['exact_row_bytes']:>15} {b['uniform_row_bytes']:>14.0f} {b['count_bytes']:>8} "
              f"{verdict(r['bytes_exact']):>25}")


def print_matmul(rows, device, dense):
    where = "one thread, thread CPU time" if device.type == "cpu" else "wall time"
    print(f"\ngrouped_linear, forward + backward ({device.type}, {where}; min over repeats); "
          f"loop = grouped_linear's per-expert loop:")
    print(f"{'E':>3} {'rows':>5} {'in':>5} {'out':>5} {'dtype':>8} {'rows/expert':>11} "
          f"{'loop ms':>9} {'grouped ms':>10} {'vs loop':>8}"
          + (f" {'dense ms':>9} {'grp TF/s':>8} {'dense TF/s':>10} {'vs dense':>8}" if dense else ""))
    for r in rows:
        grouped = f"{r['grouped_s'] * 1e3:>10.2f} {r['grouped_vs_loop']:>7.2f}x" \
            if r["grouped_mm"] else f"{'n/a':>10} {'n/a':>8}"
        line = (f"{r['experts']:>3} {r['rows']:>5} {r['in']:>5} {r['out']:>5} {r['dtype']:>8} "
                f"{r['counts_min']:>5}-{r['counts_max']:<5} {r['loop_s'] * 1e3:>9.2f} {grouped}")
        if dense:
            vs = f"{r['grouped_vs_dense']:>8.0%}" if r["grouped_mm"] else f"{'n/a':>8}"
            tf = f"{r['grouped_tflops']:>8.3f}" if r["grouped_mm"] else f"{'n/a':>8}"
            line += f" {r['dense_s'] * 1e3:>9.2f} {tf} {r['dense_tflops']:>10.3f} {vs}"
        print(line)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where parts 3-4 run (parts 1-2 always use gloo CPU ranks)")
    p.add_argument("--only", choices=("training", "matmul"), default=None,
                   help="parts 1-2 (training) or 3-4 (matmul) only")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: check the script runs")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help="matmul timing rounds (5, smoke 1)")
    p.add_argument("--timeout", type=int, default=600, help="seconds a training run may take")
    add_output_argument(p, "moe")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not device_mod.accelerator_available():
        p.error("--device cuda: no CUDA device is available here (torch "
                f"{torch.__version__}); run parts 1-3 with --device cpu")
    m = MODEL_SMOKE if a.smoke else MODEL
    repeats = a.repeats or (1 if a.smoke else 5)
    out = {"device": str(device), "torch": torch.__version__, "cores": _cores(), "smoke": a.smoke,
           "threads_per_rank": a.threads_per_rank, "model": m,
           "goals": {"ep2_vs_ep1": GOAL_EP2, "grouped_vs_loop": GOAL_GROUPED,
                     "grouped_vs_dense": GOAL_DENSE}}
    checks = []  # (name, passed, counts towards the exit status)
    if a.only in (None, "training"):
        rows = training_rows(m, EP_SMOKE if a.smoke else EP_SIZES, a.threads_per_rank, a.timeout)
        print_training(rows, m, a.threads_per_rank)
        checks.append(("dispatcher bytes = exact formula (every rank, step)",
                       all(r["bytes_exact"] and r["dispatcher_calls_per_step"] ==
                           r["expected_calls_per_step"] for r in rows), True))
        ep2 = [r for r in rows if r["ep"] == 2]
        if ep2 and _cores() >= 2 * a.threads_per_rank:
            checks.append((f"EP=2 tokens/s >= {GOAL_EP2:.1f}x EP=1", ep2[0]["vs_ep1"] >= GOAL_EP2,
                           not a.smoke))
        out["training"] = rows
    if a.only in (None, "matmul"):
        dense = device.type == "cuda" or a.smoke  # smoke: part 4's code on the CPU as well
        dtypes = (torch.bfloat16,) if device.type == "cuda" else (torch.float32, torch.bfloat16)
        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(1)
        try:
            rows = matmul_rows(MATMUL_SMOKE if a.smoke else MATMUL_SHAPES, dtypes, device,
                               repeats, dense)
        finally:
            torch.set_num_threads(threads)
        print_matmul(rows, device, dense)
        measured = [r for r in rows if r["grouped_mm"]]
        checks.append((f"grouped >= {GOAL_GROUPED:.2f}x the per-expert loop", bool(measured) and all(
            r["grouped_vs_loop"] >= GOAL_GROUPED for r in measured), not a.smoke))
        if device.type == "cuda":
            checks.append((f"grouped >= {GOAL_DENSE:.0%} of dense TFLOP/s", bool(measured) and all(
                r["grouped_vs_dense"] >= GOAL_DENSE for r in measured), not a.smoke))
        out["matmul"] = rows
    print()
    for name, ok, counted in checks:
        print(f"{name:<52} {verdict(ok)}{'' if counted else ' (smoke: not counted)'}")
    passed = all(ok for _, ok, counted in checks if counted)
    out["checks"] = {name: ok for name, ok, _ in checks}
    out["passed"] = passed
    print(verdict(passed))
    write_json(a.output, out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
