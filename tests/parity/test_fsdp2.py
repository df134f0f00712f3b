"""--use-torch-fsdp2: PyTorch's FSDP2 (ZeRO-3) against one process, from the same weights.

- 6 steps give the single-process losses and gradient norms (and the zeros in the gradient
  and the params norm that Megatron-LM's flags log) at DP=2, DP=4, TP=2 x DP=2 with SP,
  CP=2 x DP=2, with full recomputation and without resharding after forward, MoE (EP=1)
  with MLA and MTP, a Gated DeltaNet hybrid under CP=2 x DP=2; with
  Megatron-LM's defaults (learned absolute positions, tied embeddings, LayerNorm/GELU, a
  vocabulary padded to 384 rows at TP=1 and 512 at TP=2) and the Llama-style settings;
  in bf16 and fp16 (loss scaling) too.
- Every gradient of one step, gathered from the shards, is the one-process gradient
  (DP=2 and CP=2 x DP=2).
- Checkpoints (bf16: the fp32 masters are saved as main params, the weights rounded): one
  saved under FSDP2 resumes in one process and under FSDP2 at TP=2 x DP=2, one saved by one
  process resumes under FSDP2, each following the straight run; a weights-only load
  (--no-load-optim) reads the weights into the masters.
- Memory per rank: 16/d bytes per parameter (fp32 params that are their own main params,
  fp32 gradients, Adam), for fp32 and bf16 models.
- What it cannot go with is refused in one line each, before any process group starts.
"""
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.optimizer import expected_bytes_per_param, memory_breakdown
from megatron_cp.optimizer.clip_grads import get_param_norm, grad_of
from megatron_cp.distributed.fsdp import is_fully_sharded
from megatron_cp.distributed.shards import local_shard
from training_utils import (NO_DROPOUT, TINY, assert_refused, max_rel_diff, train_losses,
                            trainer_of)

FSDP = "--use-torch-fsdp2"
STEPS = TINY.replace("--num-layers 2", "--num-layers 3") + " --train-iters 6"
LLAMA = "--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights"
# Megatron-LM's defaults: learned absolute positions, tied embeddings, LayerNorm/GELU; 300
# tokens pad to 384 rows at TP=1 and to 512 at TP=2
MEGATRON = (STEPS.replace("--position-embedding-type rope", "")
            .replace("--vocab-size 200 --make-vocab-size-divisible-by 64", "--vocab-size 300"))
# DeepSeek-V3's pieces (MoE at EP=1, MLA, MTP) and a Gated DeltaNet hybrid (Qwen3-Next's)
DEEPSEEK = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --mtp-num-layers 1 "
            f"{LLAMA} --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 "
            "--qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8")
GDN = ("--seq-length 64 --num-layers 4 --swiglu --disable-bias-linear --normalization RMSNorm "
       "--group-query-attention --num-query-groups 2 --experimental-attention-variant "
       "gated_delta_net --linear-attention-freq 4 --linear-conv-kernel-dim 4 "
       "--linear-key-head-dim 8 --linear-value-head-dim 8 --linear-num-key-heads 2 "
       "--linear-num-value-heads 4 --init-method-std 0.1")
