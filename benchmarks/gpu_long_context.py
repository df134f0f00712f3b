"""The longest sequence one GPU trains the Llama-style 1.3B config at (benchmarks/gpu.py's
MODEL_1P3B; bf16 parameters with fp32 master weights, fp32 gradients and AdamW states, as
pretrain_gpt.py --bf16 holds them), at CP=1 on the flash path, with full recompute and
without
(--recompute none).

A length "trains" when one whole step runs: forward and backward of one sample of that many
tokens (micro batch 1) and the AdamW step. The search doubles the length from --start until a
step runs out of memory, then bisects down to --granularity tokens. Each attempt prints its
peak memory and time; the tensor that failed to be allocated is named in the out-of-memory
line, which tells what limits the length.

    python benchmarks/gpu_long_context.py                       # full recompute and none
    python benchmarks/gpu_long_context.py --smoke --device cpu  # the script's logic, tiny

Goal (issue 24): report the figure and what limits it; no pass/fail threshold of its own
beyond "the 1.3B config trains at 4x its 4096 training length", printed as the verdict.
"""
import argparse
import time

import torch

from bench_common import add_output_argument, verdict, write_json
from megatron_cp.distributed import device as device_mod
from megatron_cp.model import GPTConfig, GPTModel

BASE_SEQ = 4096
MODEL = dict(layers=24, hidden=2048, heads=16, ffn=5504, vocab=32000)
SMOKE = dict(layers=2, hidden=64, heads=4, ffn=172, vocab=256)


def config(m, seq, recompute, params_dtype):
    full = recompute == "full"
    return GPTConfig(num_layers=m["layers"], hidden_size=m["hidden"],
                     num_attention_heads=m["heads"], ffn_hidden_size=m["ffn"],
                     vocab_size=m["vocab"], make_vocab_size_divisible_by=128,
                     max_position_embeddings=seq, position_embedding_type="rope",
                     normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                     untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                     attention_dropout=0.0, params_dtype=params_dtype,
                     recompute_granularity="full" if full else None,
                     recompute_method="uniform" if full else None,
                     recompute_num_layers=1 if full else None)


class Run:
    """One model with fp32 masters and AdamW; :meth:`step` trains one sample of ``seq``."""

    def __init__(self, m, recompute, device, max_seq):
        low = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.m, self.device = m, device
        self.model = GPTModel(config(m, max_seq, recompute, low), device=device)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params] if low != torch.float32 \
            else self.params
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-5)

    def step(self, seq):
        tokens = torch.randint(0, self.m["vocab"], (1, seq + 1), device=self.device)
        positions = torch.arange(seq, device=self.device)[None]
        loss = self.model(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean()
        loss.backward()
        for master, param in zip(self.masters, self.params):
            if master is not param:
                master.grad, param.grad = param.grad.float(), None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                for master, param in zip(self.masters, self.params):
                    param.copy_(master)
        return float(loss.detach())


def attempt(run, seq):
    """(ok, peak GiB, seconds, what failed) of one step at ``seq``."""
    device_mod.empty_cache(run.device)
    device_mod.reset_peak_memory(run.device)
    start = time.perf_counter()
    try:
        run.step(seq)
        device_mod.synchronize(run.device)
        ok, why = True, ""
    except torch.OutOfMemoryError as error:
        ok, why = False, str(error).split("\n")[0][:200]
    for param in run.params:
        param.grad = None
    peak = device_mod.max_memory_allocated(run.device) / 2 ** 30
    return ok, peak, time.perf_counter() - start, why


def search(run, start, granularity, limit, save):
    """The longest length that trains, found by doubling then bisecting; every attempt.
    ``save(longest, attempts)`` is called after each attempt (a run stopped by a time limit
    keeps what it measured)."""
    attempts, good, bad, seq = [], None, None, start
    while seq <= limit:
        ok, peak, seconds, why = attempt(run, seq)
        attempts.append(dict(seq=seq, ok=ok, peak_gib=round(peak, 2), seconds=round(seconds, 2),
                             error=why))
        print(f"  s={seq:>8}  {'ok ' if ok else 'OOM'}  peak {peak:7.2f} GiB  {seconds:7.1f} s  {why}",
              flush=True)
        if ok:
            good = seq
        else:
            bad = seq
        save(good, attempts)
        if bad is None:
            seq *= 2
        else:
            if good is None or bad - good <= granularity:
                break
            seq = (good + bad) // 2 // granularity * granularity
    return good, attempts


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if device_mod.accelerator_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny model and lengths")
    p.add_argument("--recompute", nargs="+", default=["full"], choices=["full", "none"],
                   help="full (default) and/or none (no recomputation)")
    p.add_argument("--start", type=int, default=None, help="first length (default 32768)")
    p.add_argument("--granularity", type=int, default=None, help="bisection step (default 16384)")
    p.add_argument("--limit", type=int, default=None, help="longest length tried (default 2**21)")
    add_output_argument(p, "gpu_long_context")
    a = p.parse_args()
    device = torch.device(a.device)
    m = SMOKE if a.smoke else MODEL
    start = a.start or (64 if a.smoke else 32768)
    granularity = a.granularity or (32 if a.smoke else 16384)
    limit = a.limit or (512 if a.smoke else 2 ** 21)
    out = {"device": device_mod.device_name(device), "torch": torch.__version__,
           "cuda": torch.version.cuda, "smoke": a.smoke, "model": m, "runs": {}}
    for recompute in a.recompute:
        print(f"recompute {recompute}:", flush=True)
        run = Run(m, recompute, device, limit)

        def save(longest, attempts, recompute=recompute):
            out["runs"][recompute] = {"longest_seq": longest, "attempts": attempts}
            write_json(a.output, out)
        search(run, start, granularity, limit, save)
        del run
    print(f"{'recompute':<10} {'longest s':>10}  limit (first failed allocation)")
    for recompute, r in out["runs"].items():
        failed = [x for x in r["attempts"] if not x["ok"]]
        print(f"{recompute:<10} {str(r['longest_seq']):>10}  {failed[-1]['error'] if failed else '-'}")
    best = max((r["longest_seq"] or 0) for r in out["runs"].values())
    ok = best >= 4 * (64 if a.smoke else BASE_SEQ)
    print(f"{'trains at >= 4x its training length':<36} {verdict(ok)}")
    write_json(a.output, out)


if __name__ == "__main__":
    main()
