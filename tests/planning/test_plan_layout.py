"""tools/plan_layout.py: a consistent table for Llama-3-8B on 8 and 32 GPUs of 80 GiB; the
dimensions and settings a line gives are kept; only the model, batch and precision flags are
needed; mistakes are error lines; and the longest sequence it plans for a tiny CPU model,
with the settings it picks, trains within the memory cap (measured)."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from dist_harness import run_workers

from megatron_cp.cli.arguments import parse_args
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.planning import plan_layout
from megatron_cp.planning.layouts import run_config, with_planner_defaults
from megatron_cp.planning.search import Limits, PlannedLayout, max_seq_length, sequence_unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Llama-3-8B as Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh trains it (bf16 here):
# the model, batch and precision flags only (no data, iterations or learning rate)
LLAMA3_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
             "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
             "--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 "
             "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm "
             "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
             "--global-batch-size 128 --bf16 --tokenizer-type NullTokenizer --vocab-size 128256")
FIELDS = {"tp", "cp", "cp_comm_type", "pp", "vp", "dp", "ep", "recompute", "optimizer",
          "offload_layers", "tiled_logits_chunk_size", "mlp_chunks", "seq_length",
          "memory_bytes", "memory_parts", "host_bytes", "step_time_s", "max_seq_length",
          "limiting_term", "fits", "flags", "optimizer_offload_fraction"}
GIB = 2 ** 30


def _run(argv, world):
    """The RunConfig of the training flags ``argv`` on ``world`` ranks, as the planner has it."""
    return run_config(parse_args(with_planner_defaults(argv), world_size=world))


def _plan(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_layout.main(argv) == 0
    return out.getvalue()


def _rows(argv, num_gpus, *extra):
    """The --json rows of the plan of ``argv`` on ``num_gpus`` (80 GiB unless ``extra``
    gives --gpu-memory-gb: the last one counts)."""
    return json.loads(_plan(argv + ["--num-gpus", str(num_gpus), "--gpu-memory-gb", "80",
                                    "--json", *extra]))["layouts"]


@pytest.mark.parametrize("num_gpus,cap_gib", [(8, 80), (8, 24), (32, 80)])
def test_llama3_8b_table_is_consistent(num_gpus, cap_gib):
    cap = cap_gib * GIB
    rows = _rows(LLAMA3_8B.split(), num_gpus, "--gpu-memory-gb", str(cap_gib))
    assert rows and any(r["fits"] for r in rows)
    if cap_gib == 24:  # 2 bytes a parameter of FSDP2 over 8 alone is 16 GB, TP 8 holds 18
        assert not all(r["fits"] for r in rows)
    for r in rows:
        assert set(r) == FIELDS, r
        assert r["tp"] * r["cp"] * r["pp"] * r["dp"] == num_gpus, r
        assert r["fits"] == (r["memory_bytes"] <= cap), r
        assert r["memory_bytes"] == sum(r["memory_parts"].values())
        # the longest sequence that fits is at least the one asked for exactly when it fits
        assert r["fits"] == (r["max_seq_length"] >= 8192), r
        assert r["limiting_term"] in set(r["memory_parts"]) | {"host"}, r
        assert r["step_time_s"] > 0 and r["host_bytes"] == 0  # no host limit: no offloading
    fitting = [r["step_time_s"] for r in rows if r["fits"]]
    assert rows[:len(fitting)] == [r for r in rows if r["fits"]]  # best first: fits, then fastest
    assert fitting == sorted(fitting)
    table = plan_layout.format_table([PlannedLayout(**r) for r in rows[:5]], Limits(cap), 8192)
    assert len(table.splitlines()) == 3 + 5 and f"{cap_gib:.1f} GiB per rank" in table
    assert max(len(line) for line in table.splitlines()) < 160  # one line per row


def test_refused_layouts_are_not_listed():
    # 4 KV groups: the argument validation refuses TP 8 (num_query_groups % TP)
    argv = LLAMA3_8B.replace("--num-query-groups 8", "--num-query-groups 4").split()
    rows = _rows(argv, 8)
    assert rows and all(r["tp"] <= 4 for r in rows)


def test_given_dimensions_stay_and_the_others_are_searched():
    # issue 36's line: TP 2 x CP 2 on 4 GPUs (the rest of the GPUs are DP)
    rows = _rows(LLAMA3_8B.split() + ["--tensor-model-parallel-size", "2",
                                      "--context-parallel-size", "2"], 4)
    assert [(r["tp"], r["cp"], r["pp"], r["dp"]) for r in rows] == [(2, 2, 1, 1)]
    # on 8: PP and DP are searched around them, and the CP comm type chosen per layout
    rows = _rows(LLAMA3_8B.split() + ["--tensor-model-parallel-size", "2",
                                      "--context-parallel-size", "2"], 8)
    assert {(r["pp"], r["dp"]) for r in rows} == {(1, 2), (2, 1)}
    assert {r["vp"] for r in rows} == {1, 2}  # VP open: searched on the PP 2 layouts
    given = ["--cp-comm-type", "a2a", "--use-torch-fsdp2", "--recompute-granularity", "full",
             "--recompute-method", "block", "--recompute-num-layers", "3",
             "--tiled-logits-chunk-size", "512", "--mlp-chunks-for-training", "2",
             "--cpu-offloading-num-layers", "4"]
    rows = _rows(LLAMA3_8B.split() + given, 8, "--host-memory-gb", "1024")
    assert rows and all(r["pp"] == 1 for r in rows)  # FSDP2 takes one stage
    for r in rows:
        assert (r["optimizer"], r["recompute"], r["tiled_logits_chunk_size"], r["mlp_chunks"],
                r["offload_layers"]) == ("fsdp2", "full/block/3", 512, 2, 4), r
        assert r["cp"] == 1 or r["cp_comm_type"] == "a2a", r
    vp = _rows(LLAMA3_8B.split() + ["--num-virtual-stages-per-pipeline-rank", "2"], 8)
    assert vp and all(r["vp"] == 2 and r["pp"] > 1 for r in vp)


def test_only_model_batch_and_precision_flags_are_needed():
    rows = _rows(LLAMA3_8B.split(), 8)  # no --mock-data, --train-iters or --lr
    assert rows
    # given, they are kept as given (the data path need not exist: nothing is read)
    with_data = LLAMA3_8B.split() + ["--data-path", "/nowhere/corpus", "--train-iters", "5",
                                     "--lr", "3e-4"]
    assert _rows(with_data, 8) == rows


def _plan_process(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_layout.py"), *argv],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})


def test_mistakes_are_error_lines_all_at_once():
    done = _plan_process(*"--num-layers 4 --hidden-size 64 --num-attention-heads 3 --seq-length 128 "
                          "--micro-batch-size 2 --global-batch-size 3 --vocab-size 100 "
                          "--num-gpus 0 --gpu-memory-gb abc --host-memory-gb -1".split())
    assert done.returncode == 2 and not done.stdout, done
    lines = done.stderr.strip().splitlines()
    assert all(line.startswith("error: ") for line in lines), done.stderr
    assert "Traceback" not in done.stderr and len(lines) == 5, done.stderr
    for named in ("--num-gpus (0)", "--gpu-memory-gb (abc)", "--host-memory-gb (-1)",
                  "--global-batch-size (3)", "--num-attention-heads (3)"):
        assert any(named in line for line in lines), (named, done.stderr)
    # a required planner flag missing, and a line no layout of the GPUs takes
    done = _plan_process(*"--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
                          "--seq-length 128 --micro-batch-size 1 --vocab-size 100 "
                          "--tensor-model-parallel-size 3".split(), "--num-gpus", "4")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "error: --gpu-memory-gb is required: the memory of one rank in GiB, above 0"
    done = _plan_process(*"--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
                          "--seq-length 128 --micro-batch-size 1 --vocab-size 100 "
                          "--tensor-model-parallel-size 3 --num-gpus 4 --gpu-memory-gb 1".split())
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and "(3)" in done.stderr, done.stderr


TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 "
        "--micro-batch-size 1 --global-batch-size 1 --mock-data --vocab-size 500 --lr 1e-4 "
        "--train-iters 2 --eval-iters 0 --log-interval 100 --position-embedding-type rope "
        "--normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 "
        "--disable-bias-linear --untie-embeddings-and-output-weights --seed 5")
CAP = 24 * 2 ** 20


def _peak_at(rank, world, argv):
    from megatron_cp.training import Trainer
    from training_utils import run_and_state
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    trainer.train_step()  # the Adam state exists from here on
    with PeakMemory("cpu") as meter:
        trainer.train_step()
    return meter.peak_total_bytes


def test_longest_planned_sequence_trains_within_the_cap(tmp_path):
    # every lever given (so the plan is the memory model's own search) ...
    plain = TINY + (" --tiled-logits-chunk-size 0 --mlp-chunks-for-training 1 "
                    "--recompute-granularity selective --use-distributed-optimizer")
    out = _plan(plain.split() + ["--num-gpus", "1", "--gpu-memory-gb", str(CAP / GIB),
                                 "--device", "cpu", "--json", "--calibration-cache",
                                 str(tmp_path / "calibration.json")])
    row = json.loads(out)["layouts"][0]
    assert os.path.isfile(tmp_path / "calibration.json")  # measured once, then cached
    run = _run(plain.split() + row["flags"], 1)
    assert row["recompute"] == "selective" and row["max_seq_length"] == max_seq_length(run, CAP)
    assert row["max_seq_length"] % sequence_unit(run) == 0
    # ... and the longest the levers reach: trained with the settings the row names
    out = _plan(TINY.split() + ["--num-gpus", "1", "--gpu-memory-gb", str(CAP / GIB),
                                "--device", "cpu", "--json", "--longest", "--calibration-cache",
                                str(tmp_path / "calibration.json")])
    row = json.loads(out)["layouts"][0]
    longest = row["max_seq_length"]
    assert row["fits"] and row["seq_length"] == longest and row["recompute"] != "none"
    assert longest > 1024  # activations dominate the cap: the search means something
    argv = TINY.replace("--seq-length 256", f"--seq-length {longest}") + " " + \
        " ".join(row["flags"])
    peak = run_workers(_peak_at, 1, argv, timeout=120)[0]
    assert peak <= CAP, (longest, peak, CAP, row)
    assert peak >= 0.8 * CAP, (longest, peak, CAP, row)  # and the prediction is not far too safe


def test_step_time_follows_throughput_and_link_bandwidth():
    from megatron_cp.planning.step_time import DeviceRates, predict_step_time
    fast = DeviceRates(matmul_flops=1e12, attention_flops=1e12, intra_node_bytes_per_s=1e10,
                       inter_node_bytes_per_s=1e9, gpus_per_node=8)
    one = _run(LLAMA3_8B.split(), 1)
    base = predict_step_time(one, fast)
    # one rank, no communication: time is compute, so it scales with 1 / throughput
    slow = DeviceRates(5e11, 5e11, 1e10, 1e9, 8)
    assert abs(predict_step_time(one, slow) / base - 2) < 1e-9
    # TP 2 halves the compute but adds its all-reduces over the intra-node link
    tp2 = _run(LLAMA3_8B.split() + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               2)
    with_tp = predict_step_time(tp2, fast)
    assert with_tp < base
    slower_link = DeviceRates(1e12, 1e12, 1e9, 1e9, 8)
    assert predict_step_time(tp2, slower_link) > with_tp
    # a TP group wider than a node runs over the inter-node link
    narrow_nodes = DeviceRates(1e12, 1e12, 1e10, 1e9, 1)
    assert predict_step_time(tp2, narrow_nodes) == predict_step_time(tp2, slower_link)


def test_fsdp2_plans_one_stage_with_its_state_sharded():
    from megatron_cp.planning.memory import estimate_memory, pipeline_layout_of, stage_param_counts
    from megatron_cp.planning.step_time import DeviceRates, predict_step_time
    argv = LLAMA3_8B.split() + ["--use-torch-fsdp2"]
    rows = _rows(argv, 8)
    assert rows and all(r["pp"] == 1 and r["ep"] == 1 for r in rows)  # Megatron-LM's rules
    replicated = _run(LLAMA3_8B.split(), 8)
    sharded = _run(argv, 8)
    params = sum(stage_param_counts(replicated.model, pipeline_layout_of(replicated), 0, 1, 1, 1))
    # 18 bytes a bf16 param replicated; 16/8 sharded, plus the gathered embeddings, output
    # layer and one of the 32 layers in bf16
    saved = estimate_memory(replicated).total_bytes - estimate_memory(sharded).total_bytes
    assert 15.0 * params < saved < 16.0 * params, saved / params
    fast = DeviceRates(1e12, 1e12, 1e10, 1e9, 8)
    slow_link = DeviceRates(1e12, 1e12, 1e9, 1e9, 8)
    assert predict_step_time(sharded, slow_link) > predict_step_time(sharded, fast)
