"""Every long-context lever at once on one GPU, against the layout planner (issue 36).

The levers: logits and cross entropy in sequence tiles (--tiled-logits-chunk-size), the MLP in
sequence chunks (--mlp-chunks-for-training), full recomputation of every layer with each
recomputed layer's checkpoint in host memory (--cpu-offloading-num-layers: all layers but the
last), bf16 parameters. Two measurements, each time-capped:

1. ``layers``: one training step (forward, backward, AdamW; through the Trainer, as
   pretrain_gpt.py runs one rank) of --layers (default 2) layers of the 1.3B config
   (benchmarks/gpu.py's MODEL_1P3B) on one sample of --seq tokens (default 1,048,576). Its
   peak of device memory against the planner's prediction for the same flags
   (megatron_cp/planning/memory.py, device "gpu"); PASS within 15%, the planner's own
   tolerance against measurement (tests/planning/test_memory_model.py).
2. ``longest``: the whole 24-layer model, the longest sequence one step trains at, searched
   (doubling from --start, then bisecting) within --budget-s seconds (default 300).

    python benchmarks/gpu_levers.py                         # on the GPU
    python benchmarks/gpu_levers.py --smoke --device cpu    # the script's logic, tiny

Writes JSON (runs/benchmarks/gpu_levers.json unless --output).
"""
import argparse
import signal
import time

import torch

from bench_common import add_output_argument, verdict, write_json
import torch.distributed as dist

from megatron_cp.cli.arguments import parse_args
from megatron_cp.distributed import device as device_mod
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.planning.memory import estimate_memory
from megatron_cp.startup import build_parallel_state, run_config
from megatron_cp.training import Trainer

TOLERANCE = 0.15
MODEL_1P3B = dict(layers=24, hidden=2048, heads=16, ffn=5504, vocab=32000, chunk=8192, mlp=16)
SMOKE = dict(layers=3, hidden=64, heads=4, ffn=172, vocab=256, chunk=64, mlp=2)


