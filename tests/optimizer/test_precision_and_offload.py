"""--use-precision-aware-optimizer (moments in bf16) and --optimizer-cpu-offload (a fraction
of the optimizer on the host), at DP=2 with the distributed optimizer and with FSDP2
(Megatron-FSDP's optim_grads_params, which Megatron-LM allows them with), against the run
without them: losses, the state's dtypes and the bytes by placement."""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp.config.optimizer import OptimizerConfig
from megatron_cp.optimizer.memory import optimizer_bytes_per_param
from megatron_cp.optimizer.offload import choose_offloaded
from training_utils import TINY, max_rel_diff

STEPS = TINY + " --train-iters 10 --clip-grad 0.5"
DIST = "--use-distributed-optimizer"
FSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor"
PA = "--use-precision-aware-optimizer"
BF16_MOMENTS = f"{PA} --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
FP16_MOMENTS = f"{PA} --exp-avg-dtype fp16 --exp-avg-sq-dtype fp16"
# unit roundoff of the moments' storage: bf16 keeps 8 significant bits, fp16 11
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def offload(fraction):
    return f"{PA} --optimizer-cpu-offload --optimizer-offload-fraction {fraction}"


JOBS = {
    "dist": f"{STEPS} {DIST}",
    "dist_pa_fp32": f"{STEPS} {DIST} {PA}",
    "dist_pa_bf16": f"{STEPS} {DIST} {BF16_MOMENTS}",
    "dist_pa_fp16": f"{STEPS} {DIST} {FP16_MOMENTS}",
    "dist_pa_fp16_main": f"{STEPS} {DIST} {PA} --main-params-dtype fp16",
    "dist_bf16": f"{STEPS} {DIST} --bf16",
    "dist_bf16_pa_fp16_main": f"{STEPS} {DIST} --bf16 {PA} --main-params-dtype fp16",
    "dist_bf16_pa_bf16_grads": f"{STEPS} {DIST} --bf16 {PA} --main-grads-dtype bf16",
    "dist_off0.5": f"{STEPS} {DIST} {offload(0.5)}",
    "dist_off1.0": f"{STEPS} {DIST} {offload(1.0)}",
    "fsdp": f"{STEPS} {FSDP}",
    "fsdp_off0.5": f"{STEPS} {FSDP} {offload(0.5)}",
    "fsdp_off1.0": f"{STEPS} {FSDP} {offload(1.0)}",
    "fsdp_pa_bf16": f"{STEPS} {FSDP} {BF16_MOMENTS}",
}


def _run(rank, world, argv):
    """(losses, memory breakdown, [(dtype, numel) of each state tensor], elements of this
    rank's optimizer params, of those on the host) of training ``argv``."""
    from megatron_cp.optimizer.memory import memory_breakdown
    from training_utils import trained
    losses, trainer = trained(rank, world, argv)
    opt = trainer.optimizer
    shards = opt.param_shards()
    states = [(str(t.dtype), t.numel()) for t in opt.state_tensors()]  # as stored
    numels = [s.stop - s.start for s in shards]
    on_host = sum(t.numel() for t in opt.host_grad_tensors())
    memory = memory_breakdown(trainer.model_chunks, opt)
    return losses, memory, states, numels, on_host


def _all(rank, world, jobs):
    return {name: _run(rank, world, argv) for name, argv in jobs.items()}


@pytest.fixture(scope="module")
def results():
    return run_workers(_all, 2, JOBS, timeout=900)


def test_fp32_dtypes_are_the_plain_optimizer_bit_for_bit(results):
    for rank in results:
        assert rank["dist_pa_fp32"][0] == rank["dist"][0]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_moments_stay_within_their_bound_and_take_half_the_bytes(results, dtype):
    """The moments are rounded to ``dtype`` (unit roundoff u: 2^-8 for bf16, 2^-11 for fp16,
    which Transformer Engine scales per tensor to half its range so nothing underflows)
    after each step; the update is computed in fp32, so each step's update moves by at most
    ~1.5 u of itself, and the updates are lr-sized: over 10 steps the loss stays within u of
    the fp32 run."""
    bound = UNIT_ROUNDOFF[dtype]
    for rank in results:
        losses, memory, states, _, _ = rank[f"dist_pa_{dtype}"]
        diff = max_rel_diff(losses, rank["dist"][0])
        print(f"{dtype} moments: losses within {diff:.1e} of fp32's (bound {bound:.1e})")
        assert 0 < diff <= bound, diff  # the dtype acts, within its bound
        wanted = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
        assert states and {kind for kind, _ in states} == {wanted}
        fp32_state = rank["dist"][1]["optimizer_state"]
        assert memory["optimizer_state"] * 2 == fp32_state
        assert fp32_state == 4 * sum(n for _, n in rank["dist"][2])


