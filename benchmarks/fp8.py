"""FP8 training (megatron_cp/fp8/): numerics against the formulas and torchao, the loss gap to
bf16 on the main job's corpus, and on a GPU the speed against bf16 and torchao.

Goals:

1. numerics (CPU, always): for each recipe (tensorwise, delayed) and format (e4m3, hybrid),
   every scale and float8 payload of one linear bitwise the reference's
   (tests/fp8/fp8_reference.py: the formulas, float8 rounding by the format's value table),
   and its three GEMMs within fp32 accumulation's bound of the exact float64 product of the
   dequantized operands (worst error / bound <= 1); hybrid tensorwise bitwise equal to
   torchao's Float8Linear (default config: dynamic tensorwise, e4m3 / e5m2), fp32 and bf16.
2. loss gap (CPU, ``--steps`` 300): FP8 (hybrid; tensorwise and delayed) against bf16 training
   through pretrain_gpt.py on the main job's corpus (examples/pretrain_gpt_cpu.sh's pydoc data
   and SentencePiece tokenizer, its optimizer settings, one process): ``|loss_fp8 - loss_bf16| /
   loss_bf16`` averaged over the last 20 steps < 2%. torch._scaled_mm on the CPU is a
   reference kernel (tens of MFLOP/s), so the model is smaller than the main job's (2 layers,
   hidden 32, ffn 64, seq 64, batch 4; the main job: 4 layers, hidden 128, seq 128, batch 16,
   ~13 GFLOP of FP8 GEMMs a step); the table says which.
3. GPU (only where one is available; otherwise a printed 'no GPU' row, never a PASS):
   (a) FP8 tensorwise against bf16 step time on 2 Llama-3-8B-shaped layers (hidden 4096, ffn
   14336 SwiGLU, 32 heads, 8 KV groups, RMSNorm, seq 8192, a 1024-token vocabulary so the
   layers dominate): FP8 >= 1.3x bf16's speed;
   (b) our FP8 1.3B model (benchmarks/gpu.py's config) against torchao Float8 training of
   Hugging Face's LlamaForCausalLM of the same config (convert_to_float8_training on its
   decoder linears, lm_head excluded as ours; bf16 params, eager both): >= 0.95x its
   TFLOP/s by the log line's formula. Our linears are Column/RowParallelLinear, not
   nn.Linear, so torchao cannot be swapped into our model; the HF bf16 run is printed beside
   it to separate the model's own speed from FP8's;
   (c) the loss gap of (2) for the 1.3B model over 50 steps (< 2%);
   (d) the block recipes against tensorwise on the layers of (a): blockwise (1 x 128 / 128 x
   128 scales, Hopper) and mxfp8 (1 x 32 E8M0 scales, Blackwell) at >= 0.8x tensorwise's
   speed, each where the GPU has its kernels (else a row saying why, never a PASS).

    PYTHONPATH=.:tests/fp8 python benchmarks/fp8.py                  # numerics + CPU loss gap (+ GPU)
    PYTHONPATH=.:tests/fp8 python benchmarks/fp8.py --gpu-only       # the GPU section (~5 min, H200)
    PYTHONPATH=.:tests/fp8 python benchmarks/fp8.py --smoke --device cpu  # its logic, tiny

(tests/fp8 on the path: the numerics rows use the tests' reference, tests/fp8/fp8_reference.py.)

The JSON goes to runs/benchmarks/fp8.json (untracked) unless --output says otherwise.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from bench_common import add_output_argument, verdict, write_json
from megatron_cp.distributed import device as device_mod
from megatron_cp.fp8.model import check_block_device

from fp8_reference import linear_checks, make_meta, run_linear, tensors  # tests/fp8 (PYTHONPATH)
from gpu import MODEL_1P3B, MODEL_SMOKE, pretrain_flags, run_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RECIPES, FORMATS = ("tensorwise", "delayed"), ("e4m3", "hybrid")
SHAPES = ((32, 64, 48), (64, 96, 80))  # (m, k, n); _scaled_mm on the CPU is slow
LOSS_GOAL, LAYER_SPEEDUP_GOAL, TORCHAO_GOAL, LAST = 0.02, 1.3, 0.95, 20
BLOCK_GOAL = 0.8  # a block recipe's speed / tensorwise's on the Llama-3 layers (goal 3 d)
FP8_RUNS = {"fp8 tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
            "fp8 delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]}
CPU_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
             "--micro-batch-size", "4", "--global-batch-size", "4"]
CPU_MODEL_NAME = "2 layers x 32, seq 64 (main job's: 4 x 128, seq 128)"
LLAMA3_LAYERS = dict(layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=1024, seq=8192,
                     micro_batch=1, global_batch=1, iters=12)
LLAMA3_SMOKE = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=224, vocab=256, seq=128,
                    micro_batch=1, global_batch=1, iters=4)


# ----------------------------------------------------------------------------- numerics
def numerics():
    """Rows (name, figure, passed) of goal 1."""
    rows = []
    for recipe in RECIPES:
        for fmt in FORMATS:
            for shape in SHAPES:
                exact, ratio = linear_checks(fmt, recipe, shape)
                name = f"{recipe:<10} {fmt:<6} {'x'.join(map(str, shape)):<9}"
                rows.append((f"{name} payloads+scales bitwise", str(exact), exact))
                rows.append((f"{name} GEMM err / fp32 bound", f"{ratio:.3f}", ratio <= 1.0))
    for dtype in (torch.float32, torch.bfloat16):
        diffs = torchao_diffs(dtype)
        text = "bitwise" if max(diffs) == 0 else "max |diff| " + ", ".join(f"{d:.2e}" for d in diffs)
        rows.append((f"torchao Float8Linear hybrid tensorwise {str(dtype)[6:]} (y, dx, dW)", text,
                     max(diffs) == 0))
    return rows


def torchao_diffs(dtype, shape=(64, 96, 48)):
    """Max |ours - torchao| of the output, dx and dW of one linear (hybrid tensorwise)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    m, k, n = shape
    x, w, g = (t.to(dtype) for t in tensors(m, k, n, seed=7, x_scale=3.0))
    peer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, dtype=dtype))
    with torch.no_grad():
        peer[0].weight.copy_(w)
    convert_to_float8_training(peer, config=Float8LinearConfig())
    px = x.clone().requires_grad_()
    peer_out = peer(px)
    peer_out.backward(g)
    out, dx, dw, _ = run_linear(make_meta("hybrid", "tensorwise"), x, w, g)
    return [(a.float() - b.float()).abs().max().item()
            for a, b in ((out, peer_out), (dx, px.grad), (dw, peer[0].weight.grad))]


