"""One NVIDIA GPU: the Llama-style 1.3B model through pretrain_gpt.py, eager and compiled,
against Hugging Face LlamaForCausalLM (fp32 params + bf16 autocast, and bf16 params) in the
same run; context-parallel block kernels against SDPA; packed documents against one document;
peak memory of every run.

Goals (one H100; ``--peak-tflops`` is the GPU's dense bf16 peak, 989 for an H100 SXM):

- 1.3B config (24 layers, hidden 2048, 16 heads, ffn 5504 SwiGLU, RMSNorm, RoPE, no bias,
  untied, vocab 32000, seq 4096, micro batch 1, global batch 8, bf16): >= 50% MFU by the log
  line's own formula (>= 495 TFLOP/s on an H100), ahead of both Hugging Face runs, and peak
  memory no higher than HF autocast's;
- ring blocks (forward + backward of one causal / full block): >= 90% of SDPA's TFLOP/s at
  every s >= 8k; packed documents (8 per sample, the model's no-CP path with the
  microbatch's layout planned once): >= 90% of SDPA over the same documents at every s from
  4k to 32k.

FLOPs follow the flash-attention convention (forward 4 b h s^2 d, halved for causal, backward
2.5 x forward); the models' by ``megatron_cp.observability.training_log.model_flops_per_token``, the
formula of the training log line, for ours and Hugging Face's alike.

    PYTHONPATH=. python benchmarks/gpu.py                         # everything, on the GPU
    PYTHONPATH=. python benchmarks/gpu.py --only blocks           # or: models
    PYTHONPATH=. python benchmarks/gpu.py --smoke --device cpu    # the script's logic on a tiny config

``--smoke`` runs tiny sizes (its figures mean nothing; the verdicts are printed but the goals
are the GPU's). The JSON goes to runs/benchmarks/gpu.json unless --output says otherwise.
"""
import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import time

import torch

from bench_common import add_output_argument, verdict, write_json
from megatron_cp.distributed import device as device_mod
from megatron_cp.model import GPTConfig
from megatron_cp.context_parallel.kernel_routes import cudnn_bypassed
from megatron_cp.observability.training_log import model_flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILE_FLAG = "--torch-compile"
MFU_GOAL, BLOCK_GOAL, PACKED_GOAL = 0.50, 0.90, 0.90
MODEL_1P3B = dict(layers=24, hidden=2048, heads=16, kv_heads=16, ffn=5504, vocab=32000, seq=4096,
                  micro_batch=1, global_batch=8, iters=20)
MODEL_SMOKE = dict(layers=2, hidden=64, heads=4, kv_heads=4, ffn=172, vocab=256, seq=128,
                   micro_batch=1, global_batch=2, iters=4)
BLOCK_LENGTHS, BLOCK_SMOKE = (4096, 8192, 16384, 32768), (128, 256)


# ----------------------------------------------------------------------------- models
def gpt_config(m):
    """The megatron_cp config of model sizes ``m`` (what the FLOP formula reads)."""
    return GPTConfig(num_layers=m["layers"], hidden_size=m["hidden"],
                     num_attention_heads=m["heads"], num_query_groups=m["kv_heads"],
                     ffn_hidden_size=m["ffn"], vocab_size=m["vocab"],
                     make_vocab_size_divisible_by=128, max_position_embeddings=m["seq"],
                     position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                     add_bias_linear=False, untie_embeddings_and_output_weights=True)


def pretrain_flags(m, device, compiled):
    """pretrain_gpt.py's flags for model ``m`` on mock data (NullTokenizer adds the EOD)."""
    flags = [
        "--num-layers", m["layers"], "--hidden-size", m["hidden"], "--num-attention-heads",
        m["heads"], "--ffn-hidden-size", m["ffn"], "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--seq-length", m["seq"],
        "--max-position-embeddings", m["seq"], "--micro-batch-size", m["micro_batch"],
        "--global-batch-size", m["global_batch"], "--train-iters", m["iters"],
        "--log-interval", m["iters"] // 2, "--eval-iters", 0, "--lr", "1e-4",
        "--hidden-dropout", 0, "--attention-dropout", 0, "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", m["vocab"] - 1,
        "--distributed-backend", "nccl" if device.type == "cuda" else "gloo"]
    if device.type == "cuda":
        flags.append("--bf16")
    if compiled:
        flags.append(COMPILE_FLAG)
    return [str(f) for f in flags]


def run_pretrain(m, device, compiled):
    """TFLOP/s of the last log line (the second half of the run: compilation excluded) and
    the peak memory (MB) that pretrain_gpt.py reports."""
    env = dict(os.environ, MASTER_PORT=str(29500 + (7 if compiled else 3)))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
                           *pretrain_flags(m, device, compiled)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    tflops = [float(x) for x in re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)",
                                           proc.stdout)]
    # the memory line: "[Rank 0] (after N iterations) memory (MB) | allocated: A | max allocated: M"
    memory = re.findall(r"memory \(MB\) \|.*\| max allocated: ([0-9.]+)", proc.stdout)
    return {"tflops": tflops[-1], "peak_memory_mb": float(memory[-1]) if memory else None}


