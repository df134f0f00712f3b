"""The planner's search (megatron_cp/planning/search.py, levers.py): it tries every lever, its
pick per layout is the fastest variant that fits (checked against trying every rung of every
family), offloading only when nothing else fits and within the host memory of a node, and the
step-time model charges each lever what it costs."""
import pytest

from megatron_cp.cli.arguments import parse_args
from megatron_cp.planning.layouts import run_config, with_planner_defaults
from megatron_cp.planning.levers import LEVERS, Context, open_levers
from megatron_cp.planning.memory import estimate_memory, offloaded_activation_bytes
from megatron_cp.planning.search import (Limits, evaluate, families, plan_layout,
                                         with_seq_length)
from megatron_cp.planning.step_time import GPU_DEFAULTS, DeviceRates, predict_step_time

from test_plan_layout import LLAMA3_8B

GIB = 2 ** 30
RATES = DeviceRates(**GPU_DEFAULTS)


def _run(extra, world, seq_length=None):
    argv = LLAMA3_8B.split() + extra.split()
    run = run_config(parse_args(with_planner_defaults(argv), world_size=world))
    return with_seq_length(run, seq_length) if seq_length else run


def test_every_lever_is_tried():
    run = _run("--context-parallel-size 8 --global-batch-size 1", 8)
    ladders, options = families(run, LEVERS, Context("gpu", host_limited=True))
    by_name = dict(zip([lever.name for lever in LEVERS], ladders))
    assert [ladder[0] for ladder in by_name["cp_comm_type"]] == [
        ("p2p", None), ("a2a", None), ("all_gather", None), ("a2a+p2p", (2, 4)),
        ("a2a+p2p", (4, 2))]
    assert by_name["optimizer"] == [["distributed"], ["fsdp2"]]
    assert by_name["tiled_logits_chunk_size"] == [[0], [4096, 1024, 256, 64]]
    assert len(by_name["mlp_chunks_for_training"]) == 2
    none, selective, full = by_name["recompute"]
    assert full[0] == ("full", "block", 1) and full[-1] == ("full", "uniform", 1)
    assert len(full) == 32  # block 1 .. 31 layers, then every layer
    assert by_name["cpu_offloading_num_layers"] == [list(range(32))]
    assert by_name["optimizer_offload_fraction"] == [[0.0], [0.5], [1.0]]
    assert len(options) == 5 * 2 * 2 * 2 * 3 * 3
    # nothing offloads on a CPU, nor without a host limit to plan it against
    for context in (Context("cpu", True), Context("gpu", False)):
        ladders = dict(zip([lv.name for lv in LEVERS], families(run, LEVERS, context)[0]))
        assert ladders["cpu_offloading_num_layers"] == [[0]]
        assert ladders["optimizer_offload_fraction"] == [[0.0]]
    # a setting given on the command line is no lever
    names = [lv.name for lv in open_levers({"use_torch_fsdp2", "recompute_granularity"})]
    assert "optimizer" not in names and "recompute" not in names and "cp_comm_type" in names


def _brute_force(run, limits):
    """The least step time over every rung of every family that fits, and its trial."""
    _, options = families(run, LEVERS, limits.context)
    best = (None, None)
    for family in options:
        for rung in range(len(family.rungs)):
            try:
                trial = evaluate(family.run(run, rung), limits)
            except ValueError:
                continue
            if trial.fits:
                seconds = predict_step_time(trial.run, RATES)
                if best[0] is None or seconds < best[0]:
                    best = (seconds, trial)
    return best


@pytest.mark.parametrize("seq_length,host_gib", [(8192, None), (131072, 2048), (393216, 2048),
                                                 (393216, 64)])
def test_the_pick_is_the_fastest_variant_that_fits(seq_length, host_gib):
    run = _run("--tensor-model-parallel-size 2 --context-parallel-size 2 "
               "--global-batch-size 1", 4, seq_length)
    limits = Limits(80 * GIB, host_gib and host_gib * GIB, 8, "gpu")
    row = plan_layout(run, LEVERS, limits, RATES)
    seconds, trial = _brute_force(run, limits)
    assert row.fits == (trial is not None)
    if trial is None:  # nothing fits: the row is the least memory, over the cap
        assert row.memory_bytes > limits.device_bytes and row.max_seq_length < seq_length
        return
    assert row.step_time_s == pytest.approx(seconds, rel=1e-12), (row, trial.run.model)
    assert row.memory_bytes <= limits.device_bytes and row.max_seq_length >= seq_length
    if host_gib:
        assert row.host_bytes <= host_gib * GIB
    if seq_length == 8192:  # the plain settings fit: no saving lever is paid for
        assert (row.recompute, row.offload_layers, row.tiled_logits_chunk_size,
                row.mlp_chunks) == ("none", 0, 0, 1)