# ----------------------------------------------------------------------------- training runs
def data_flags(data_dir):
    """The main job's corpus flags (examples/pretrain_gpt_cpu.sh), or mock data when the
    corpus is not there; (flags, description)."""
    prefix = os.path.join(data_dir, "pydoc_text_document")
    if not os.path.exists(prefix + ".idx"):
        return ["--mock-data"], f"mock data ({data_dir} holds no corpus: " \
                                "bash examples/prepare_pydoc_data.sh builds it)"
    return ["--data-path", prefix, "--split", "949,50,1", "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", os.path.join(data_dir, "spm.model"),
            "--data-cache-path", os.path.join(ROOT, "runs", "benchmarks", "fp8_data_cache")], \
        "pydoc corpus"


def main_job_training(steps):
    """examples/pretrain_gpt_cpu.sh's optimizer and model style, for ``steps`` iterations."""
    return ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--make-vocab-size-divisible-by", "64", "--train-iters", str(steps), "--lr", "2e-3",
            "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters",
            str(max(1, steps // 10)), "--weight-decay", "0.1", "--adam-beta2", "0.95",
            "--clip-grad", "1.0", "--seed", "1234", "--eval-iters", "0", "--bf16",
            "--log-interval", "1", "--distributed-backend", "gloo"]


def train(flags, port):
    """pretrain_gpt.py on one process: (per-iteration losses, per-iteration ms, TFLOP/s)."""
    env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get(
        "OMP_NUM_THREADS", "1"), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", proc.stdout)]
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                       proc.stdout)]
    tflops = [float(x) for x in re.findall(r"TFLOP/s/GPU\): ([0-9.]+)", proc.stdout)]
    return losses, ms, tflops


