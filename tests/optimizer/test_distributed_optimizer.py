"""The distributed optimizer (ZeRO-1, --use-distributed-optimizer).

- 5 training steps give the losses and gradient norms of the non-distributed optimizer of
  the same layout (relative 1e-6) under DP=2, DP=4, DP=2 x CP=2, TP=2 x DP=2 and
  PP=2 x DP=2 (plus interleaved virtual stages), with and without overlapping the gradient
  reduce-scatter and the parameter all-gather (small buckets, so both cut params across
  shards); fp16 loss scaling skips the same steps; clipping is active.
- Memory per rank follows 8 + 8/d (fp32) and 6 + 12/d (bf16) bytes per parameter at
  d = 1, 2, 4, and 16 / 18 without sharding.
- Expert parameters (``is_expert``, no MoE layer exists yet: a toy module) are sharded over
  the expert-DP group and dense ones over DP x CP, with the replicated optimizer's results.

All runs of one world size share one set of workers.
"""
import pytest
import torch
from torch import nn

from dist_harness import run_workers
from megatron_cp.cli.arguments import parse_args
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.optimizer import (DistributedOptimizer, MixedPrecisionOptimizer,
                                   expected_bytes_per_param, get_param_groups, memory_breakdown)
from megatron_cp.distributed.data_parallel import DistributedDataParallel, finalize_model_grads
from training_utils import TINY, max_rel_diff, trainer_of

STEPS = TINY.replace("--num-layers 2", "--num-layers 4").replace("--clip-grad 1.0", "--clip-grad 0.5") \
    + " --train-iters 5"
DIST = "--use-distributed-optimizer"
OVERLAP = f"{DIST} --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 3000"
FP16 = "--fp16 --initial-loss-scale 1048576 --hysteresis 1"
# name: (world, layout arguments)
# Relative tolerances from the precision involved. fp32 parameters: the two optimizers sum
# the same fp32 gradients in another order (reduce-scatter vs all-reduce), a few fp32 ulps
# (2^-23 = 1.2e-7) per step. fp16 parameters: those sums feed fp32 master weights that are
# rounded to fp16 after every step, so an fp32-ulp difference can flip the rounding of a
# weight by one fp16 ulp (2^-10) and the loss moves by a fraction of that: bounded by fp16's
# unit roundoff 2^-11 (measured: 1.8e-6 and 3.6e-6 on an AVX-512 CPU with torch 2.13).
FP32_TOL, LOW_PRECISION_TOL = 1e-6, 2.0 ** -11
LAYOUTS = {
    "dp2": (2, ""),
    "dp2_fp16": (2, FP16),
    "dp4": (4, ""),
    "dp2_cp2": (4, "--context-parallel-size 2"),
    "tp2_dp2": (4, "--tensor-model-parallel-size 2 --sequence-parallel"),
    "pp2_dp2": (4, "--pipeline-model-parallel-size 2"),
    "pp2_vp2_dp2_untied": (4, "--pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights "
                              "--num-layers-per-virtual-pipeline-stage 1"),
}
# memory: name -> (layout arguments, d, distributed); world 4
MEMORY = {f"{dtype}_{name}": (f"{flag} {layout}", d, dist_opt)
          for dtype, flag in (("fp32", ""), ("bf16", "--bf16"))
          for name, layout, d, dist_opt in (
              ("d1", f"--tensor-model-parallel-size 4 {DIST}", 1, True),
              ("d2", f"--tensor-model-parallel-size 2 {DIST}", 2, True),
              ("d4", DIST, 4, True),
              ("d4_replicated", "", 4, False))}


def _steps(rank, world, argv):
    """(losses, grad norms, skipped iterations, a param all-gather was still running after
    a step) of training ``argv``."""
    trainer = trainer_of(argv, world)
    losses, norms, in_flight = [], [], False
    for _ in range(trainer.args.train_iters):
        loss, norm, _ = trainer.train_step()
        losses.append(loss)
        norms.append(norm)
        in_flight |= any(bucket.gather_handle is not None for chunk in trainer.model_chunks
                         for bucket in chunk.buckets)
    return losses, norms, trainer.optimizer.num_skipped_iters, in_flight


def _memory(rank, world, argv):
    trainer = trainer_of(argv, world)
    trainer.train_step()  # Adam state as torch creates it
    return memory_breakdown(trainer.model_chunks, trainer.optimizer)


