"""--use-megatron-fsdp (Megatron-LM's own FSDP flags) on megatron_cp's machinery, against one
process from the same weights.

- Each --data-parallel-sharding-strategy (no_shard: DDP; optim: the distributed optimizer;
  optim_grads: FSDP2 keeping the gathered params to the step; optim_grads_params: FSDP2)
  gives the one-process losses and gradient norms at DP=2 (fp32, and bf16), at TP=2 x DP=2
  with SP (Megatron-LM's defaults), and with routed experts under EP=2 x DP=2 (the experts
  sharded over the expert-DP group) and TP=2 x EP=2 with SP, within the tolerance of the precision (test_fsdp2's).
- Each allocates what its strategy implies (bytes per parameter of each rank); optim_grads
  holds the gathered params from the forward to the step, then frees them.
- --ckpt-format fsdp_dtensor: Megatron-LM's layout (its key names, the fp32 masters as the
  weights, SwiGLU's fc1 split, per-expert keys, the padded vocabulary); saved under FSDP2 at
  DP=2 it resumes in one process (a plain run) and under the distributed optimizer at DP=2,
  and saved in the background at TP=2 x DP=2 (tied, 512 padded rows) in one process (384
  rows), each equal to the straight run.
- megatron-core's own Megatron-FSDP (on CPU) writes an fsdp_dtensor checkpoint that one
  process here loads with its logits, iteration and samples.
- What Megatron-LM refuses with these flags is refused in one line each.
"""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from dist_harness import run_workers
from megatron_cp.optimizer import expected_bytes_per_param, memory_breakdown
from megatron_cp.cli.arguments import parse_args
from training_utils import TINY, assert_refused, max_rel_diff, train_losses, trainer_of

MFSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy"
STEPS = TINY.replace("--num-layers 2", "--num-layers 3") + " --train-iters 5"
LLAMA = "--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights"
MEGATRON = (STEPS.replace("--position-embedding-type rope", "")
            .replace("--vocab-size 200 --make-vocab-size-divisible-by 64", "--vocab-size 300"))
MOE = f"--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 {LLAMA}"
TOL = {"fp32": 1e-5, "bf16": 2.0 ** -8}  # as tests/parity/test_fsdp2.py (its comment says why)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# name: (world, model flags, layout flags)
RUNS = {**{f"dp2_{s}": (2, STEPS, f"{MFSDP} {s}") for s in STRATEGIES},
        "dp2_optim_grads_params_bf16": (2, f"{STEPS} --bf16", f"{MFSDP} optim_grads_params"),
        "tp2_dp2_optim_grads_megatron_defaults": (
            4, MEGATRON, f"{MFSDP} optim_grads --tensor-model-parallel-size 2 --sequence-parallel"),
        "ep2_dp4_moe_optim_grads_params": (
            4, f"{STEPS} {MOE}", f"{MFSDP} optim_grads_params --expert-model-parallel-size 2"),
        # the layout of Megatron-LM's 8experts2parallel set: TP2 x EP2 (ETP2) with SP
        "tp2_ep2_moe_sp_optim_grads_params": (
            4, f"{STEPS} {MOE}", f"{MFSDP} optim_grads_params --expert-model-parallel-size 2 "
                                 f"--tensor-model-parallel-size 2 --sequence-parallel")}
BF16 = f"{STEPS} {LLAMA} --bf16"
# the fsdp_dtensor sets' model: Megatron-LM's defaults (tied, padded to 384 / 512 rows)
TIED = f"{MEGATRON} --bf16 --calculate-per-token-loss"
EXPECTED = {"no_shard": dict(), "optim": dict(distributed=True),
            "optim_grads": dict(fully_sharded=True), "optim_grads_params": dict(fully_sharded=True)}


def _steps(rank, world, argv):
    """(losses, grad norms) of training ``argv``."""
    trainer = trainer_of(argv, world)
    out = [trainer.train_step() for _ in range(trainer.args.train_iters)]
    return [loss for loss, _, _ in out], [norm for _, norm, _ in out]


def _memory(rank, world, argv):
    """(this rank's bytes, whether a layer's params are still gathered after the step)."""
    trainer = trainer_of(argv, world)
    layer = trainer.model_chunks[0].module.decoder.layers[0]
    trainer.train_step()
    gathered = not isinstance(next(layer.parameters()), DTensor)
    return memory_breakdown(trainer.model_chunks, trainer.optimizer), gathered


def _gathered_through_backward(rank, world, argv):
    """Whether a layer's params are still gathered after a forward and backward."""
    trainer = trainer_of(argv, world)
    model = trainer.model_chunks[0]
    tokens = torch.randint(0, 200, (2, 32))  # [b, s]
    position_ids = torch.arange(32).expand(2, 32)
    model(tokens, position_ids).float().sum().backward()
    layer = model.module.decoder.layers[0]
    return not isinstance(next(layer.parameters()), DTensor)


