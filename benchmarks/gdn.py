"""Gated DeltaNet against full attention on the CPU, and the CP scaling of its two paths.

1. Forward + backward of one token mixer of width h = 256 over a sequence of s tokens
   (batch 1): a GDN layer (2 key / 4 value heads of 64, conv 4, the chunked gated delta rule
   of megatron_cp/layers/gated_delta_rule.py) against causal softmax attention (4 heads of
   64, SDPA). Goal: GDN's time grows linearly in s (time(s_max) / time(s_min) <= 1.5 x
   s_max / s_min) and attention's faster (its ratio above GDN's).
2. The per-rank compute of GDN under CP = 1, 2, 4 at s = --cp-seq (ranks simulated in one
   process; the exchanges are O(state) and O(w) per rank, not timed): state passing runs
   s / CP tokens of every head per rank, the a2a path all s tokens of 1 / CP of the key
   heads (4 key heads here, so CP = 4 works). Goal: both at CP = 4 take <= 0.4 x the CP = 1
   time (linear scaling: 0.25).

Time is the calling thread's CPU time, one thread, min over repeats (the machine is shared).
The process runs with glibc's heap kept (KEEP_HEAP; it re-executes itself with those variables
unless --glibc-default-heap): by default glibc maps every allocation above its mmap threshold
(which adapts up to 32 MiB) afresh and unmaps it on free, so every call page-faults each
large tensor anew. That kernel time is the same for any PyTorch code whose tensors cross 32
MiB; it grows with the number of tensors that cross it (at s = 64k most of both layers'), not
with the layer's arithmetic, and measured that way the user time of GDN stays linear while its
system time jumps. Both layers run under the same setting (PyTorch's CPU tuning guides reach
the same end with jemalloc or tcmalloc).
s = 32k and 64k are left out by default (--max-seq 16384): attention's s^2 work takes
minutes per repeat on a shared 2-core box.

Run: python benchmarks/gdn.py [--max-seq 16384] [--cp-seq 8192] [--repeats 2]
     [--glibc-default-heap] [--output PATH]
"""
import argparse
import os
import sys

import torch

from bench_common import (add_output_argument, layer_fwd_bwd_time, verdict,
                          write_json)
from megatron_cp.model import GPTConfig
from megatron_cp.model.attention import SelfAttention
from megatron_cp.model.gated_delta_net import GatedDeltaNet
from megatron_cp.tensor_parallel import model_parallel_seed

SEQUENCES = (4096, 8192, 16384, 32768, 65536)
KEEP_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(2 ** 40), "MALLOC_TRIM_THRESHOLD_": str(2 ** 40)}
HIDDEN = 256


def _config(key_heads=2):
    return GPTConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=128,
                     ffn_hidden_size=512, max_position_embeddings=65536, hidden_dropout=0.0,
                     attention_dropout=0.0, activation="swiglu", add_bias_linear=False,
                     experimental_attention_variant="gdn", linear_attention_freq="2",
                     linear_num_key_heads=key_heads, linear_num_value_heads=2 * key_heads,
                     linear_key_head_dim=64, linear_value_head_dim=64)


def layer_times(max_seq, repeats):
    """[{s, gdn_s, attention_s}] for the sizes up to ``max_seq``."""
    gdn = GatedDeltaNet(_config(), "gdn", None)
    attention = SelfAttention(_config(), "attention", None, None,
                              model_parallel_seed(7, 0, torch.device("cpu")))
    rows = []
    for s in (n for n in SEQUENCES if n <= max_seq):
        rows.append({"s": s, "gdn_s": layer_fwd_bwd_time(gdn, s, HIDDEN, repeats),
                     "attention_s": layer_fwd_bwd_time(attention, s, HIDDEN, repeats)})
        print(f"s={s:>6}: GDN {rows[-1]['gdn_s']:.3f} s, attention {rows[-1]['attention_s']:.3f} s",
              flush=True)
    return rows