class _ToyWithExpert(nn.Module):
    """A dense layer (the same on every rank) and one expert matrix per EP rank."""

    def __init__(self, ep_rank):
        super().__init__()
        self.dense = nn.Linear(5, 6)  # drawn from the global seed: the same on every rank
        self.expert = nn.Parameter(torch.randn(6, 3, generator=torch.Generator().manual_seed(10 + ep_rank)))
        self.expert.is_expert = True

    def forward(self, x):
        return (self.dense(x) @ self.expert).square().mean()


def _expert_job(rank, world, _):
    """(final params, grad norms) of 3 steps, replicated then distributed, at EP=2 x EDP=2."""
    state = initialize_model_parallel(expert_model_parallel_size=2)
    assert (state.size("edp"), state.size("dp_cp")) == (2, 4)
    out = []
    for distributed in (False, True):
        torch.manual_seed(0)
        model = _ToyWithExpert(state.rank("ep"))
        ddp = DistributedDataParallel(model, state, use_distributed_optimizer=distributed)
        groups = get_param_groups(model, 0.01)
        opt = DistributedOptimizer(groups, [ddp], state, lr=0.1, clip_grad=0.05) if distributed \
            else MixedPrecisionOptimizer(groups, state, lr=0.1, clip_grad=0.05)
        norms = []
        for step in range(3):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))
            ddp(x).backward()
            finalize_model_grads([ddp], state)
            norms.append(opt.step()[1])
        opt.finish_param_sync()
        out.append(([p.detach().tolist() for p in model.parameters()], norms))
    return out  # lists, not tensors: a tensor's storage would not outlive its worker


def _run_all(rank, world, jobs):
    return {name: fn(rank, world, argv) for name, (fn, argv) in jobs.items()}


_RUNS = {}


def _results(world):
    if world not in _RUNS:
        jobs = {}
        for name, (w, layout) in LAYOUTS.items():
            if w == world:
                for variant, extra in (("plain", ""), ("dist", DIST), ("overlap", OVERLAP)):
                    jobs[f"{name}:{variant}"] = (_steps, f"{STEPS} {layout} {extra}")
        if world == 4:
            jobs["expert"] = (_expert_job, "")
            for name, (layout, _, _) in MEMORY.items():
                jobs[f"memory:{name}"] = (_memory, f"{STEPS} {layout}")
        _RUNS[world] = run_workers(_run_all, world, jobs, timeout=500)
    return _RUNS[world]


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("variant", ["dist", "overlap"])
def test_distributed_optimizer_matches_the_replicated_one(name, variant):
    world, _ = LAYOUTS[name]
    for rank_results in _results(world):
        losses, norms, skipped, in_flight = rank_results[f"{name}:{variant}"]
        ref_losses, ref_norms, ref_skipped, _ = rank_results[f"{name}:plain"]
        assert skipped == ref_skipped
        # --overlap-param-gather leaves the all-gathers running into the next forward
        assert in_flight == (variant == "overlap")
        assert ref_losses[-1] < ref_losses[0], "the tiny model must learn"
        kept = [i for i, n in enumerate(ref_norms) if n is not None]
        assert [norms[i] is not None for i in range(len(norms))] == \
            [n is not None for n in ref_norms]
        loss_diff = max_rel_diff(losses, ref_losses)
        norm_diff = max_rel_diff([norms[i] for i in kept], [ref_norms[i] for i in kept])
        print(f"{name} {variant}: losses {loss_diff:.1e}, grad norms {norm_diff:.1e}, "
              f"skipped {skipped}")
        tol = LOW_PRECISION_TOL if FP16 in LAYOUTS[name][1] else FP32_TOL
        assert loss_diff <= tol and norm_diff <= tol, (loss_diff, norm_diff, tol)
        assert max(ref_norms[i] for i in kept) > 0.5, "clipping (--clip-grad 0.5) must act"
    if "fp16" in name:
        assert skipped > 0, "the fp16 run must skip overflowing steps"


@pytest.mark.parametrize("name", list(MEMORY))
def test_memory_per_rank_follows_the_formula(name):
    _, d, distributed = MEMORY[name]
    dtype = torch.bfloat16 if name.startswith("bf16") else torch.float32
    expected = expected_bytes_per_param(dtype, d, distributed)
    for rank_results in _results(4):
        measured = rank_results[f"memory:{name}"]
        n = measured["num_params"]
        print(f"{name}: {measured['bytes_per_param']:.3f} bytes/param (formula {expected:.3f}); "
              f"params {measured['params']}, grads {measured['grads']}, main "
              f"{measured['main_params']}, Adam {measured['optimizer_state']} for {n} params")
        assert measured["bytes_per_param"] == pytest.approx(expected, rel=2e-3)
        shard = d if distributed else 1
        main = 4 * n / shard if dtype == torch.bfloat16 else 0  # fp32 params are their own main
        assert measured["main_params"] == pytest.approx(main, rel=2e-3)
        assert measured["optimizer_state"] == pytest.approx(8 * n / shard, rel=2e-3)
    assert expected == {(torch.float32, True): 8 + 8 / d, (torch.bfloat16, True): 6 + 12 / d,
                        (torch.float32, False): 16, (torch.bfloat16, False): 18}[dtype, distributed]


