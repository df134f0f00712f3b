"""Longest sequence one process trains at under a fixed memory cap, before and after tiling.

A trial is one real training step (forward, backward, AdamW step, optimizer state created in
it) of a small Llama-style GPT (RMSNorm, SwiGLU, RoPE, GQA, untied embeddings, a 32000
vocabulary) on one sample of length s, in this process. Its memory is the peak of tensor
memory over the step, measured with megatron_cp/observability/memory_peak.py (CPU: the profiler's exact
allocation events; GPU: the allocator's high-water mark), plus the tensors live at entry
(the weights). For each variant a search over s (multiples of --granularity: doubling, then
bisecting) finds the longest s whose step stays under --cap-gib:

- untiled: the logits [s, b, v] formed whole (Megatron-LM's way);
- tiled logits: --tiled-logits-chunk-size;
- + tiled MLP: --mlp-chunks-for-training;
- + full recompute: --recompute-granularity full --recompute-method uniform --recompute-num-layers 1.

- every lever (planner): the settings the layout planner picks for this model at its longest
  sequence on one process under --cap-gib (tools/plan_layout.py --longest: tiled logits and
  tiled MLP with its chunk sizes, full recompute, and FSDP2 or the distributed optimizer,
  which on one process keep what AdamW keeps for this fp32 model), measured on a second
  step, with the first step's gradients and Adam state held, as the planner predicts.

Goals: tiled logits train at least 1.5x the untiled length under the same cap, and with every
lever the memory model's bytes at the measured longest length are within 15% of the measured
peak (the model's tolerance in tests/planning/test_memory_model.py). The planner's longest
length is printed beside the measured one, not judged: with every lever on, a step's memory
grows slowly with s (a few percent per doubling once the weights and state dominate), so a
small error in bytes moves the predicted length by far more. Prints a table with
PASS/FAIL and writes JSON (runs/benchmarks/long_context.json unless --output).

    python benchmarks/long_context.py [--cap-gib 0.35] [--device cpu|cuda] [--only-levers]
        [--output PATH]

Beside each measurement, "planner s" is the layout planner's prediction
(megatron_cp.planning: tools/plan_layout.py's longest sequence, the memory model's
search for the same model as pretrain_gpt.py flags, on one rank of --cap-gib), floored to
the granularity the measurement searches in. The planner predicts a training run's steady
state, where the fp32 gradient buffers and the Adam state exist before every forward; the
trial here is one first step, whose gradients and Adam state appear only in backward and in
the optimizer step, so where the forward's peak (the untiled logits) decides, the measured
length runs longer than the planned one.
"""
import argparse
import gc
import time
from dataclasses import replace

import torch

from bench_common import add_output_argument, verdict, write_json
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.model import GPTConfig, GPTModel

GOAL_RATIO = 1.5  # longest s with tiled logits over the untiled longest s
PLANNER_TOLERANCE = 0.15  # every lever: the model's bytes at the measured length, vs measured

VARIANTS = (  # (name, GPTConfig settings)
    ("untiled", {}),
    ("tiled logits", {"tiled_logits_chunk_size": "chunk"}),
    ("+ tiled MLP", {"tiled_logits_chunk_size": "chunk", "mlp_chunks_for_training": "mlp"}),
    ("+ full recompute", {"tiled_logits_chunk_size": "chunk", "mlp_chunks_for_training": "mlp",
                          "recompute_granularity": "full", "recompute_method": "uniform",
                          "recompute_num_layers": 1}),
)

# (header, key, width, format) of the printed table
COLUMNS = [("variant", "variant", -21, "s"), ("longest s", "longest_seq", 10, "d"),
           ("planner s", "planned_seq", 10, "d"),
           ("GiB at longest", "peak_gib", 15, ".3f"), ("x untiled", "ratio", 10, ".2f"),
           ("trials", "num_trials", 7, "d"), ("at --max-seq", "at_limit", 13, "s")]
# the GPTConfig settings of VARIANTS as pretrain_gpt.py flags, for the planner
FLAGS = {"tiled_logits_chunk_size": "--tiled-logits-chunk-size",
         "mlp_chunks_for_training": "--mlp-chunks-for-training",
         "recompute_granularity": "--recompute-granularity",
         "recompute_method": "--recompute-method", "recompute_num_layers": "--recompute-num-layers"}


