"""The planner's longest sequence for Llama-3.1-8B (bf16) on 1, 8 and 32 GPUs of 80 GiB with
2 TiB of host memory per 8 GPUs, the machines of ALST's anchors (500K / 3.7M / 15M tokens on
1 / 8 / 32 H100s); the figures are in docs/planning.md.

Each plan's best row is checked against the memory model directly: its settings fit at its
length, the same settings one unit longer do not, and the term it names is what stops it."""
import contextlib
import io
import json

import pytest

from megatron_cp.cli.arguments import parse_args
from megatron_cp.planning import plan_layout
from megatron_cp.planning.layouts import run_config, with_planner_defaults
from megatron_cp.planning.search import sequence_unit

# Llama-3.1-8B: its RoPE scaling (--use-rope-scaling) changes no memory and is left out
LLAMA31_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
              "--group-query-attention --num-query-groups 8 --kv-channels 128 "
              "--position-embedding-type rope --rotary-base 500000 --swiglu "
              "--normalization RMSNorm --untie-embeddings-and-output-weights "
              "--disable-bias-linear --attention-dropout 0 --hidden-dropout 0 "
              "--micro-batch-size 1 --seq-length 131072 --bf16 --tokenizer-type NullTokenizer "
              "--vocab-size 128256")
GIB = 2 ** 30
CAP, HOST = 80 * GIB, 2048 * GIB


def _longest(num_gpus):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_layout.main(LLAMA31_8B.split() + [
            "--num-gpus", str(num_gpus), "--gpu-memory-gb", "80", "--host-memory-gb", "2048",
            "--gpus-per-node", "8", "--longest", "--json", "--top", "1"]) == 0
    return json.loads(out.getvalue())["layouts"][0]


def _predicted(row, num_gpus, seq_length):
    from megatron_cp.planning.memory import estimate_memory
    argv = with_planner_defaults(LLAMA31_8B.replace("--seq-length 131072",
                                                    f"--seq-length {seq_length}").split()
                                 + row["flags"])
    run = run_config(parse_args(argv, world_size=num_gpus))
    return run, estimate_memory(run, "gpu")


def test_one_gpu_trains_llama31_8b_with_the_optimizer_on_the_host():
    row = _longest(1)
    # 8B parameters at 18 bytes each (bf16 weights, fp32 gradients and Adam) are 150 GB: one
    # GPU holds the model only with the optimizer state on the host, under FSDP's sharding
    # (Megatron-FSDP at fraction 1: torch's CPUOffloadPolicy keeps parameters and gradients
    # there too), so the device holds activations and one gathered layer at a time
    print(f"1 GPU: {row['max_seq_length']} tokens, {' '.join(row['flags'])}, limited by "
          f"{row['limiting_term']}, host {row['host_bytes'] / GIB:.0f} GiB")
    assert row["fits"] and row["max_seq_length"] > 0
    assert row["optimizer_offload_fraction"] == 1.0 and row["optimizer"] == "megatron-fsdp"
    assert row["memory_bytes"] <= CAP and row["host_bytes"] <= HOST
    # without the host limit (so without the optimizer on the host) nothing fits: the static
    # state alone is over the cap
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_layout.main(LLAMA31_8B.split() + [
            "--num-gpus", "1", "--gpu-memory-gb", "80", "--longest", "--json", "--top", "1"]) == 0
    plain = json.loads(out.getvalue())["layouts"][0]
    assert plain["max_seq_length"] == 0 and plain["limiting_term"] == "grads_and_optimizer"


@pytest.mark.parametrize("num_gpus,anchor", [(8, 3_700_000), (32, 15_000_000)])
def test_longest_llama31_8b_sequence(num_gpus, anchor):
    row = _longest(num_gpus)
    longest = row["max_seq_length"]
    print(f"{num_gpus} GPUs: {longest} tokens, {' '.join(row['flags'])}, limited by "
          f"{row['limiting_term']}, {row['memory_bytes'] / GIB:.2f} GiB, "
          f"host {row['host_bytes'] / GIB:.0f} GiB per node, step {row['step_time_s']:.0f} s")
    assert row["fits"] and row["seq_length"] == longest
    assert row["tp"] * row["cp"] * row["pp"] * row["dp"] == num_gpus
    assert row["memory_bytes"] <= CAP and row["host_bytes"] <= HOST
    # the levers: every layer recomputed and offloaded, the logits and the MLP tiled
    assert row["recompute"] == "full/uniform/1" and row["offload_layers"] > 0
    assert row["tiled_logits_chunk_size"] > 0 and row["mlp_chunks"] > 1
    # ALST's figure for the machine is reached (the planner gave 331,736 / 1.5M before)
    assert longest >= anchor
    run, memory = _predicted(row, num_gpus, longest)
    assert memory.total_bytes == row["memory_bytes"]
    _, longer = _predicted(row, num_gpus, longest + sequence_unit(run))
    assert longer.total_bytes > CAP  # these settings do not fit one unit longer
    assert row["limiting_term"] in memory.parts and \
        row["limiting_term"] == max(longer.parts, key=longer.parts.get)