def test_expert_params_shard_over_expert_data_parallel():
    for rank_results in _results(4):
        (params, norms), (dist_params, dist_norms) = rank_results["expert"]
        assert max_rel_diff(dist_norms, norms) <= 1e-6
        assert norms[0] > 0.05, "clipping must act"
        for a, b in zip(dist_params, params):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-7)


# ----- --num-distributed-optimizer-instances ---------------------------------------------------

# clipping at 0.05 is active at every step, so a norm counting a shard twice changes losses
CLIPPED = TINY + " --train-iters 4 --clip-grad 0.05"
INSTANCES = CLIPPED + " --use-distributed-optimizer --ckpt-format torch_dist"


def _instance_run(rank, world, argv):
    """(losses, (shard group size, instance count, optimizer elements here, model
    elements)) of a training run (Megatron-LM's partial distributed optimizer when K > 1)."""
    from training_utils import trained
    losses, trainer = trained(rank, world, argv)
    bucket = trainer.model_chunks[0].buckets[0]
    owned = sum(shard.stop - shard.start for shard in trainer.optimizer.param_shards())
    total = sum(p.numel() for p in trainer.model_chunks[0].parameters())
    return losses, (bucket.group_size, bucket.inter_size, owned, total)


def test_optimizer_instances_train_as_one_process_and_load_under_one_instance(tmp_path):
    """DP=4 with K=2 instances: each instance shards the optimizer over 2 ranks (twice the
    state of K=1 per rank), gradients summed inside and across instances; the loss curve is
    the one-process one, and its torch_dist checkpoint resumes under K=1."""
    reference = run_workers(_instance_run, 1, CLIPPED)[0][0]
    save = tmp_path / "ckpt"
    runs = run_workers(_instance_run, 4, f"{INSTANCES} --num-distributed-optimizer-instances 2 "
                                         f"--overlap-grad-reduce --overlap-param-gather "
                                         f"--save {save} --save-interval 2 --exit-interval 2")
    for losses, (shard_ranks, instances, owned, total) in runs:
        assert max_rel_diff(losses, reference[:2]) < 1e-5, (losses, reference)
        assert (shard_ranks, instances) == (2, 2)
        assert total / 2 <= owned < total / 2 + 64  # half the model (+ bucket padding)
    resumed = run_workers(_instance_run, 4, f"{INSTANCES} --load {save}")
    for losses, (shard_ranks, instances, owned, total) in resumed:
        assert (shard_ranks, instances) == (4, 1) and owned < total / 4 + 64
        assert max_rel_diff(losses, reference[2:]) < 1e-5, (losses, reference)


def test_optimizer_instances_are_checked_before_start():
    from training_utils import assert_refused
    assert_refused(f"{CLIPPED} --num-distributed-optimizer-instances 2",
                   "--num-distributed-optimizer-instances (2) copies the distributed optimizer: "
                   "add --use-distributed-optimizer", world_size=4)
    assert_refused(f"{INSTANCES} --num-distributed-optimizer-instances 3",
                   "--num-distributed-optimizer-instances (3) must divide the data-parallel x "
                   "context-parallel size (4); pick a divisor of 4", world_size=4)
    layout = parse_args(f"{INSTANCES} --num-distributed-optimizer-instances 2".split(),
                        world_size=4)
    assert layout.num_distributed_optimizer_instances == 2


def test_optimizer_instances_cut_each_data_parallel_group_into_slices():
    """Megatron-LM's instance groups: K consecutive slices of each DP x CP (and expert-DP)
    group, and the ranks of one position across the slices."""
    from megatron_cp.distributed.initialize import rank_layout
    layout = rank_layout(8, tensor_model_parallel_size=2, expert_tensor_parallel_size=2,
                         num_distributed_optimizer_instances=2)
    assert layout["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["dp_cp_intra"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout["dp_cp_inter"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert layout["edp_intra"] == layout["dp_cp_intra"]
    assert "dp_cp_intra" not in rank_layout(8, tensor_model_parallel_size=2)