def flags(m, layers, seq, half):
    """pretrain_gpt.py flags of ``m`` with every lever on."""
    return (f"--num-layers {layers} --hidden-size {m['hidden']} --num-attention-heads "
            f"{m['heads']} --ffn-hidden-size {m['ffn']} --vocab-size {m['vocab']} "
            f"--seq-length {seq} --max-position-embeddings {seq} --micro-batch-size 1 "
            f"--global-batch-size 1 --mock-data --lr 1e-5 --train-iters 1 "
            f"--position-embedding-type rope --normalization RMSNorm --swiglu "
            f"--disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 "
            f"--attention-dropout 0 {'--bf16' if half else ''} "
            f"--tiled-logits-chunk-size {m['chunk']} --mlp-chunks-for-training {m['mlp']} "
            f"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            f"--cpu-offloading-num-layers {layers - 1}")


class _TimeCap:
    """Raises TimeoutError in the main thread after ``seconds`` (between kernel launches)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def _fire(self, *_):
        raise TimeoutError(f"over the {self.seconds:.0f} s cap")

    def __enter__(self):
        signal.signal(signal.SIGALRM, self._fire)
        signal.alarm(max(1, int(self.seconds)))

    def __exit__(self, *exc):
        signal.alarm(0)
        return False


def one_step(argv, device):
    """(peak tensor bytes, seconds, its RunConfig) of one training step of ``argv`` through
    the Trainer, as pretrain_gpt.py runs it on one rank (fp32 gradient buffers, masters and
    AdamW's state, created beforehand by a step on zero gradients: the steady state the
    planner predicts; the weights move by weight decay only, which memory does not see)."""
    args = parse_args(argv.split(), world_size=1)
    run = run_config(args)
    state = build_parallel_state(run.parallel, run.model, run.optimizer, device)
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    trainer.optimizer.step()  # on zero gradients: AdamW's state exists, as in steady state
    start = time.perf_counter()
    with PeakMemory(device) as meter:
        trainer.train_step()
    device_mod.synchronize(device)
    return meter.peak_total_bytes, time.perf_counter() - start, run


def measure_layers(m, layers, seq, device, cap_s):
    """One step of ``layers`` layers at ``seq`` tokens: its measured peak against the
    planner's (a row; status CAP or OOM when it did not finish)."""
    row = {"layers": layers, "seq": seq}
    try:
        with _TimeCap(cap_s):
            peak, seconds, run = one_step(flags(m, layers, seq, device.type == "cuda"), device)
    except (TimeoutError, torch.OutOfMemoryError) as error:
        row.update(status="CAP" if isinstance(error, TimeoutError) else "OOM",
                   error=str(error).split("\n")[0][:200])
        return row
    predicted = estimate_memory(run, device="gpu" if device.type == "cuda" else "cpu")
    row.update(status="ran", seconds=round(seconds, 1), peak_gib=peak / 2 ** 30,
               predicted_gib=predicted.total_bytes / 2 ** 30,
               ratio=peak / predicted.total_bytes,
               passed=abs(peak / predicted.total_bytes - 1) <= TOLERANCE)
    return row


def longest_within(m, device, start, budget_s):
    """The longest sequence the whole model trains one step at, searched (doubling, then
    bisecting to 1/16 of the first failure) within ``budget_s`` seconds of trials."""
    began, good, bad, seq, trials = time.perf_counter(), None, None, start, []
    while time.perf_counter() - began < budget_s:
        left = budget_s - (time.perf_counter() - began)
        row = measure_layers(m, m["layers"], seq, device, left)
        trials.append(row)
        print(f"  s={seq:>9}  {row['status']}  {row.get('seconds', '-')} s", flush=True)
        if row["status"] == "CAP":
            break
        if row["status"] == "ran":
            good = seq
        else:
            bad = seq
        if bad is None:
            seq *= 2
        elif good is None or bad - good <= max(bad // 16, 64):
            break
        else:
            seq = (good + bad) // 2 // 64 * 64
        device_mod.empty_cache(device)
    return good, trials


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if device_mod.accelerator_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny model and lengths")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=None, help="default 1048576 (smoke: 512)")
    p.add_argument("--cap-s", type=float, default=240.0, help="time cap of the layers row")
    p.add_argument("--budget-s", type=float, default=300.0, help="the longest search's budget")
    p.add_argument("--start", type=int, default=None, help="default 131072 (smoke: 256)")
    add_output_argument(p, "gpu_levers")
    a = p.parse_args()
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device(a.device)
    if not dist.is_initialized():  # one rank, as torchrun would start it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    m = SMOKE if a.smoke else MODEL_1P3B
    seq = a.seq or (512 if a.smoke else 2 ** 20)
    out = {"device": device_mod.device_name(device), "torch": torch.__version__,
           "cuda": torch.version.cuda, "smoke": a.smoke, "model": m}
    out["layers"] = measure_layers(m, a.layers, seq, device, a.cap_s)
    write_json(a.output, out)
    r = out["layers"]
    print(f"{a.layers} layers at s={seq}: {r['status']}", end="")
    if r["status"] == "ran":
        print(f", peak {r['peak_gib']:.2f} GiB, planner {r['predicted_gib']:.2f} GiB "
              f"(ratio {r['ratio']:.2f}) {verdict(r['passed'])}")
    else:
        print(f" ({r['error']})")
    device_mod.empty_cache(device)
    longest, trials = longest_within(m, device, a.start or (256 if a.smoke else 2 ** 17),
                                     a.budget_s)
    out["longest"] = {"seq": longest, "budget_s": a.budget_s, "trials": trials}
    print(f"whole model, every lever: longest s {longest} within {a.budget_s:.0f} s of trials")
    write_json(a.output, out)


if __name__ == "__main__":
    main()