def _jobs(rank, world, jobs):
    return {name: fn(rank, world, argv) for name, (fn, argv) in jobs.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mfsdp")
    ck, tied = str(tmp / "ck"), str(tmp / "tied")
    out = {}
    one = {f"ref:{model}": (_steps, model) for _, model, _ in RUNS.values()}
    one["straight"] = (train_losses, BF16)
    one["tied_straight"] = (train_losses, TIED)
    out.update(run_workers(_jobs, 1, one, timeout=500)[0])
    for world in (2, 4):
        jobs = {name: (_steps, f"{model} {layout}")
                for name, (w, model, layout) in RUNS.items() if w == world}
        if world == 2:
            jobs.update({f"memory:{s}": (_memory, f"{STEPS} {MFSDP} {s}") for s in STRATEGIES})
            jobs["gathered:optim_grads"] = (_gathered_through_backward,
                                            f"{STEPS} {MFSDP} optim_grads")
            jobs["first"] = (train_losses, f"{BF16} {MFSDP} optim_grads_params "
                                           f"--exit-interval 3 --save {ck}")
        else:
            jobs["tied_first"] = (train_losses, f"{TIED} {MFSDP} optim_grads_params --async-save "
                                                f"--tensor-model-parallel-size 2 --sequence-parallel "
                                                f"--exit-interval 3 --save {tied}")
        out[world] = run_workers(_jobs, world, jobs, timeout=600)
    out["dp2_optim_from_fsdp"] = run_workers(
        train_losses, 2, f"{BF16} {MFSDP} optim --load {ck}", timeout=300)
    out["plain_from_fsdp"] = run_workers(train_losses, 1, f"{BF16} --load {ck}", timeout=300)[0]
    out["tied_plain_from_tp2"] = run_workers(train_losses, 1, f"{TIED} --load {tied}",
                                             timeout=300)[0]
    out["metadata"] = dcp.FileSystemReader(f"{ck}/iter_0000003").read_metadata().state_dict_metadata
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_each_strategy_matches_one_process(results, name):
    world, model, _ = RUNS[name]
    ref_losses, ref_norms = results[f"ref:{model}"]
    tol = TOL["bf16" if "--bf16" in model else "fp32"]
    assert ref_losses[-1] < ref_losses[0], "the tiny model must learn"
    for rank_results in results[world]:
        losses, norms = rank_results[name]
        loss_diff, norm_diff = max_rel_diff(losses, ref_losses), max_rel_diff(norms, ref_norms)
        print(f"{name}: losses {loss_diff:.1e}, grad norms {norm_diff:.1e} (tolerance {tol:.1e})")
        assert loss_diff <= tol and norm_diff <= tol


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_allocates_what_it_shards(results, strategy):
    expected = expected_bytes_per_param(torch.float32, 2, **EXPECTED[strategy])
    for rank_results in results[2]:
        measured, gathered_after_step = rank_results[f"memory:{strategy}"]
        print(f"{strategy}: {measured['bytes_per_param']:.3f} bytes/param, expected {expected}")
        assert measured["bytes_per_param"] == pytest.approx(expected, rel=0.05)
        if strategy.startswith("optim_grads"):  # the gathered copies are freed by the step
            assert gathered_after_step is False


def test_optim_grads_keeps_the_params_gathered_through_the_backward(results):
    for rank_results in results[2]:
        assert rank_results["gathered:optim_grads"] is True


def test_fsdp_dtensor_has_megatron_lms_layout(results):
    saved = results["metadata"]
    prefix = "model.module.module."  # bf16: Megatron-LM's Float16Module wrapper
    for key in ("decoder.layers.0.mlp.linear_fc1.weight_w", "decoder.layers.0.mlp.linear_fc1.weight_v",
                "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
                "decoder.final_layernorm.weight", "embedding.word_embeddings.weight",
                "output_layer.weight"):
        assert prefix + key in saved, key
        assert saved[prefix + key].properties.dtype == torch.float32  # the fp32 masters
    assert tuple(saved[prefix + "embedding.word_embeddings.weight"].size) == (256, 32)  # padded
    assert tuple(saved[prefix + "decoder.layers.0.mlp.linear_fc1.weight_w"].size) == (128, 32)
    opt = "optimizer.state.module.module.module.decoder.layers.0.mlp.linear_fc1.weight_w"
    for kind in ("exp_avg", "exp_avg_sq", "step"):
        assert f"{opt}.{kind}" in saved
    assert f"{opt.replace('state', 'param_to_group_meta', 1)}.lr" in saved
    for key in ("args", "iteration", "checkpoint_version", "opt_param_scheduler.num_steps"):
        assert key in saved
    assert not any(k.endswith("_extra_state") for k in saved)


def test_fsdp_dtensor_resumes_in_other_layouts_as_the_straight_run(results):
    straight = results["straight"]
    for rank_results in results[2]:
        assert max_rel_diff(rank_results["first"], straight[:3]) <= TOL["bf16"]
    for losses in results["dp2_optim_from_fsdp"]:
        assert max_rel_diff(losses, straight[3:]) <= TOL["bf16"]
    assert max_rel_diff(results["plain_from_fsdp"], straight[3:]) <= TOL["bf16"]
    # TP2 x DP2 with SP, saved in the background (512 padded rows) -> one process (384 rows)
    tied = results["tied_straight"]
    for rank_results in results[4]:
        assert max_rel_diff(rank_results["tied_first"], tied[:3]) <= TOL["bf16"]
    assert max_rel_diff(results["tied_plain_from_tp2"], tied[3:]) <= TOL["bf16"]


@pytest.mark.parametrize("extra,line", [
    ("--ckpt-format torch_dist", "--ckpt-format torch_dist: --use-megatron-fsdp saves"),
    ("--optimizer muon", "--optimizer muon: Megatron-FSDP takes Adam only"),
    ("--check-weight-hash-across-dp-replicas-interval 2",
     "--check-weight-hash-across-dp-replicas-interval is not supported with optim_grads_params"),
    ("--use-torch-fsdp2", "--use-torch-fsdp2 and --use-megatron-fsdp are two FSDPs"),
    ("--megatron-fsdp-version 2", "--megatron-fsdp-version 2: Megatron-FSDP v2"),
    ("--fsdp-manual-registration", "--fsdp-manual-registration:"),
    ("--num-experts 4 --no-bias-gelu-fusion --moe-single-grouped-weight",
     "--moe-single-grouped-weight / --moe-single-grouped-bias: Megatron-FSDP does not"),
    ("--num-experts 4 --no-bias-gelu-fusion --fsdp-double-buffer "
     "--overlap-moe-expert-parallel-comm", "--fsdp-double-buffer: Megatron-FSDP's 1F1B overlap"),
    ("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 2: --use-megatron-fsdp"),
    ("--num-distributed-optimizer-instances 2",
     "--num-distributed-optimizer-instances 2: Megatron-FSDP's hybrid sharding"),
    ("--megatron-fsdp-main-grads-dtype bf16", "--megatron-fsdp-main-grads-dtype bf16:"),
    ("--megatron-fsdp-main-params-dtype auto", "--megatron-fsdp-main-params-dtype auto:"),
])
def test_what_megatron_fsdp_cannot_go_with_is_refused(extra, line):
    assert_refused(f"{STEPS} {MFSDP} optim_grads_params {extra}", line, world_size=4)


def test_fsdp_dtensor_needs_megatron_fsdp_and_optim_strategies_take_their_companions():
    assert_refused(f"{STEPS} --ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor: "
                   "Megatron-LM writes it with --use-megatron-fsdp only", world_size=2)
    assert_refused(f"{STEPS} {MFSDP} no_shard --init-model-with-meta-device",
                   "--init-model-with-meta-device is not supported", world_size=2)
    args = parse_args(f"{STEPS} {MFSDP} optim --num-distributed-optimizer-instances 2 "
                      f"--overlap-param-gather --overlap-grad-reduce".split(), world_size=4)
    assert args.use_distributed_optimizer  # optim is the distributed optimizer
    args = parse_args(f"{STEPS} {MFSDP} optim_grads_params --use-distributed-optimizer "
                      f"--overlap-param-gather --overlap-grad-reduce --fsdp-double-buffer "
                      f"--megatron-fsdp-main-grads-dtype fp32".split(), world_size=2)
    assert not args.use_distributed_optimizer and not args.overlap_param_gather
    notes = " ".join(args.compat_notes)
    assert "--fsdp-double-buffer" in notes and "--megatron-fsdp-main-grads-dtype fp32" in notes
    assert "FSDP2 prefetches" in notes


def test_megatron_cores_fsdp_dtensor_checkpoint_loads_with_its_logits(tmp_path):
    """megatron-core's own Megatron-FSDP (on CPU, DP=2) trains two steps and saves
    --ckpt-format fsdp_dtensor as Megatron-LM's training does; one process here loads it
    (--use-checkpoint-args) and computes its logits, at its iteration and samples."""
    import einops  # noqa: F401 - Megatron-FSDP's device meshes need it (scripts/env.sh)
    import megatron_core_utils as mcu
    from test_megatron_lm_checkpoints import _our_logits, _tokens
    tokens = _tokens()
    theirs = run_workers(mcu.fsdp_train_and_save, 2, "gpt", str(tmp_path), tokens,
                         timeout=300)[0]
    ours, it, consumed = run_workers(_our_logits, 1, str(tmp_path), tokens, timeout=300)[0]
    assert (it, consumed) == (mcu.ITERATION, mcu.ITERATION * mcu.GBS)
    torch.testing.assert_close(ours, theirs[..., :mcu.VOCAB], rtol=1e-5, atol=1e-5)