def test_offloading_fits_the_host_memory_of_a_node():
    run = _run("--context-parallel-size 8 --global-batch-size 1", 8)
    rows = {}
    for host_gib in (2048, 256):
        limits = Limits(80 * GIB, host_gib * GIB, 8, "gpu")
        rows[host_gib] = plan_layout(run, LEVERS, limits, RATES, longest=True)
    roomy, tight = rows[2048], rows[256]
    assert roomy.offload_layers > 0 and roomy.host_bytes <= 2048 * GIB
    # less host memory: fewer layers offloaded, a shorter sequence, and the host limits it
    assert tight.host_bytes <= 256 * GIB and tight.offload_layers < roomy.offload_layers
    assert tight.max_seq_length < roomy.max_seq_length and tight.limiting_term == "host"
    # a node of 8 ranks holds the offloaded bytes of each of its ranks (one stage here)
    per_rank = offloaded_activation_bytes(_run(" ".join(tight.flags) + " --global-batch-size 1",
                                               8, tight.seq_length), "gpu")
    assert tight.host_bytes == 8 * per_rank[0]


def test_offloaded_bytes_are_what_leaves_the_device():
    base = "--pipeline-model-parallel-size 2 --global-batch-size 8"
    plain = _run(base, 2)
    offload = _run(base + " --cpu-offloading-num-layers 20", 2)
    host = offloaded_activation_bytes(offload, "gpu")
    assert host[0] > host[1] > 0  # layers 0-15 on stage 0 (2 microbatches in flight), 16-19 on 1
    assert offloaded_activation_bytes(offload, "cpu") == [0, 0]  # on a CPU nothing moves
    assert offloaded_activation_bytes(plain, "gpu") == [0, 0]
    # 4 layers: stage 0 stays the most loaded, and its device activations fall by what
    # goes to the host
    offload = _run(base + " --cpu-offloading-num-layers 4", 2)
    host = offloaded_activation_bytes(offload, "gpu")
    moved = estimate_memory(plain, "gpu").parts["activations"] - \
        estimate_memory(offload, "gpu").parts["activations"]
    assert moved == host[0] > 0 and host[1] == 0
    assert estimate_memory(offload, "gpu").pp_rank == 0


def test_step_time_charges_each_lever():
    base = "--context-parallel-size 2 --global-batch-size 1 --use-distributed-optimizer"
    plain = predict_step_time(_run(base, 2), RATES)

    def seconds(extra, rates=RATES, seq_length=None):
        return predict_step_time(_run(base + " " + extra, 2, seq_length), rates)
    block = [seconds(f"--recompute-granularity full --recompute-method block "
                     f"--recompute-num-layers {n}") for n in (1, 8, 16)]
    uniform = seconds("--recompute-granularity full --recompute-method uniform "
                      "--recompute-num-layers 1")
    assert plain < block[0] < block[1] < block[2] < uniform
    assert block[2] - plain == pytest.approx((uniform - plain) / 2)  # half the layers again
    assert plain < seconds("--recompute-granularity selective") < uniform
    assert plain < seconds("--tiled-logits-chunk-size 1024")
    assert plain < seconds("--mlp-chunks-for-training 4")
    # offloading costs what its copies take beyond the microbatch's compute: at 8192 tokens
    # the copies of 16 layers outlast it, at 262144 the attention hides them
    offload = "--cpu-offloading-num-layers 16"
    assert seconds(offload) > plain
    long_plain = seconds("", seq_length=262144)
    assert seconds(offload, seq_length=262144) == long_plain
    slow_host = DeviceRates(**{**GPU_DEFAULTS, "host_bytes_per_s": 1e9})
    assert seconds(offload, slow_host, 262144) > long_plain
    # the hybrid CP all-to-all + ring is neither the all-to-all nor the ring
    run4 = "--context-parallel-size 4 --global-batch-size 1"
    times = {comm: predict_step_time(_run(f"{run4} --cp-comm-type {comm}", 4), RATES)
             for comm in ("p2p", "a2a", "a2a+p2p --hierarchical-context-parallel-sizes 2 2")}
    assert len(set(times.values())) == 3
