"""Packed documents without CP on the CPU: the segment plan against SDPA with a boolean mask.

Forward + backward of one attention call over a packed sample, two ways: the segment path
local_attention takes (one CPU-flash call per document, ``masked_attention``) and
``scaled_dot_product_attention`` with the [b, 1, s, s] causal/document mask (what the
local path used before). Time is the calling thread's CPU time, one thread, min over
repeats (the box is shared, so wall time is not a measure). Goal: the segment path is no
slower than the mask at every size from s = 1024 up (it does less work: sum(len^2) vs s^2).

Run: python benchmarks/local_attention_cpu.py [--repeats N] [--output PATH]
"""
import argparse

import torch

from bench_common import add_output_argument, min_thread_time, verdict, write_json
from megatron_cp.context_parallel import attention_mask, masked_attention

# (sequence, document length, query heads, head dim, batch); KV heads = query heads / 2
SHAPES = [(32, 5, 4, 8, 2), (512, 37, 4, 32, 1), (1024, 128, 8, 64, 1), (2048, 256, 8, 64, 1),
          (2048, 1024, 8, 64, 1), (2048, 300, 8, 64, 2), (4096, 512, 4, 64, 1)]


def measure(s, doc_len, nh, d, b, repeats):
    """(mask SDPA seconds, segment path seconds) for one shape."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, nh, s, d, generator=gen).requires_grad_()
    k, v = (torch.randn(b, nh // 2, s, d, generator=gen).requires_grad_() for _ in range(2))
    tokens = torch.arange(s).expand(b, s)
    docs = (torch.arange(s) // doc_len).expand(b, s)

    def mask_sdpa():
        mask = attention_mask(tokens, tokens, docs, docs)  # [b, 1, s, s]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                               enable_gqa=True)
        out.sum().backward()

    def segments():
        masked_attention(q, k, v, tokens, tokens, docs, docs).sum().backward()

    return min_thread_time(mask_sdpa, repeats, warmup=1), min_thread_time(segments, repeats, warmup=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    add_output_argument(parser, "local_attention_cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"{'s':>6} {'doc':>5} {'heads':>5} {'d':>4} {'b':>2} {'mask ms':>9} {'segments ms':>12}")
    for s, doc_len, nh, d, b in SHAPES:
        mask_s, seg_s = measure(s, doc_len, nh, d, b, args.repeats)
        rows.append(dict(seq_len=s, doc_len=doc_len, heads=nh, head_dim=d, batch=b,
                         mask_sdpa_seconds=mask_s, segments_seconds=seg_s))
        print(f"{s:>6} {doc_len:>5} {nh:>5} {d:>4} {b:>2} {mask_s * 1e3:>9.2f} {seg_s * 1e3:>12.2f}")
    passed = all(r["segments_seconds"] <= r["mask_sdpa_seconds"] for r in rows if r["seq_len"] >= 1024)
    print(f"goal: segments no slower than the mask from s = 1024: {verdict(passed)}")
    write_json(args.output, {"config": vars(args) | {"torch": torch.__version__, "threads": 1},
                             "rows": rows, "passed": passed})


if __name__ == "__main__":
    main()
