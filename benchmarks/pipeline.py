"""Measured pipeline bubble of the 1F1B and interleaved 1F1B schedules vs theory.

The real schedules (``megatron_cp.pipeline_parallel``) drive synthetic stages whose
forward costs ``t_f / v`` and backward ``t_b / v`` per microbatch and chunk (``v`` model
chunks per rank, so every rank does the same work per microbatch whatever ``v``); the
activations are small, so computation dominates communication. Every forward and backward
is timestamped on every stage (the schedules' ``trace``); a step runs between two
barriers, and a stage's idle fraction is ``1 - busy / step time``. Theory (equal stages):

    1F1B:        (p - 1) / (m + p - 1)
    interleaved: (p - 1) / (v * m + p - 1)

Work kinds: ``matmul`` repeats a fixed matmul (real compute; needs a free core per stage
to be meaningful) and ``spin`` busy-waits a fixed wall-clock time without sleeping (the
default when the machine has fewer cores than stages: oversubscribed cores would stretch a
matmul by however many stages happen to compute at once, which is a CPU artifact, not a
bubble); ``sleep`` frees the cores entirely, for a machine too loaded even to spin.

The table also shows the bubble of the same schedule code replayed without processes
(replay.py, free communication: it equals theory exactly) and the excess of the measured
idle fraction over theory in percentage points of the step, and that excess time divided
by the busiest rank's number of P2P exchanges (``ms/xchg``): the excess is the exchanges'
latency on the critical path, which theory ignores (about 2 m v exchanges per step, so
interleaving, with twice the exchanges and half-length computations, pays it twice).

    python benchmarks/pipeline.py                      # p = 2, 4; m = 4, 8, 16; v = 1, 2
    python benchmarks/pipeline.py --pp 4 --microbatches 8 16 --work matmul
    python benchmarks/pipeline.py --overlap-p2p-comm   # exchanges posted asynchronously

``--overlap-p2p-comm`` runs the schedules with asynchronous P2P (the training flag of the
same name): the latency of an exchange then travels during the neighbouring compute
instead of adding to the critical path, so the excess over theory should shrink.

Goal: every measured bubble within 10% (relative) of theory; each row of the table and
the whole run say PASS or FAIL. Prints the table and writes JSON to
runs/benchmarks/pipeline.json (untracked) unless --output says otherwise; a quick smoke
run: --pp 2 --microbatches 4 --vp 1 --steps 1 --t-forward 0.01 --t-backward 0.02.
"""
import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


from bench_common import add_output_argument, verdict, write_json
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.pipeline_parallel import get_forward_backward_func
from megatron_cp.pipeline_parallel.replay import ideal_bubble, record_program

GOAL_RELATIVE_ERROR = 0.10  # measured bubble vs theory
SHAPE = (16, 1, 32)  # [s, b, h] of the activations: tiny, so P2P costs little


def _sleep(seconds, _size):
    time.sleep(seconds)


def _spin(seconds, _size):
    # Busy until the deadline, yielding the core between checks so the communication
    # threads of an oversubscribed machine still get to run.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        os.sched_yield()


def _matmul_work(calibration):
    """Work of about ``seconds``: repeated [n, n] matmuls, count from a calibration."""
    n, per_second = calibration

    def work(seconds, _size):
        a = torch.ones(n, n)
        for _ in range(max(1, round(seconds * per_second))):
            a = torch.mm(a, a).clamp_(-1, 1)
    return work


def _calibrate(n=128, repeats=200):
    a = torch.ones(n, n)
    start = time.perf_counter()
    for _ in range(repeats):
        a = torch.mm(a, a).clamp_(-1, 1)
    return n, repeats / (time.perf_counter() - start)


class _Work(torch.autograd.Function):
    """y = x * w, with a forward of ``fwd_s`` seconds of work and a backward of ``bwd_s``."""

    @staticmethod
    def forward(ctx, x, weight, fwd_s, bwd_s, work):
        work(fwd_s, x.numel())
        ctx.save_for_backward(x, weight)
        ctx.bwd_s, ctx.work = bwd_s, work
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.work(ctx.bwd_s, x.numel())
        return grad * weight, (grad * x).sum().reshape(1), None, None, None


class _Stage(torch.nn.Module):
    """A synthetic model chunk with the GPTModel interface the schedules use."""

    def __init__(self, fwd_s, bwd_s, work, pre_process):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.fwd_s, self.bwd_s, self.work, self.pre_process = fwd_s, bwd_s, work, pre_process
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, batch):
        x = batch["x"] if self.pre_process else self.input_tensor  # [s, b, h]
        return _Work.apply(x, self.weight, self.fwd_s, self.bwd_s, self.work)