FP16 = "--fp16 --initial-loss-scale 1048576 --hysteresis 1"
LOG = "--log-params-norm --log-num-zeros-in-grad"
# Tolerances from the precision involved. fp32: the shards sum the same fp32 gradients in
# another order than one process (reduce-scatter over ranks, CP's split attention), a few
# ulps (2^-23) per step, which 6 Adam steps carry into the loss: 1e-5 as every layout's
# parity test. bf16 / fp16: those sums feed fp32 masters that the model computes with
# rounded, so an ulp can flip the rounding of a weight by one bf16 / fp16 ulp and move the
# loss by a fraction of it: bounded by the unit roundoff, 2^-8 (bf16) and 2^-11 (fp16).
TOL = {"fp32": 1e-5, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
# name: (world, model and precision flags, layout flags); the reference is one process
# with the model and precision flags
RUNS = {
    "dp2": (2, f"{STEPS} {LOG}", ""),
    "dp2_recompute": (2, STEPS, "--recompute-granularity full --recompute-method uniform "
                                "--recompute-num-layers 1"),
    "dp2_llama_keep_gathered": (2, f"{STEPS} {LLAMA}", "--torch-fsdp2-no-reshard-after-forward"),
    "dp2_bf16": (2, f"{STEPS} --bf16 {LOG}", ""),
    "dp2_fp16": (2, f"{STEPS} {FP16}", ""),
    "dp2_deepseek_pieces": (2, f"{STEPS} {DEEPSEEK}", ""),
    # without dropout: the GDN kernel's CP state passing sums the A_log / dt_bias gradients
    # in another order (~2e-8 absolute with or without dropout), and dropout shrinks those
    # gradients 5x, so their relative error reaches 4e-4 and Adam, which normalises each
    # gradient, carries it into a grad-norm drift of 5e-5 by step 5 (plain CP2 x DP2 too);
    # losses still agree to 1e-7
    "cp2_dp2_gated_deltanet": (4, f"{STEPS} {GDN}{NO_DROPOUT}", "--context-parallel-size 2"),
    "dp4": (4, f"{STEPS} {LOG}", ""),
    # (zeros not compared: TP=2 pads 128 more vocabulary rows, whose gradients are zero)
    "tp2_dp2_megatron_defaults": (4, f"{MEGATRON} --log-params-norm",
                                  "--tensor-model-parallel-size 2 --sequence-parallel"),
    "cp2_dp2_llama": (4, f"{STEPS} {LLAMA}", "--context-parallel-size 2"),
    "tp2_dp2_bf16": (4, f"{STEPS} --bf16", "--tensor-model-parallel-size 2 --sequence-parallel"),
}
GRADS = {"dp2": (2, ""), "cp2_dp2": (4, "--context-parallel-size 2")}
ONE_STEP = f"{STEPS} {LLAMA} --clip-grad 0".replace("--train-iters 6", "--train-iters 1 --lr-decay-iters 6")
BF16 = f"{STEPS} {LLAMA} --bf16"


def _trainer(argv, world):
    return trainer_of(argv, world)


def _steps(rank, world, argv):
    """(losses, grad norms, zeros in the gradient, params norm) of training ``argv``."""
    trainer = _trainer(argv, world)
    losses, norms, zeros = [], [], []
    for _ in range(trainer.args.train_iters):
        loss, norm, _ = trainer.train_step()
        losses.append(loss)
        norms.append(norm)
        zeros.append(trainer.num_zeros)
    params = [p for chunk in trainer.model_chunks for p in chunk.parameters()]
    return losses, norms, zeros, get_param_norm(params, trainer.state,
                                                sharded=is_fully_sharded(trainer.model_chunks))


def _gradients(rank, world, argv):
    """{param name: its whole gradient after one step (unclipped)}, gathered from the
    shards over DP x CP (TP = 1)."""
    trainer = _trainer(argv, world)
    trainer.train_step()
    group = trainer.state.group("dp_cp")
    out = {}
    for name, param in trainer.model_chunks[0].module.named_parameters():
        if is_fully_sharded(trainer.model_chunks):
            _, start, stop = local_shard(param)
            whole = torch.zeros(param.numel())
            whole[start:stop] = param.main_grad
            dist.all_reduce(whole, group=group)  # each element is on one rank only
        else:
            whole = grad_of(param).reshape(-1).float()
        out[name] = whole.tolist()
    return out


def _gathered_after_forward(rank, world, argv):
    """Whether a transformer layer's weight is still gathered (a plain tensor, not this
    rank's DTensor shard) between a forward and its backward."""
    from torch.distributed.tensor import DTensor
    trainer = _trainer(argv, world)
    model = trainer.model_chunks[0]
    tokens = torch.randint(0, 200, (2, 32))  # [b, s]
    position_ids = torch.arange(32).expand(2, 32)
    model(tokens, position_ids).float().sum()
    layer = model.module.decoder.layers[0]
    return not isinstance(next(layer.parameters()), DTensor)


def _memory(rank, world, argv):
    trainer = _trainer(argv, world)
    trainer.train_step()  # Adam state as torch creates it
    return memory_breakdown(trainer.model_chunks, trainer.optimizer)


def _jobs(rank, world, jobs):
    return {name: fn(rank, world, argv) for name, (fn, argv) in jobs.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    fsdp_ck, plain_ck = str(tmp / "fsdp"), str(tmp / "plain")
    out = {}
    one = {f"ref:{model}": (_steps, model) for _, model, _ in RUNS.values()}
    one.update({"grads:ref": (_gradients, ONE_STEP),
                "straight": (train_losses, BF16),
                "plain_first": (train_losses, f"{BF16} --exit-interval 3 --save {plain_ck}")})
    out.update(run_workers(_jobs, 1, one, timeout=400)[0])
    for world in (2, 4):
        jobs = {name: (_steps, f"{model} {layout} {FSDP}")
                for name, (w, model, layout) in RUNS.items() if w == world}
        jobs.update({f"grads:{name}": (_gradients, f"{ONE_STEP} {layout} {FSDP}")
                     for name, (w, layout) in GRADS.items() if w == world})
        jobs.update({f"memory:{dtype}:{world}": (_memory, f"{STEPS} {flag} {FSDP}")
                     for dtype, flag in (("fp32", ""), ("bf16", "--bf16"))})
        if world == 2:
            for keep in ("", "--torch-fsdp2-no-reshard-after-forward"):
                jobs[f"gathered:{keep}"] = (_gathered_after_forward, f"{STEPS} {FSDP} {keep}")
            jobs["fsdp_first"] = (train_losses, f"{BF16} {FSDP} --exit-interval 3 --save {fsdp_ck}")
            jobs["fsdp_from_plain"] = (train_losses, f"{BF16} {FSDP} --load {plain_ck}")
        else:
            jobs["fsdp_tp2_from_fsdp"] = (train_losses, f"{BF16} {FSDP} --load {fsdp_ck} "
                                                        f"--tensor-model-parallel-size 2")
        out[world] = run_workers(_jobs, world, jobs, timeout=500)
    out.update(run_workers(_jobs, 1, {
        "plain_from_fsdp": (train_losses, f"{BF16} --load {fsdp_ck}"),
        "weights_only_from_fsdp": (train_losses, f"{BF16} --load {fsdp_ck} --no-load-optim")},
        timeout=300)[0])
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_fsdp2_matches_one_process(results, name):
    world, model, _ = RUNS[name]
    ref_losses, ref_norms, ref_zeros, ref_params_norm = results[f"ref:{model}"]
    tol = TOL["bf16" if "--bf16" in model else "fp16" if "--fp16" in model else "fp32"]
    assert ref_losses[-1] < ref_losses[0], "the tiny model must learn"
    for rank_results in results[world]:
        losses, norms, zeros, params_norm = rank_results[name]
        kept = [i for i, n in enumerate(ref_norms) if n is not None]  # fp16: skipped steps
        assert [n is not None for n in norms] == [n is not None for n in ref_norms]
        loss_diff = max_rel_diff(losses, ref_losses)
        norm_diff = max_rel_diff([norms[i] for i in kept], [ref_norms[i] for i in kept])
        print(f"{name}: losses {loss_diff:.1e}, grad norms {norm_diff:.1e} (tolerance {tol:.1e})")
        assert loss_diff <= tol and norm_diff <= tol
        assert abs(params_norm - ref_params_norm) <= tol * ref_params_norm
        if LOG in model:  # the zeros of the gradient: the same count of the same tensors
            assert all(z is not None for z in zeros)
            if "--bf16" in model:
                # Step 1 (the same weights) has only the structural zeros. Later, a weight
                # may differ by one bf16 ulp, which makes or unmakes an exact cancellation
                # in a few elements: a count within the unit roundoff of itself.
                assert zeros[0] == ref_zeros[0]
                assert all(abs(z - r) <= tol * r for z, r in zip(zeros, ref_zeros)), zeros
            else:
                assert zeros == ref_zeros
    if "fp16" in name:
        assert len(kept) < len(ref_norms), "the fp16 run must skip overflowing steps"


@pytest.mark.parametrize("name", list(GRADS))
def test_every_gradient_is_the_one_process_gradient(results, name):
    world, _ = GRADS[name]
    reference = results["grads:ref"]
    for rank_results in results[world]:
        grads = rank_results[f"grads:{name}"]
        assert grads.keys() == reference.keys() and len(grads) > 10
        for param_name, grad in grads.items():
            torch.testing.assert_close(torch.tensor(grad), torch.tensor(reference[param_name]),
                                       rtol=1e-5, atol=1e-7, msg=param_name)


def test_checkpoints_cross_between_fsdp2_and_other_layouts(results):
    straight = results["straight"]
    assert len(straight) == 6 and max_rel_diff(results["plain_first"], straight[:3]) == 0
    for rank_results in results[2]:
        assert max_rel_diff(rank_results["fsdp_first"], straight[:3]) <= TOL["bf16"]
        assert max_rel_diff(rank_results["fsdp_from_plain"], straight[3:]) <= TOL["bf16"]
    for rank_results in results[4]:
        assert max_rel_diff(rank_results["fsdp_tp2_from_fsdp"], straight[3:]) <= TOL["bf16"]
    assert max_rel_diff(results["plain_from_fsdp"], straight[3:]) <= TOL["bf16"]
    # weights only: the first resumed loss is a forward of the loaded weights; then a fresh
    # Adam takes another path
    weights_only = results["weights_only_from_fsdp"]
    assert abs(weights_only[0] - straight[3]) <= TOL["bf16"] * straight[3]
    assert max_rel_diff(weights_only[1:], straight[4:]) > TOL["bf16"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_memory_per_rank_is_16_bytes_over_d(results, world, dtype):
    expected = expected_bytes_per_param(torch.bfloat16 if dtype == "bf16" else torch.float32,
                                        world, fully_sharded=True)
    assert expected == 16 / world
    for rank_results in results[world]:
        measured = rank_results[f"memory:{dtype}:{world}"]
        print(f"{dtype} d={world}: {measured['bytes_per_param']:.3f} bytes/param")
        # rows do not always split evenly: a rank holds up to one row per param more
        assert measured["bytes_per_param"] == pytest.approx(expected, rel=0.05)
        assert measured["main_params"] == 0  # the fp32 params are the main params


@pytest.mark.parametrize("extra,line", [
    ("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 2: --use-torch-fsdp2"),
    ("--num-experts 4 --no-bias-gelu-fusion --expert-model-parallel-size 2",
     "--expert-model-parallel-size 2:"),
    ("--use-distributed-optimizer", "--use-distributed-optimizer: --use-torch-fsdp2"),
    ("--ckpt-format torch", "--ckpt-format torch: --use-torch-fsdp2"),
    ("--optimizer muon", "--optimizer muon: Muon"),
    ("--check-weight-hash-across-dp-replicas-interval 2",
     "--check-weight-hash-across-dp-replicas-interval: --use-torch-fsdp2"),
])
def test_what_fsdp2_cannot_go_with_is_refused(extra, line):
    assert_refused(f"{STEPS} {FSDP} {extra}", line, world_size=4)


def test_no_reshard_after_forward_keeps_the_layers_gathered(results):
    for rank_results in results[2]:
        assert rank_results["gathered:"] is False  # freed after forward, gathered again later
        assert rank_results["gathered:--torch-fsdp2-no-reshard-after-forward"] is True
