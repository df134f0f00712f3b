"""Training throughput of megatron_cp at one process against Hugging Face's LlamaForCausalLM.

Both models are built from the same Llama-style config (RMSNorm, SwiGLU, RoPE, no biases,
untied embeddings), with no download, and trained on the same random token batches with
AdamW, in the same run. Prints a table and writes JSON with tokens/s of each, their ratio,
and each model's achieved FLOP/s against this machine's measured fp32 matmul FLOP/s.

Goal: megatron_cp trains at least as fast as HF Llama, within timing noise: tokens/s ratio
megatron_cp / HF >= 0.95 (PASS/FAIL printed with the table).

    python benchmarks/throughput.py [--iters 10] [--output benchmarks/results/throughput.json]

The JSON goes to runs/benchmarks/throughput.json (untracked) unless --output says otherwise.
"""
import argparse
import time

import torch

from bench_common import add_output_argument, verdict, write_json
from megatron_cp.model import GPTConfig, GPTModel
from megatron_cp.observability.training_log import model_flops_per_token


GOAL_RATIO = 0.95  # tokens/s of megatron_cp over HF Llama: parity within timing noise


def matmul_flops(n=1024, reps=20):
    """Measured fp32 matmul FLOP/s of this machine (the peak reference)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def time_training(step, iters, warmup):
    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_output_argument(p, "throughput")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(a.seq).expand(a.batch, a.seq)

    config = GPTConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                       num_query_groups=a.kv_heads, ffn_hidden_size=a.ffn, vocab_size=a.vocab,
                       make_vocab_size_divisible_by=1, max_position_embeddings=a.seq,
                       position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                       add_bias_linear=False, untie_embeddings_and_output_weights=True,
                       hidden_dropout=0.0, attention_dropout=0.0, norm_epsilon=1e-6)
    ours = GPTModel(config)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)

    def step_ours():
        opt_ours.zero_grad(set_to_none=True)
        ours(inputs, positions, labels=labels).mean().backward()
        opt_ours.step()

    from transformers import LlamaConfig, LlamaForCausalLM
    hf_config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                            num_hidden_layers=a.layers, num_attention_heads=a.heads,
                            num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                            mlp_bias=False, attn_implementation="sdpa")
    hf = LlamaForCausalLM(hf_config)
    hf.train()
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def step_hf():
        opt_hf.zero_grad(set_to_none=True)
        logits = hf(input_ids=inputs).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab).float(),
                                          labels.reshape(-1)).backward()
        opt_hf.step()

    peak = matmul_flops()
    results = {}
    # alternate the two so both see the same machine state; best of two rounds each
    for name, step in (("megatron_cp", step_ours), ("hf_llama", step_hf)) * 2:
        sec = time_training(step, a.iters, a.warmup)
        results[name] = min(results.get(name, float("inf")), sec)
    n_params = {"megatron_cp": sum(p.numel() for p in ours.parameters()),
                "hf_llama": sum(p.numel() for p in hf.parameters())}
    flops_per_token = model_flops_per_token(config, a.seq)
    rows = []
    for name, sec in results.items():
        tps = a.batch * a.seq / sec
        rows.append({"model": name, "params": n_params[name], "sec_per_iter": sec,
                     "tokens_per_s": tps, "model_flops_per_s": tps * flops_per_token,
                     "fraction_of_matmul_peak": tps * flops_per_token / peak})
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    out = {"config": vars(a), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "matmul_peak_flops": peak, "model_flops_per_token": flops_per_token, "results": rows,
           "ratio_megatron_cp_over_hf": ratio, "goal": GOAL_RATIO, "passed": ratio >= GOAL_RATIO}
    print(f"{'model':<12} {'params':>10} {'s/iter':>8} {'tokens/s':>10} {'GFLOP/s':>9} {'of peak':>8}")
    for r in rows:
        print(f"{r['model']:<12} {r['params']:>10d} {r['sec_per_iter']:>8.3f} {r['tokens_per_s']:>10.1f} "
              f"{r['model_flops_per_s'] / 1e9:>9.2f} {r['fraction_of_matmul_peak']:>8.1%}")
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s; tokens/s ratio megatron_cp / HF Llama = {ratio:.3f} "
          f"(goal >= {GOAL_RATIO}): {verdict(ratio >= GOAL_RATIO)}")
    write_json(a.output, out)


if __name__ == "__main__":
    main()