def cp_times(s, repeats):
    """{cp: {state_passing_s, a2a_s}}: one rank's GDN compute at CP = 1, 2, 4."""
    out = {}
    for cp in (1, 2, 4):
        whole_heads = GatedDeltaNet(_config(4), "gdn", None)  # s / cp tokens, every head
        head_slice = GatedDeltaNet(_config(4 // cp), "gdn", None)  # all s tokens, 1 / cp heads
        out[cp] = {"state_passing_s": layer_fwd_bwd_time(whole_heads, s // cp, HIDDEN, repeats),
                   "a2a_s": layer_fwd_bwd_time(head_slice, s, HIDDEN, repeats)}
        print(f"CP={cp}: state passing {out[cp]['state_passing_s']:.3f} s, "
              f"a2a {out[cp]['a2a_s']:.3f} s per rank", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-seq", type=int, default=16384,
                   help="largest s of the layer comparison (of 4k, 8k, 16k, 32k, 64k)")
    p.add_argument("--cp-seq", type=int, default=8192, help="s of the CP scaling")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--glibc-default-heap", action="store_true",
                   help="keep glibc's default mmap and trim thresholds (see the docstring)")
    add_output_argument(p, "gdn")
    a = p.parse_args(argv)
    if not a.glibc_default_heap and argv is None and any(
            os.environ.get(k) != v for k, v in KEEP_HEAP.items()):
        sys.stdout.flush()  # glibc reads the variables at start-up: run again with them
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KEEP_HEAP})
    heap = "glibc default" if a.glibc_default_heap else "glibc, heap kept (" + ", ".join(
        f"{k}={v}" for k, v in KEEP_HEAP.items()) + ")"
    torch.set_num_threads(1)
    rows = layer_times(a.max_seq, a.repeats)
    if len(rows) < 2:
        raise ValueError(f"--max-seq {a.max_seq} leaves fewer than two sizes; give >= 8192")
    first, last = rows[0], rows[-1]
    growth = last["s"] / first["s"]
    gdn_ratio = last["gdn_s"] / first["gdn_s"]
    attention_ratio = last["attention_s"] / first["attention_s"]
    layer_pass = gdn_ratio <= 1.5 * growth and attention_ratio > gdn_ratio
    cp = cp_times(a.cp_seq, a.repeats)
    scaling = {path: cp[4][path] / cp[1][path] for path in ("state_passing_s", "a2a_s")}
    cp_pass = all(v <= 0.4 for v in scaling.values())
    print(f"\n| s | GDN fwd+bwd (s) | attention fwd+bwd (s) | attention / GDN |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['s']} | {r['gdn_s']:.3f} | {r['attention_s']:.3f} | "
              f"{r['attention_s'] / r['gdn_s']:.2f} |")
    print(f"s x{growth:.0f}: GDN x{gdn_ratio:.2f}, attention x{attention_ratio:.2f} -> "
          f"{verdict(layer_pass)} (GDN <= x{1.5 * growth:.0f}, attention above GDN)")
    print(f"\n| CP | state passing per rank (s) | a2a per rank (s) |\n|---|---|---|")
    for n, t in cp.items():
        print(f"| {n} | {t['state_passing_s']:.3f} | {t['a2a_s']:.3f} |")
    print(f"CP=4 / CP=1 at s={a.cp_seq}: state passing {scaling['state_passing_s']:.2f}, a2a "
          f"{scaling['a2a_s']:.2f} -> {verdict(cp_pass)} (both <= 0.40)")
    write_json(a.output, {"allocator": heap, "layer": rows, "cp_seq": a.cp_seq, "cp": cp,
                          "cp_scaling": scaling, "layer_goal": verdict(layer_pass),
                          "cp_goal": verdict(cp_pass)})
    return 0 if layer_pass and cp_pass else 1


if __name__ == "__main__":
    sys.exit(main())
