"""Longest sequence a 2-layer GPT trains under a fixed per-rank memory cap, CP=1 vs CP=4.

Each trial is a fresh set of gloo processes running one real training step (forward,
backward, AdamW) of a 2-layer model on one sample of length s, split by zigzag CP with ring
attention. A rank's memory is the peak resident set during the step above the resident set
of a process that has only imported torch and joined the process group (VmHWM is reset via
/proc/self/clear_refs; big allocations are forced to mmap so freed memory leaves RSS).

The cap is the CP=1 step memory at --cap-seq tokens. For CP=1 and CP=4 a binary search over
lengths (multiples of --granularity) finds the longest s whose max per-rank memory stays
under the cap; goal: CP=4 reaches >= 3.8x the CP=1 length. Prints a table and writes JSON.

    PYTHONPATH=.:tests python benchmarks/cp_max_sequence.py [--cap-seq 8192] [--output benchmarks/results/cp_max_sequence.json]

The JSON goes to runs/benchmarks/cp_max_sequence.json (untracked) unless --output says otherwise;
a quick smoke run: --cap-seq 512 --granularity 256.
"""
import argparse
import os

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned workers

import torch  # noqa: E402

from bench_common import add_output_argument, verdict, write_json  # noqa: E402
from dist_harness import run_workers  # noqa: E402

GOAL_RATIO = 3.8  # longest sequence under the cap, CP=4 over CP=1


def _kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trial(rank, world, seq, hidden, heads, vocab):
    from megatron_cp.data.microbatch import prepare_microbatch
    from megatron_cp.distributed.initialize import initialize_model_parallel
    from megatron_cp.model import GPTConfig, GPTModel
    state = initialize_model_parallel(context_parallel_size=world)
    baseline = _kib("VmRSS")
    config = GPTConfig(num_layers=2, hidden_size=hidden, num_attention_heads=heads,
                       vocab_size=vocab, make_vocab_size_divisible_by=1, max_position_embeddings=seq,
                       hidden_dropout=0.0, attention_dropout=0.0, cp_comm_type="p2p")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark
    model = GPTModel(config, state=state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    text = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": text[:, :-1], "labels": text[:, 1:],
             "loss_mask": torch.ones(1, seq), "position_ids": torch.arange(seq).unsqueeze(0),
             "document_ids": None}
    batch = prepare_microbatch(batch, state.rank("cp"), world)  # as the trainer does
    loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 token_index=batch.get("token_index"))
    (loss * batch["loss_mask"]).sum().backward()
    opt.step()
    return (_kib("VmHWM") - baseline) * 1024


def step_memory(cp, seq, a):
    """Max over ranks of the training step's peak memory (bytes)."""
    return max(run_workers(_trial, cp, seq, a.hidden, a.heads, a.vocab, timeout=1200))


def longest_under(cp, cap, a, lo, hi):
    """Largest multiple of the granularity in [lo, hi] whose step memory is <= cap."""
    g = a.granularity
    lo, hi = lo // g, hi // g
    trials = {}
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mem = step_memory(cp, mid * g, a)
        trials[mid * g] = mem
        print(f"  CP={cp} s={mid * g:6d}: {mem / 2**20:8.1f} MiB {'fits' if mem <= cap else 'over'}",
              flush=True)
        lo, hi = (mid, hi) if mem <= cap else (lo, mid - 1)
    return lo * g, trials


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-seq", type=int, default=8192, help="CP=1 length that defines the cap")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--granularity", type=int, default=512, help="lengths searched are multiples of this")
    add_output_argument(p, "cp_max_sequence")
    a = p.parse_args()
    cap = step_memory(1, a.cap_seq, a)
    print(f"cap = CP=1 step memory at s={a.cap_seq}: {cap / 2**20:.1f} MiB", flush=True)
    best1, trials1 = longest_under(1, cap, a, a.cap_seq, 2 * a.cap_seq)
    best4, trials4 = longest_under(4, cap, a, a.cap_seq, 8 * a.cap_seq)
    ratio = best4 / best1
    print(f"{'CP':>3} {'longest s under cap':>20}")
    print(f"{1:>3} {best1:>20d}\n{4:>3} {best4:>20d}")
    print(f"ratio CP=4 / CP=1 = {ratio:.2f} (goal >= {GOAL_RATIO}): {verdict(ratio >= GOAL_RATIO)}")
    write_json(a.output, {"config": vars(a), "cap_bytes": cap, "longest": {"1": best1, "4": best4},
                          "ratio": ratio, "goal": GOAL_RATIO, "passed": ratio >= GOAL_RATIO,
                          "trials": {"1": trials1, "4": trials4}})


if __name__ == "__main__":
    main()