def steady(values):
    """The median of the second half of a run's per-iteration figures (warmup excluded)."""
    return statistics.median(values[len(values) // 2:])


def loss_gaps(flags, label):
    """bf16 and each FP8 recipe on ``flags``: rows (name, figure, passed) and the runs."""
    runs = {"bf16": train(flags, 29621)}
    for i, (name, extra) in enumerate(FP8_RUNS.items()):
        runs[name] = train(flags + extra, 29622 + i)
    base = runs["bf16"][0]
    rows = []
    for name in FP8_RUNS:
        losses = runs[name][0]
        last = min(LAST, len(losses))
        gap = statistics.mean(abs(a - b) / b for a, b in zip(losses[-last:], base[-last:]))
        rows.append((f"loss gap {name} vs bf16, {label}, last {last} of {len(losses)} steps "
                     f"(bf16 {statistics.mean(base[-last:]):.4f})", f"{gap:.2%}", gap < LOSS_GOAL))
    return rows, {name: {"losses": r[0], "ms": r[1], "tflops": r[2]} for name, r in runs.items()}


# ----------------------------------------------------------------------------- GPU section
def model_flags(m, device):
    """pretrain_gpt.py's flags (benchmarks/gpu.py's) for sizes ``m``, log every step, GQA."""
    flags = pretrain_flags(m, device, compiled=False) + ["--log-interval", "1"]
    flags += [] if "--bf16" in flags else ["--bf16"]  # (gpu.py's flags have it on CUDA)
    if m["kv_heads"] < m["heads"]:
        flags += ["--group-query-attention", "--num-query-groups", str(m["kv_heads"])]
    return flags


def gpu_section(device, smoke, data_dir, steps):
    """Rows of goal 3 (a), (b), (c) on ``device``."""
    rows, out = [], {}
    layers = LLAMA3_SMOKE if smoke else LLAMA3_LAYERS
    flags = model_flags(layers, device)
    bf16 = steady(train(flags, 29631)[1])
    fp8 = steady(train(flags + FP8_RUNS["fp8 tensorwise"], 29632)[1])
    out["llama3_layers_ms"] = {"bf16": bf16, "fp8 tensorwise": fp8}
    rows.append((f"(a) {layers['layers']} Llama-3-8B-shaped layers step ms bf16 {bf16:.1f} / "
                 f"fp8 {fp8:.1f}: speedup", f"{bf16 / fp8:.2f}x", bf16 / fp8 >= LAYER_SPEEDUP_GOAL))
    rows += block_recipe_rows(device, flags, fp8, layers["layers"], out["llama3_layers_ms"])

    m = dict(MODEL_SMOKE if smoke else MODEL_1P3B, iters=steps)
    data, label = data_flags(data_dir)
    flags = model_flags(m, device)
    if data != ["--mock-data"]:  # the corpus's tokenizer and vocabulary replace the mock's
        flags.remove("--mock-data")
        i = flags.index("--tokenizer-type")
        del flags[i:i + 4]  # --tokenizer-type NullTokenizer --vocab-size V
    gap_rows, runs = loss_gaps(flags + data, f"{'smoke' if smoke else '1.3B'}, {label}")
    out["1.3b_loss"] = runs

    hf_m = dict(m, iters=4 if smoke else 20)  # HF's config: mock data, vocabulary 32000
    ours = steady(train(model_flags(hf_m, device) + FP8_RUNS["fp8 tensorwise"], 29635)[2])
    hf_fp8 = run_hf(hf_m, device, "bf16", prepare=torchao_float8)["tflops"]
    hf_bf16 = run_hf(hf_m, device, "bf16")["tflops"]
    out["1.3b_tflops"] = {"ours fp8": ours, "hf torchao fp8": hf_fp8, "hf bf16": hf_bf16}
    rows.append((f"(b) {'smoke' if smoke else '1.3B'} TFLOP/s ours fp8 {ours:.3g} / HF "
                 f"torchao fp8 {hf_fp8:.3g} (HF bf16 {hf_bf16:.3g})", f"{ours / hf_fp8:.2f}x",
                 ours / hf_fp8 >= TORCHAO_GOAL))
    rows += [("(c) " + name, figure, ok) for name, figure, ok in gap_rows]
    return rows, out


def block_recipe_rows(device, flags, tensorwise_ms, layers, times):
    """Goal 3 (d): each block recipe's step time on the Llama-3 layers' ``flags`` against
    tensorwise's ``tensorwise_ms``, where ``device`` has the recipe's kernels."""
    rows = []
    for port, recipe in enumerate(("blockwise", "mxfp8"), 29636):
        try:
            check_block_device(recipe, device_mod.compute_capability(device),
                               device_mod.device_name(device))
        except ValueError as unsupported:
            rows.append((f"(d) fp8 {recipe} vs tensorwise: {unsupported}", "no kernels", None))
            continue
        ms = steady(train(flags + ["--fp8-format", "hybrid", "--fp8-recipe", recipe], port)[1])
        times[f"fp8 {recipe}"] = ms
        rows.append((f"(d) {layers} Llama-3-8B-shaped layers step ms fp8 tensorwise "
                     f"{tensorwise_ms:.1f} / {recipe} {ms:.1f}: speed ratio",
                     f"{tensorwise_ms / ms:.2f}x", tensorwise_ms / ms >= BLOCK_GOAL))
    return rows


def torchao_float8(model):
    """HF Llama with torchao's Float8Linear in its decoder layers (lm_head kept, as ours)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return convert_to_float8_training(model, config=Float8LinearConfig(),
                                      module_filter_fn=lambda mod, fqn: "lm_head" not in fqn)


# ----------------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if device_mod.accelerator_available() else "cpu")
    p.add_argument("--steps", type=int, default=300, help="CPU loss-gap steps")
    p.add_argument("--gpu-steps", type=int, default=50, help="GPU loss-gap steps")
    p.add_argument("--gpu-only", action="store_true", help="only the GPU section")
    p.add_argument("--smoke", action="store_true",
                   help="the GPU section on tiny shapes (with --device cpu: its logic on CPU)")
    p.add_argument("--data-dir", default=os.path.join(ROOT, "data_work"),
                   help="the main job's corpus (examples/prepare_pydoc_data.sh)")
    add_output_argument(p, "fp8")
    a = p.parse_args()
    device = torch.device(a.device)
    out = {"device": str(device), "torch": torch.__version__, "smoke": a.smoke,
           "date": time.strftime("%Y-%m-%d")}
    rows = []
    if not (a.gpu_only or a.smoke):
        rows += numerics()
        data, label = data_flags(a.data_dir)
        gap_rows, out["cpu_loss"] = loss_gaps(
            CPU_MODEL + main_job_training(a.steps) + data, f"{CPU_MODEL_NAME}, {label}")
        rows += gap_rows
    if device.type == "cuda" or a.smoke:
        gpu_rows, out["gpu"] = gpu_section(device, a.smoke, a.data_dir,
                                           8 if a.smoke else a.gpu_steps)
        rows += gpu_rows
    else:
        rows.append(("GPU section (a), (b), (c), (d)", "no GPU", None))
    width = max(len(r[0]) for r in rows)
    for name, figure, ok in rows:
        print(f"{name:<{width}}  {figure:>14}  {'SKIP' if ok is None else verdict(ok)}")
    out["rows"] = [{"name": n, "figure": f, "pass": ok} for n, f, ok in rows]
    write_json(a.output, out)


if __name__ == "__main__":
    main()
