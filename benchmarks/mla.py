"""Multi-latent attention (MLA) against standard attention: KV-cache bytes and CPU time.

1. KV-cache bytes per token and layer, read off the cache tensors our generation allocates
   (megatron_cp/inference/kv_cache.py: a LatentCache per MLA layer, keys and values per
   standard layer) after one cached forward of a one-layer model built on the meta device
   (the shapes and dtypes are real; nothing is computed or held). bf16, DeepSeek-V3's
   attention sizes: hidden 7168, 128 heads,
   - MLA: --kv-lora-rank 512 --qk-pos-emb-head-dim 64 (--q-lora-rank 1536, --qk-head-dim 128,
     --v-head-dim 128): the normalised latent and the rotated shared key, 576 numbers;
   - GQA-8: the same hidden and heads with 8 key/value groups of head dim 128 (the quality
     class DeepSeek-V2's paper compares MLA with, and Llama-3-70B's layout), 2 x 8 x 128;
   - MHA: 128 key/value heads of 128, 2 x 128 x 128.
   Goal: MLA's bytes <= 0.30 x GQA-8's and <= 0.02 x MHA's (DeepSeek-V2 reports MLA's cache
   as that of GQA with 2.25 groups: 0.28 x GQA-8).
2. Forward + backward CPU time (one thread, min over repeats) of one MLA layer against one
   standard attention layer of the same hidden size 1024 and 8 heads of 128 (MHA, rope,
   SDPA core), at several sequence lengths (batch 1, fp32). MLA: q-LoRA 384, kv-LoRA 512,
   qk 128 + rope 64, v 128 (DeepSeek-V3's head dims). Goal: MLA <= 2.0 x the standard layer's
   time at every length (its extra cost: the up projections and a 192-wide q/k head;
   counted, MLA's projections are ~1.6 x and its core 1.25 x the standard layer's).

Run: python benchmarks/mla.py [--seqs 512 1024 2048] [--repeats 2] [--output PATH]
"""
import argparse
import sys

import torch

from bench_common import (add_output_argument, layer_fwd_bwd_time, verdict,
                          write_json)
from megatron_cp.inference.kv_cache import KVCache, cached_chunk_forward
from megatron_cp.inference.mla_cache import LatentCache
from megatron_cp.model import GPTConfig, GPTModel
from megatron_cp.model.attention import SelfAttention
from megatron_cp.model.multi_latent_attention import MultiLatentAttention
from megatron_cp.tensor_parallel import model_parallel_seed

DSV3_MLA = dict(multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True)
CACHE_GOALS = {"gqa8": 0.30, "mha": 0.02}
TIME_GOAL = 2.0


def _config(hidden, heads, **changes):
    return GPTConfig(**{**dict(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, vocab_size=128,
        ffn_hidden_size=64, max_position_embeddings=8192, hidden_dropout=0.0,
        attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False,
        position_embedding_type="rope", make_vocab_size_divisible_by=128), **changes})


def cache_bytes_per_token(config, tokens=16):
    """Bytes per token of the one layer's cache our generation allocates for ``config``
    (capacity ``tokens``, batch 1), from the cache tensors themselves."""
    with torch.device("meta"):
        model = GPTModel(config).eval()
    cache = KVCache([model], tokens)
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    with torch.no_grad():
        cached_chunk_forward(model, ids, torch.arange(4, device="meta")[None], None,
                             cache.layers[0])
    layer = cache.layers[0][0]
    held = [layer.latents] if isinstance(layer, LatentCache) else [layer.keys, layer.values]
    return sum(t.numel() * t.element_size() for t in held) // tokens


def cache_table():
    """{name: bytes per token per layer} of DeepSeek-V3's MLA, GQA-8 and MHA (bf16)."""
    bf16 = dict(params_dtype=torch.bfloat16)
    configs = {"mla": _config(7168, 128, **DSV3_MLA, **bf16),
               "gqa8": _config(7168, 128, num_query_groups=8, kv_channels=128, **bf16),
               "mha": _config(7168, 128, kv_channels=128, **bf16)}
    return {name: cache_bytes_per_token(c) for name, c in configs.items()}


def layer_times(seqs, repeats, hidden=1024, heads=8):
    """[{s, mla_s, attention_s}]: one MLA layer against one standard layer."""
    rng = model_parallel_seed(7, 0, torch.device("cpu"))
    mla = MultiLatentAttention(_config(hidden, heads, **{**DSV3_MLA, "q_lora_rank": 384}), "mla",
                               None, None, rng)
    attention = SelfAttention(_config(hidden, heads, kv_channels=128), "attention", None, None, rng)
    rows = []
    for s in seqs:
        rows.append({"s": s, "mla_s": layer_fwd_bwd_time(mla, s, hidden, repeats),
                     "attention_s": layer_fwd_bwd_time(attention, s, hidden, repeats)})
        print(f"s={s:>5}: MLA {rows[-1]['mla_s']:.3f} s, attention {rows[-1]['attention_s']:.3f} s",
              flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=2)
    add_output_argument(p, "mla")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cache = cache_table()
    ratios = {name: cache["mla"] / cache[name] for name in CACHE_GOALS}
    cache_pass = all(ratios[name] <= goal for name, goal in CACHE_GOALS.items())
    print("| attention (DeepSeek-V3 sizes, bf16) | KV-cache bytes / token / layer | MLA / it |")
    print("|---|---|---|")
    for name, n in cache.items():
        print(f"| {name} | {n} | {cache['mla'] / n:.3f} |")
    print(f"MLA / GQA-8 {ratios['gqa8']:.3f}, MLA / MHA {ratios['mha']:.4f} -> "
          f"{verdict(cache_pass)} (<= {CACHE_GOALS['gqa8']}, <= {CACHE_GOALS['mha']})")
    rows = layer_times(a.seqs, a.repeats)
    for r in rows:
        r["ratio"] = r["mla_s"] / r["attention_s"]
    time_pass = all(r["ratio"] <= TIME_GOAL for r in rows)
    print("\n| s | MLA fwd+bwd (s) | attention fwd+bwd (s) | MLA / attention |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['s']} | {r['mla_s']:.3f} | {r['attention_s']:.3f} | {r['ratio']:.2f} |")
    print(f"-> {verdict(time_pass)} (MLA <= {TIME_GOAL} x attention at every s)")
    write_json(a.output, {"cache_bytes_per_token_per_layer": cache, "cache_ratios": ratios,
                          "cache_goal": verdict(cache_pass), "layer": rows,
                          "time_goal": verdict(time_pass)})
    return 0 if cache_pass and time_pass else 1


if __name__ == "__main__":
    sys.exit(main())