@pytest.mark.parametrize("fraction", ["0.5", "1.0"])
@pytest.mark.parametrize("wrapper", ["dist", "fsdp"])
def test_offload_trains_bit_for_bit_as_without(results, wrapper, fraction):
    for rank in results:
        assert rank[f"{wrapper}_off{fraction}"][0] == rank[wrapper][0]


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offloaded_bytes_follow_the_formula_exactly(results, fraction):
    """Host: fp32 main (4) + moments (8) + gradient copy (4) per offloaded element; device:
    the run without offload less the main params (fp32 model: none) and moments moved."""
    for rank in results:
        _, memory, _, numels, on_host = rank[f"dist_off{fraction}"]
        chosen = choose_offloaded(numels, fraction)
        moved = sum(n for n, c in zip(numels, chosen) if c)
        assert on_host == moved > 0
        assert memory["host"] == 16 * moved
        assert memory["device"] == rank["dist"][1]["total"] - 8 * moved
        config = OptimizerConfig(use_distributed_optimizer=True,
                                 use_precision_aware_optimizer=True, optimizer_cpu_offload=True,
                                 optimizer_offload_fraction=moved / sum(numels))
        device, host = optimizer_bytes_per_param(config, torch.float32, 2, distributed=True)
        n = memory["num_params"]
        assert host * n == pytest.approx(memory["host"], rel=1e-12)
        assert device * n == pytest.approx(memory["device"], rel=2e-3)  # bucket padding


def test_fsdp_offload_of_everything_is_fsdp2s_host_offload(results):
    for rank in results:
        memory, plain = rank["fsdp_off1.0"][1], rank["fsdp"][1]
        assert memory["device"] == 0 and memory["host"] == plain["total"]
        half = rank["fsdp_off0.5"]
        numels = half[3]
        moved = sum(n for n, c in zip(numels, choose_offloaded(numels, 0.5)) if c)
        assert half[1]["host"] == 16 * moved
        assert half[1]["device"] == plain["total"] - 8 * moved


@pytest.mark.parametrize("flags, bound", [
    (offload(0.5), 0.0),
    (BF16_MOMENTS, 0.0),  # bf16 -> fp32 in the file -> bf16: exact
    # fp16: saved unscaled (as Transformer Engine's state_dict), rescaled on load from the
    # loaded values' maximum: at most one fp16 rounding more
    (FP16_MOMENTS, UNIT_ROUNDOFF["fp16"]),
    # fp16 masters: an fp32 model's are rebuilt from its loaded params, a bf16 model's saved
    # unscaled and rescaled on load
    (f"{PA} --main-params-dtype fp16", UNIT_ROUNDOFF["fp16"]),
    (f"--bf16 {PA} --main-params-dtype fp16", UNIT_ROUNDOFF["fp16"]),
])
def test_resumes_from_a_checkpoint_to_the_same_losses(tmp_path, flags, bound):
    save = tmp_path / "ckpt"
    argv = f"{TINY} --train-iters 4 {DIST} {flags} --ckpt-format torch_dist"
    straight = run_workers(_run, 2, argv)
    run_workers(_run, 2, f"{argv} --save {save} --save-interval 2 --exit-interval 2")
    resumed = run_workers(_run, 2, f"{argv} --load {save}")
    for whole, tail in zip(straight, resumed):
        if bound == 0.0:
            assert tail[0] == whole[0][2:], (tail[0], whole[0])
        else:
            assert max_rel_diff(tail[0], whole[0][2:]) <= bound, (tail[0], whole[0])