def _worker(rank, world, store, cfg, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        work = {"spin": _spin, "sleep": _sleep}.get(cfg["work"]) or _matmul_work(cfg["calibration"])
        results = []
        for vp in cfg["vps"]:
            state = initialize_model_parallel(pipeline_model_parallel_size=world,
                                              virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                                              device=torch.device("cpu"))
            v = vp
            chunks = [_Stage(cfg["t_f"] / v, cfg["t_b"] / v, work, rank == 0 and c == 0)
                      for c in range(v)]
            schedule = get_forward_backward_func(state, SHAPE, torch.float32, cfg["overlap"])
            for m in cfg["microbatches"]:
                batches = [{"x": torch.ones(SHAPE)} for _ in range(m)]
                idle = []
                for step in range(cfg["steps"] + 1):  # step 0 warms up
                    trace = []
                    dist.barrier()
                    start = time.perf_counter()
                    schedule(lambda model, batch: model(batch),
                             lambda out, batch: (out.mean(), out.sum().detach()),
                             batches, chunks, state, trace=trace)
                    dist.barrier()
                    total = time.perf_counter() - start
                    busy = sum(end - begin for _, _, _, begin, end in trace)
                    if step > 0:
                        idle.append(1.0 - busy / total)
                results.append({"vp": v, "microbatches": m, "idle": sum(idle) / len(idle),
                                "step_s": total})
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            queue.put(gathered)
    finally:
        dist.destroy_process_group()


def theory(p, m, v):
    """The bubble fraction of (interleaved) 1F1B with equal stages."""
    return (p - 1) / (v * m + p - 1)


def run(pp, cfg):
    """All (vp, m) configurations on ``pp`` stages; returns a list of result rows."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, pp, store, cfg, queue)) for r in range(pp)]
        for proc in procs:
            proc.start()
        gathered = queue.get(timeout=600)
        for proc in procs:
            proc.join()
    rows = []
    for i, first in enumerate(gathered[0]):
        v, m = first["vp"], first["microbatches"]
        per_stage = [stage[i]["idle"] for stage in gathered]
        measured = sum(per_stage) / pp
        expected = theory(pp, m, v)
        step = max(stage[i]["step_s"] for stage in gathered)
        # exchanges of the busiest rank: what the excess idle time is spread over
        exchanges = max(sum(e[0] == "C" for e in record_program(pp, r, v, m)) for r in range(pp))
        rows.append({"pp": pp, "vp": v, "schedule": "1F1B" if v == 1 else "interleaved",
                     "microbatches": m, "theory": expected,
                     "replayed": ideal_bubble(pp, v, m, cfg["t_f"], cfg["t_b"]),
                     "measured": measured,
                     "per_stage": per_stage, "relative_error": (measured - expected) / expected,
                     "step_s": step, "exchanges": exchanges,
                     "excess_ms_per_exchange": 1e3 * (measured - expected) * step / exchanges})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="Pipeline sizes.")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16],
                        help="Microbatches per step (multiples of every PP for interleaving).")
    parser.add_argument("--vp", type=int, nargs="+", default=[1, 2],
                        help="Model chunks per rank (1: 1F1B, >1: interleaved).")
    parser.add_argument("--t-forward", type=float, default=0.05, help="Forward seconds per microbatch.")
    parser.add_argument("--t-backward", type=float, default=0.1, help="Backward seconds per microbatch.")
    parser.add_argument("--steps", type=int, default=2, help="Measured steps (after one warmup step).")
    parser.add_argument("--work", choices=["auto", "spin", "matmul", "sleep"], default="auto",
                        help="Synthetic stage work (auto: matmul with a core per stage, else spin).")
    parser.add_argument("--overlap-p2p-comm", action="store_true",
                        help="Run the schedules with asynchronous P2P exchanges (--overlap-p2p-comm).")
    add_output_argument(parser, "pipeline")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    work = args.work if args.work != "auto" else ("matmul" if cores >= max(args.pp) else "spin")
    torch.set_num_threads(1)
    cfg = {"t_f": args.t_forward, "t_b": args.t_backward, "steps": args.steps, "work": work,
           "microbatches": args.microbatches, "vps": args.vp, "overlap": args.overlap_p2p_comm,
           "calibration": _calibrate() if work == "matmul" else None}
    start = time.time()
    rows = []
    for pp in args.pp:
        rows.extend(run(pp, cfg))
    print(f"pipeline bubble: {work} work, t_f={args.t_forward}s t_b={args.t_backward}s per "
          f"microbatch, {cores} cores, overlap_p2p_comm={args.overlap_p2p_comm}")
    print(f"{'pp':>3} {'vp':>3} {'schedule':>12} {'m':>4} {'theory':>8} {'replayed':>9} "
          f"{'measured':>9} {'rel.err':>8} {'excess':>7} {'ms/xchg':>7} {'step s':>7}  goal  per stage")
    for row in rows:
        stages = " ".join(f"{x:.3f}" for x in row["per_stage"])
        print(f"{row['pp']:>3} {row['vp']:>3} {row['schedule']:>12} {row['microbatches']:>4} "
              f"{row['theory']:>8.3f} {row['replayed']:>9.3f} {row['measured']:>9.3f} "
              f"{row['relative_error']:>+8.1%} {100 * (row['measured'] - row['theory']):>+6.1f}pp "
              f"{row['excess_ms_per_exchange']:>7.2f} "
              f"{row['step_s']:>7.2f}  {verdict(abs(row['relative_error']) <= GOAL_RELATIVE_ERROR)}"
              f"  {stages}")
    worst = max(abs(row["relative_error"]) for row in rows)
    passed = sum(abs(row["relative_error"]) <= GOAL_RELATIVE_ERROR for row in rows)
    print(f"worst relative error vs theory: {worst:.1%}; {passed} of {len(rows)} schedules within "
          f"{GOAL_RELATIVE_ERROR:.0%} (goal: all): {verdict(passed == len(rows))}; "
          f"{time.time() - start:.0f}s")
    write_json(args.output, {"benchmark": "pipeline_bubble", "work": work,
                             "t_forward_s": args.t_forward, "t_backward_s": args.t_backward,
                             "steps": args.steps, "cores": cores,
                             "overlap_p2p_comm": args.overlap_p2p_comm,
                             "torch": torch.__version__, "platform": platform.platform(),
                             "rows": rows, "worst_relative_error": worst,
                             "goal_relative_error": GOAL_RELATIVE_ERROR,
                             "passed": passed == len(rows)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