def _config(a, seq, settings):
    values = {"chunk": a.chunk_size, "mlp": a.mlp_chunks}
    extra = {k: values.get(v, v) if isinstance(v, str) else v for k, v in settings.items()}
    return GPTConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                     num_query_groups=a.heads // 2, ffn_hidden_size=a.ffn, vocab_size=a.vocab,
                     max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                     activation="swiglu", normalization="RMSNorm", add_bias_linear=False,
                     untie_embeddings_and_output_weights=True, seed=1, **extra)


def step_bytes(a, seq, settings, device, steady=False):
    """Tensor bytes at the peak of one training step at length ``seq`` (weights included);
    ``steady``: of a second step, with the gradients and Adam state of the first held, as
    the planner predicts a training run."""
    model = GPTModel(_config(a, seq, settings), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, a.vocab, (1, seq), generator=gen).to(device)
                      for _ in range(2))
    position_ids = torch.arange(seq, device=device).unsqueeze(0)

    def step():
        loss = model(tokens, position_ids, labels=labels)
        loss.mean().backward()
        opt.step()
    if steady:
        step()  # gradients stay allocated (set to zero, not freed), as in training
        opt.zero_grad(set_to_none=False)
    with PeakMemory(device) as meter:
        step()
    del model, opt
    gc.collect()
    return meter.peak_total_bytes


def longest_under(a, settings, device, steady=False):
    """(longest s under the cap, its bytes, {s: bytes} of every trial): double from the
    granularity until a step goes over the cap (or --max-seq), then bisect."""
    cap, g = a.cap_gib * 2 ** 30, a.granularity
    trials = {}

    def fits(units):
        seq = units * g
        trials[seq] = step_bytes(a, seq, settings, device, steady)
        print(f"    s={seq:6d}: {trials[seq] / 2 ** 30:7.3f} GiB "
              f"{'fits' if trials[seq] <= cap else 'over'}", flush=True)
        return trials[seq] <= cap

    lo, hi = 0, 1
    while hi * g <= a.max_seq and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, a.max_seq // g + 1)  # the first length known (or assumed) not to fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * g, trials.get(lo * g, 0), trials


def _model_flags(a):
    """This model as pretrain_gpt.py flags (one sample of --granularity tokens a step)."""
    return (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {a.heads} "
            f"--group-query-attention --num-query-groups {a.heads // 2} --ffn-hidden-size {a.ffn} "
            f"--vocab-size {a.vocab} --seq-length {a.granularity} --micro-batch-size 1 "
            f"--global-batch-size 1 --hidden-dropout 0 --attention-dropout 0 --swiglu "
            f"--normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
            f"--seed 1").split()


def _device_kind(device):
    return "gpu" if device.type == "cuda" else "cpu"


def planned_seq(a, settings, device):
    """The planner's longest sequence for this variant under --cap-gib (one rank), floored to
    --granularity."""
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.planning.layouts import run_config, with_planner_defaults
    from megatron_cp.planning.search import max_seq_length
    values = {"chunk": a.chunk_size, "mlp": a.mlp_chunks}
    argv = _model_flags(a)
    for key, value in settings.items():
        argv += [FLAGS[key], str(values.get(value, value) if isinstance(value, str) else value)]
    run = run_config(parse_args(with_planner_defaults(argv), world_size=1))
    longest = max_seq_length(run, a.cap_gib * 2 ** 30, _device_kind(device), limit=a.max_seq)
    return longest // a.granularity * a.granularity


def planner_pick(a, device):
    """The planner's row (tools/plan_layout.py --longest --json) for this model on one process
    under --cap-gib: its longest sequence and the settings it picks there."""
    import contextlib
    import io
    import json
    from megatron_cp.planning import plan_layout
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = plan_layout.main(_model_flags(a) + [
            "--num-gpus", "1", "--gpu-memory-gb", str(a.cap_gib), "--device",
            _device_kind(device), "--longest", "--json", "--top", "1"])
    assert status == 0, "the planner refused the benchmark's model"
    return json.loads(out.getvalue())["layouts"][0]


def planned_bytes(a, row, seq, device):
    """The memory model's bytes for the planner's pick ``row`` at length ``seq``."""
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.planning.layouts import run_config, with_planner_defaults
    from megatron_cp.planning.memory import estimate_memory
    argv = _model_flags(a) + row["flags"]
    run = run_config(parse_args(with_planner_defaults(argv), world_size=1))
    run = replace(run, data=replace(run.data, seq_length=seq),
                  model=replace(run.model, max_position_embeddings=seq))
    return estimate_memory(run, _device_kind(device)).total_bytes