@pytest.mark.parametrize("flags, message", [
    (f"{DIST} --optimizer-cpu-offload", "add --use-precision-aware-optimizer"),
    (PA, "add --use-distributed-optimizer"),
    (f"{DIST} --exp-avg-dtype bf16", "add --use-precision-aware-optimizer"),
    (f"{DIST} {PA} --exp-avg-dtype fp8", "FP8 optimizer state is not built"),
    (f"{FSDP} {PA} --main-params-dtype fp16", "FSDP's fp32 rows are the main params"),
    (f"{FSDP} --data-parallel-sharding-strategy no_shard {PA}", "no_shard runs the replicated"),
    (f"{DIST} {PA} --main-grads-dtype bf16", "add --bf16"),
    (f"{DIST} --bf16 {PA} --main-grads-dtype bf16 --accumulate-allreduce-grads-in-fp32",
     "Megatron-LM refuses both"),
    (f"{DIST} {offload(1.5)}", "give a number in [0, 1]"),
    (f"{DIST} {offload(0.5)} --exp-avg-dtype bf16", "hybrid CPU/GPU optimizer keeps fp32"),
    (f"--use-torch-fsdp2 --ckpt-format torch_dist {PA}", "use --use-megatron-fsdp"),
])
def test_refused_in_one_line(flags, message):
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.cli.arguments import ArgumentErrors
    with pytest.raises(ArgumentErrors) as error:
        parse_args(f"{TINY} --train-iters 2 {flags}".split(), world_size=2)
    assert [line for line in error.value.lines if message in line], error.value.lines


def test_copy_switches_are_noted_at_start_up():
    from megatron_cp.cli.arguments import parse_args
    args = parse_args(f"{TINY} --train-iters 4 {DIST} {offload(0.5)} --no-pin-cpu-params "
                      f"--overlap-cpu-optimizer-d2h-h2d".split(), world_size=2)
    notes = [n for n in args.compat_notes if n.startswith("--overlap-cpu-optimizer-d2h-h2d")]
    assert len(notes) == 1 and "--no-pin-cpu-params" in notes[0] and "same numbers" in notes[0]


@pytest.mark.parametrize("model", ["fp32", "bf16"])
def test_fp16_main_params_stay_within_fp16s_bound(results, model):
    """--main-params-dtype fp16: the masters are rounded to fp16 (u = 2^-11) after each
    step, so every weight the next step starts from moves by at most u of itself (a bf16
    model's weights are rounded coarser still, 2^-8, after every step either way): over 10
    steps the loss stays within u of the fp32-master run. The masters (2 bytes) take the
    place of fp32 ones (4; none for an fp32 model)."""
    prefix = "dist" if model == "fp32" else "dist_bf16"
    for rank in results:
        losses, memory = rank[f"{prefix}_pa_fp16_main"][:2]
        reference, plain = rank[prefix][:2]
        diff = max_rel_diff(losses, reference)
        print(f"{model} model, fp16 masters: losses within {diff:.1e} of fp32 masters'")
        assert 0 < diff <= UNIT_ROUNDOFF["fp16"], diff
        elements = sum(rank[prefix][3])
        assert memory["main_params"] == 2 * elements
        assert plain["main_params"] == (4 * elements if model == "bf16" else 0)


def test_bf16_main_grads_accumulate_and_reduce_in_bf16(results):
    """--main-grads-dtype bf16 (a bf16 model): the gradient buffers are bf16, so each
    microbatch's addition and the reduce-scatter round to bf16 (u = 2^-8); Adam divides the
    rounding out of the update's size, leaving its direction off by about u: the loss stays
    within u of the fp32-buffer run, and the buffers take half the bytes."""
    for rank in results:
        losses, memory = rank["dist_bf16_pa_bf16_grads"][:2]
        reference, plain = rank["dist_bf16"][:2]
        diff = max_rel_diff(losses, reference)
        print(f"bf16 main grads: losses within {diff:.1e} of fp32 buffers'")
        assert 0 < diff <= UNIT_ROUNDOFF["bf16"], diff
        assert memory["grads"] * 2 == plain["grads"]


def test_fsdp_keeps_bf16_moments_within_bf16s_bound(results):
    """The same bound as under the distributed optimizer, on FSDP2's rows."""
    for rank in results:
        losses, memory, states = rank["fsdp_pa_bf16"][:3]
        assert 0 < max_rel_diff(losses, rank["fsdp"][0]) <= UNIT_ROUNDOFF["bf16"]
        assert {dtype for dtype, _ in states} == {"torch.bfloat16"}
        assert memory["optimizer_state"] * 2 == rank["fsdp"][1]["optimizer_state"]