def run_hf(m, device, mode, prepare=None):
    """Hugging Face Llama on the same config and batches: ``mode`` "autocast" (fp32 params,
    bf16 autocast) or "bf16" (bf16 params); ``prepare(model)`` edits the model first
    (benchmarks/fp8.py: torchao's Float8Linear). TFLOP/s by our formula, peak memory (MB)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"],
                         intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
                         num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                         max_position_embeddings=m["seq"], tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False, attn_implementation="sdpa")
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    device_mod.reset_peak_memory(device)
    model = LlamaForCausalLM(config).to(device=device, dtype=low if mode == "bf16" else torch.float32)
    if prepare is not None:
        model = prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro = m["global_batch"] // m["micro_batch"]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m["vocab"], (micro, m["micro_batch"], m["seq"] + 1), generator=gen)
    tokens = tokens.to(device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        for batch in tokens:
            autocast = mode == "autocast" and low != torch.float32  # CPU smoke runs: fp32
            with torch.autocast(device.type, dtype=low, enabled=autocast):
                logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     batch[:, 1:].flatten())
            (loss / micro).backward()
        optimizer.step()

    seconds = timed(step, device, iters=max(2, m["iters"] // 2), warmup=2)
    tokens_per_s = m["global_batch"] * m["seq"] / seconds
    flops = tokens_per_s * model_flops_per_token(gpt_config(m), m["seq"])
    peak = device_mod.max_memory_allocated(device) / 2 ** 20
    return {"tflops": flops / 1e12, "peak_memory_mb": peak if device.type == "cuda" else None}


# ----------------------------------------------------------------------------- blocks
def timed(fn, device, iters=5, warmup=2):
    """Seconds per call of ``fn`` (device-synchronized)."""
    for _ in range(warmup):
        fn()
    device_mod.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    device_mod.synchronize(device)
    return (time.perf_counter() - start) / iters


def attention_flops(b, h, d, lengths, causal):
    """Forward + backward FLOPs (flash convention) of attention over documents ``lengths``."""
    forward = sum(4 * b * h * d * n * n for n in lengths) * (0.5 if causal else 1.0)
    return 3.5 * forward


def block_rates(s, device, dtype, heads=16, dim=128, documents=8):
    """TFLOP/s of SDPA and of our CP blocks (causal, full, packed documents) at length s.

    Every input is what the model hands attention: a [b, h, s, d] view of [s, b, h, d]
    activations. "ours causal" / "ours full" time one ring step's block as the ring runs it
    (``block_forward`` + ``block_backward`` of a block the ring planned once per microbatch,
    with the backward's final out / lse); "packed" is one layer's attention in the model's
    no-CP path over ``documents`` equal documents (``local_attention`` with the microbatch's
    SequenceLayout, planned once before the layers as GPTModel does: one variable-length
    kernel call each way); "unplanned" is the same call planning from the metadata itself
    (a host read per call: what every layer did before the layout); "flash" is the planned
    call with cuDNN made ineligible (one flash varlen call); "SDPA docs" is SDPA over
    the same documents laid out as a batch (no packing): the kernel's own figure at the
    document length, the ceiling of any packed path. ``layout_ms``: building and preparing
    the layout, once per microbatch (host time, with its device sync)."""
    from megatron_cp.context_parallel import block_backward, block_forward, local_attention
    from megatron_cp.context_parallel.layout import SequenceLayout
    gen = torch.Generator().manual_seed(0)

    def activation():  # [1, heads, s, dim] view of an [s, 1, heads, dim] tensor
        return torch.randn(s, 1, heads, dim, generator=gen).to(device, dtype).permute(1, 2, 0, 3)

    q, k, v, g = (activation() for _ in range(4))
    scale = dim ** -0.5
    tokens = torch.arange(s, device=device).expand(1, s)
    docs = (torch.arange(s, device=device) * documents // s).expand(1, s)

    def sdpa(causal):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def run():
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            torch.autograd.grad(out, leaves, g)
        return run

    def ring_block(kind):
        def run():
            out, lse = block_forward(q, k, v, scale, kind)
            block_backward(g, q, k, v, out, lse, scale, kind)
        return run

    def sdpa_documents():  # the same documents as a batch [documents, h, s/documents, d]
        def batch(t):  # [1, h, s, d] -> [documents, h, s/documents, d]
            return t.detach().reshape(heads, documents, s // documents, dim).transpose(0, 1)

        leaves = [batch(t).detach().requires_grad_() for t in (q, k, v)]
        grad = batch(g)

        def run():
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
            torch.autograd.grad(out, leaves, grad)
        return run

    def packed(planned, route=None):
        def build():
            return SequenceLayout(tokens, docs).prepare(None, s, device)
        layout = build() if planned else None

        def run():
            bypass = cudnn_bypassed(collections.Counter()) if route == "flash" \
                else contextlib.nullcontext()  # flash: cuDNN made ineligible for the call
            with bypass:
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out = local_attention(*leaves, tokens, docs, layout=layout)
                torch.autograd.grad(out, leaves, g)
        return run, build

    rate = {}
    for name, fn, lengths, causal in (
            ("sdpa_causal", sdpa(True), [s], True), ("sdpa_full", sdpa(False), [s], False),
            ("ours_causal", ring_block("causal"), [s], True),
            ("ours_full", ring_block("full"), [s], False),
            ("ours_packed", packed(True)[0], [s // documents] * documents, True),
            ("ours_packed_unplanned", packed(False)[0], [s // documents] * documents, True),
            ("ours_packed_flash", packed(True, "flash")[0], [s // documents] * documents, True),
            ("sdpa_documents", sdpa_documents(), [s // documents] * documents, True)):
        rate[name] = attention_flops(1, heads, dim, lengths, causal) / timed(fn, device) / 1e12
    rate["layout_ms"] = 1e3 * timed(packed(True)[1], device)
    return rate


# ----------------------------------------------------------------------------- main
def versions(device):
    """The GPU and the library versions a result was measured with."""
    import transformers
    text = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if device.type == "cuda":
        text = (f"{device_mod.device_name(device)}, cuda {torch.version.cuda}, cudnn "
                f"{torch.backends.cudnn.version()}, {text}")
    return text



def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if device_mod.accelerator_available() else "cpu")
    p.add_argument("--only", choices=("models", "blocks"), default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: check the script runs")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the GPU's dense bf16 peak (H100 SXM 989)")
    add_output_argument(p, "gpu")
    a = p.parse_args()
    device = torch.device(a.device)
    m = MODEL_SMOKE if a.smoke else MODEL_1P3B
    out, checks = {"device": str(device), "torch": torch.__version__, "smoke": a.smoke,
                   "date": time.strftime("%Y-%m-%d"), "versions": versions(device)}, []
    if a.only in (None, "models"):
        runs = {"megatron_cp eager": run_pretrain(m, device, False),
                "megatron_cp compiled": run_pretrain(m, device, True),
                "hf autocast": run_hf(m, device, "autocast"),
                "hf bf16": run_hf(m, device, "bf16")}
        print(f"{'1.3B' if not a.smoke else 'smoke'} model   {'TFLOP/s':>9} {'MFU':>6} {'peak MB':>9}")
        for name, r in runs.items():
            r["mfu"] = r["tflops"] / a.peak_tflops
            mem = f"{r['peak_memory_mb']:.0f}" if r["peak_memory_mb"] else "-"
            print(f"{name:<21} {r['tflops']:>9.1f} {r['mfu']:>6.1%} {mem:>9}")
        best = max(runs["megatron_cp eager"]["tflops"], runs["megatron_cp compiled"]["tflops"])
        hf_best = max(runs["hf autocast"]["tflops"], runs["hf bf16"]["tflops"])
        ours_mem = runs["megatron_cp compiled"]["peak_memory_mb"]
        hf_mem = runs["hf autocast"]["peak_memory_mb"]
        checks += [("1.3B MFU >= 50%", best / a.peak_tflops >= MFU_GOAL),
                   ("ahead of both HF runs", best > hf_best),
                   ("peak memory <= HF autocast", ours_mem is not None and hf_mem is not None
                    and ours_mem <= hf_mem)]
        out["models"] = runs
    if a.only in (None, "blocks"):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        rows = {s: block_rates(s, device, dtype) for s in (BLOCK_SMOKE if a.smoke else BLOCK_LENGTHS)}
        print(f"{'s':>6} {'SDPA causal':>11} {'ours causal':>11} {'SDPA full':>9} {'ours full':>9} "
              f"{'packed':>7} {'unplanned':>9} {'flash':>7} {'SDPA docs':>9} {'layout ms':>9}   "
              f"(TFLOP/s; packed, unplanned, flash, SDPA docs: 8 documents)")
        for s, r in rows.items():
            print(f"{s:>6} {r['sdpa_causal']:>11.1f} {r['ours_causal']:>11.1f} {r['sdpa_full']:>9.1f} "
                  f"{r['ours_full']:>9.1f} {r['ours_packed']:>7.1f} "
                  f"{r['ours_packed_unplanned']:>9.1f} {r['ours_packed_flash']:>7.1f} "
                  f"{r['sdpa_documents']:>9.1f} "
                  f"{r['layout_ms']:>9.2f}")
        long = [r for s, r in rows.items() if s >= (256 if a.smoke else 8192)]
        checks += [("blocks >= 90% of SDPA at s >= 8k", all(
                       r["ours_causal"] >= BLOCK_GOAL * r["sdpa_causal"] and
                       r["ours_full"] >= BLOCK_GOAL * r["sdpa_full"] for r in long)),
                   ("packed >= 90% of SDPA over the same documents, every s", all(
                       r["ours_packed"] >= PACKED_GOAL * r["sdpa_documents"]
                       for r in rows.values()))]
        out["blocks"] = {str(s): r for s, r in rows.items()}
    for name, ok in checks:
        print(f"{name:<56} {verdict(ok)}")
    out["checks"] = {name: ok for name, ok in checks}
    write_json(a.output, out)


if __name__ == "__main__":
    main()