def _pick_settings(row):
    """The GPTConfig settings of the planner's row ``row`` (its optimizer keeps, on one
    process, what AdamW keeps)."""
    settings = {"tiled_logits_chunk_size": row["tiled_logits_chunk_size"],
                "mlp_chunks_for_training": row["mlp_chunks"]}
    if row["recompute"] == "selective":
        settings["recompute_granularity"] = "selective"
    elif row["recompute"].startswith("full/"):
        _, method, layers = row["recompute"].split("/")
        settings.update(recompute_granularity="full", recompute_method=method,
                        recompute_num_layers=int(layers))
    return settings


def rows(a, device):
    """One dict per variant: name, longest s under the cap, its bytes, the ratio to the
    untiled length, the trials, and the planner's prediction (:func:`planned_seq`)."""
    out = []
    pick = planner_pick(a, device)
    picked = ("every lever (planner)", _pick_settings(pick))
    for name, settings in (() if a.only_levers else VARIANTS) + (picked,):
        print(f"  {name}: {settings}", flush=True)
        start = time.time()
        levers = settings is picked[1]
        seq, used, trials = longest_under(a, settings, device, steady=levers)
        planned = pick["max_seq_length"] // a.granularity * a.granularity if levers \
            else planned_seq(a, settings, device)
        out.append({"variant": name, "settings": settings, "longest_seq": seq,
                    "planned_seq": planned, "peak_bytes": used, "peak_gib": used / 2 ** 30,
                    "num_trials": len(trials), "trials": trials,
                    "seconds": time.time() - start})
    out[-1]["planner_row"] = pick
    out[-1]["planned_bytes_at_longest"] = planned_bytes(a, pick, out[-1]["longest_seq"], device)
    for row in out:  # the search stopped at --max-seq: the true longest is at least that
        row["at_limit"] = "yes" if row["longest_seq"] + a.granularity > a.max_seq else ""
    base = out[0]["longest_seq"] if not a.only_levers else 0
    for row in out:
        row["ratio"] = row["longest_seq"] / base if base else float("inf")
    return out


def print_table(table):
    def cell(value, width, spec=""):
        align = "<" if width < 0 else ">"
        return f"{value:{align}{abs(width)}{spec}}"
    print("  ".join(cell(header, width) for header, _, width, _ in COLUMNS))
    for row in table:
        print("  ".join(cell(row[key], width, spec) for _, key, width, spec in COLUMNS))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-gib", type=float, default=0.35, help="memory cap of one step (GiB)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=352, help="SwiGLU hidden size (Llama: ~8/3 hidden)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk-size", type=int, default=256, help="--tiled-logits-chunk-size")
    p.add_argument("--mlp-chunks", type=int, default=8, help="--mlp-chunks-for-training")
    p.add_argument("--granularity", type=int, default=256, help="lengths searched are multiples")
    p.add_argument("--max-seq", type=int, default=65536, help="longest length tried")
    p.add_argument("--only-levers", action="store_true",
                   help="measure only the every-lever variant against the planner (a few minutes)")
    add_output_argument(p, "long_context")
    a = p.parse_args()
    device = torch.device(a.device)
    print(f"cap {a.cap_gib} GiB, {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, "
          f"device {device}", flush=True)
    table = rows(a, device)
    print_table(table)
    tiling_passed = None
    if not a.only_levers:
        ratio = table[1]["ratio"]
        tiling_passed = ratio >= GOAL_RATIO
        print(f"tiled logits / untiled longest s = {ratio:.2f} (goal >= {GOAL_RATIO}): "
              f"{verdict(tiling_passed)}")
    levers = table[-1]
    off = levers["longest_seq"] / levers["planned_seq"] - 1 if levers["planned_seq"] else 1.0
    bytes_off = levers["planned_bytes_at_longest"] / levers["peak_bytes"] - 1
    planner_passed = abs(bytes_off) <= PLANNER_TOLERANCE
    print(f"every lever: at the measured longest s {levers['longest_seq']} the memory model "
          f"predicts {levers['planned_bytes_at_longest'] / 2 ** 30:.3f} GiB, measured "
          f"{levers['peak_gib']:.3f} ({bytes_off:+.1%}, goal within {PLANNER_TOLERANCE:.0%}): "
          f"{verdict(planner_passed)}; the planner's longest s {levers['planned_seq']} "
          f"(measured {off:+.1%} from it)")
    write_json(a.output, {"config": vars(a), "rows": table, "goal": GOAL_RATIO,
                          "planner_tolerance": PLANNER_TOLERANCE,
                          "tiling_passed": tiling_passed, "planner_passed": planner_passed,
                          "passed": tiling_passed is not False and planner_passed})


if __name__ == "__main__":
    main()
