"""tools/plan_layout.py: a consistent table for Llama-3-8B on 8 and 32 GPUs of 80 GiB, and the
longest sequence it plans for a tiny CPU model trains within the memory cap (measured)."""
import contextlib
import io
import json
import os

import pytest

from dist_harness import run_workers

from megatron_cp.cli.arguments import parse_args
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.planning import plan_layout
from megatron_cp.planning.search import PlannedLayout, max_seq_length, sequence_unit

# Llama-3-8B as Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh trains it (bf16 here)
LLAMA3_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
             "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
             "--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 "
             "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm "
             "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
             "--global-batch-size 128 --train-iters 1000 --lr 1.5e-4 --bf16 --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 128256")
FIELDS = {"tp", "cp", "cp_comm_type", "pp", "dp", "ep", "recompute", "memory_bytes",
          "step_time_s", "max_seq_length", "fits"}
GIB = 2 ** 30


def _run(argv, world):
    """The RunConfig of the training flags ``argv`` on ``world`` ranks, as the planner has it."""
    return plan_layout.run_config(parse_args(argv, world_size=world))


def _plan(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_layout.main(argv) == 0
    return out.getvalue()


@pytest.mark.parametrize("num_gpus", [8, 32])
def test_llama3_8b_table_is_consistent(num_gpus):
    cap = 80 * GIB
    rows = json.loads(_plan(LLAMA3_8B.split() + ["--num-gpus", str(num_gpus), "--gpu-memory-gb",
                                                 "80", "--json"]))["layouts"]
    assert rows and any(r["fits"] for r in rows) and not all(r["fits"] for r in rows)
    for r in rows:
        assert FIELDS <= set(r), r
        assert r["tp"] * r["cp"] * r["pp"] * r["dp"] == num_gpus, r
        assert r["fits"] == (r["memory_bytes"] <= cap), r
        # the longest sequence that fits is at least the one asked for exactly when it fits
        assert r["fits"] == (r["max_seq_length"] >= 8192), r
        assert r["step_time_s"] > 0
    fitting = [r["step_time_s"] for r in rows if r["fits"]]
    assert rows[:len(fitting)] == [r for r in rows if r["fits"]]  # best first: fits, then fastest
    assert fitting == sorted(fitting)
    table = plan_layout.format_table([PlannedLayout(**r) for r in rows[:5]], cap, 8192)
    assert len(table.splitlines()) == 3 + 5 and "80.0 GiB per rank" in table


def test_refused_layouts_are_not_listed():
    # 4 KV groups: the argument validation refuses TP 8 (num_query_groups % TP)
    argv = LLAMA3_8B.replace("--num-query-groups 8", "--num-query-groups 4").split()
    out = _plan(argv + ["--num-gpus", "8", "--gpu-memory-gb", "80", "--json"])
    rows = json.loads(out)["layouts"]
    assert rows and all(r["tp"] <= 4 for r in rows)


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
    out = _plan(TINY.split() + ["--num-gpus", "1", "--gpu-memory-gb", str(CAP / GIB),
                                "--device", "cpu", "--json", "--calibration-cache",
                                str(tmp_path / "calibration.json")])
    row = json.loads(out)["layouts"][0]
    assert os.path.isfile(tmp_path / "calibration.json")  # measured once, then cached
    longest = row["max_seq_length"]
    run = _run(TINY.split(), 1)
    assert longest == max_seq_length(run, CAP) and longest % sequence_unit(run) == 0
    assert longest > 1024  # activations dominate the cap: the search means something
    argv = TINY.replace("--seq-length 256", f"--seq-length {longest}")
    peak = run_workers(_peak_at, 1, argv, timeout=120)[0]
    assert peak <= CAP, (longest, peak, CAP)
    assert peak >= 0.8 * CAP, (longest, peak, CAP)  # and the prediction is not far too safe


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
    rows = json.loads(_plan(argv + ["--num-gpus", "8", "--gpu-memory-gb", "80", "--json"]))["layouts"]
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
