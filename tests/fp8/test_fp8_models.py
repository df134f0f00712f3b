"""FP8 across the model variants: every linear of MLA, Gated DeltaNet, the MTP layers
(eh_proj included) and the shared experts runs in FP8, and so does the dense model under
--no-fp8-wgrad; --first-last-layers-bf16 leaves exactly the first and last decoder layers
(counted globally, over PP stages) without FP8; activation recomputation (full and
selective) reruns the forward with the same amaxes and scales, so its losses equal the plain
run's bitwise. One tiny run of a few steps each (torch._scaled_mm is slow on the CPU)."""
import pytest

from dist_harness import run_workers
from training_utils import TINY, trained, trainer_of

# 2 microbatches a step, delayed scaling (Megatron-LM's default recipe)
BASE = TINY.replace("--global-batch-size 8", "--global-batch-size 4") + " --fp8-format hybrid"
STEPS = f"{BASE} --train-iters 3"
MLA = ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 8 "
       "--qk-pos-emb-head-dim 8 --v-head-dim 8")
GDN = ("--swiglu --disable-bias-linear --normalization RMSNorm --experimental-attention-variant "
       "gated_delta_net --linear-attention-freq 2 --linear-conv-kernel-dim 4 "
       "--linear-key-head-dim 8 --linear-value-head-dim 8 --linear-num-key-heads 2 "
       "--linear-num-value-heads 4 --init-method-std 0.1")
MOE = ("--num-experts 2 --moe-router-topk 1 --moe-ffn-hidden-size 16 --disable-bias-linear "
       "--moe-shared-expert-intermediate-size 16")
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
RUNS = {"plain": STEPS, "mla": f"{STEPS} {MLA}", "gdn": f"{STEPS} {GDN}",
        "mtp": f"{STEPS} --mtp-num-layers 1", "moe_shared": f"{STEPS} {MOE}",
        "no_fp8_wgrad": f"{STEPS} --no-fp8-wgrad", "recompute_full": f"{STEPS} {FULL}",
        "recompute_selective": f"{STEPS} --recompute-granularity selective"}
# tensorwise: Megatron-LM refuses --first-last-layers-bf16 with the delayed recipe
BF16_ENDS = (BASE.replace("--num-layers 2", "--num-layers 4") + " --train-iters 3 "
             "--fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-start-in-bf16 1 "
             "--num-layers-at-end-in-bf16 2")


def _fp8_linears(chunks):
    """The global names of the linears that carry an fp8_meta."""
    from megatron_cp.checkpoint.canonical import canonical_name
    names = []
    for chunk in chunks:
        while not hasattr(chunk, "decoder"):  # DDP's wrapper
            chunk = chunk.module
        layers = list(chunk.decoder.layer_numbers)
        names += [canonical_name(name, layers) for name, m in chunk.named_modules()
                  if getattr(m, "fp8_meta", None) is not None]
    return sorted(names)


def _train(rank, world, runs):
    out = {}
    for name, argv in runs.items():
        losses, trainer = trained(rank, world, argv)
        out[name] = losses, _fp8_linears(trainer.model_chunks)
    return out


def _built(rank, world, argv):
    return _fp8_linears(trainer_of(argv, world).model_chunks)


@pytest.fixture(scope="module")
def runs():
    return run_workers(_train, 1, RUNS, timeout=600)[0]


def test_every_variant_trains_in_fp8(runs):
    plain, plain_linears = runs["plain"]
    assert plain_linears == [f"decoder.layers.{n}.{m}" for n in (0, 1) for m in (
        "mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj",
        "self_attention.linear_qkv")]
    for name, (losses, linears) in runs.items():
        assert len(losses) == 3 and all(0 < x < 6 for x in losses), (name, losses)
        print(name, losses, len(linears))
    mla = runs["mla"][1]
    for proj in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                 "linear_kv_up_proj", "linear_proj"):
        assert f"decoder.layers.0.self_attention.{proj}" in mla, (proj, mla)
    gdn = runs["gdn"][1]  # layer 0 Gated DeltaNet, layer 1 attention
    assert {"decoder.layers.0.self_attention.in_proj", "decoder.layers.0.self_attention.out_proj",
            "decoder.layers.1.self_attention.linear_qkv"} <= set(gdn), gdn
    mtp = [n for n in runs["mtp"][1] if n.startswith("mtp.")]
    assert any(n.endswith("eh_proj") for n in mtp) and len(mtp) == 5, mtp
    shared = [n for n in runs["moe_shared"][1] if "shared_experts" in n]
    assert len(shared) == 4, runs["moe_shared"][1]  # fc1 and fc2 of each layer's
    assert runs["no_fp8_wgrad"][0] != plain  # the weight gradients in fp32 move the loss


@pytest.mark.parametrize("recompute", ["recompute_full", "recompute_selective"])
def test_recomputation_reruns_the_same_fp8_forward(runs, recompute):
    assert runs[recompute][0] == runs["plain"][0]


def test_first_last_layers_bf16_counts_layers_globally_over_pp_stages():
    """4 layers, the first 1 and the last 2 in bf16: only layer 1 has FP8, in one process
    and at PP2 (stage 0 holds layers 0-1, stage 1 none of FP8)."""
    one = run_workers(_built, 1, BF16_ENDS)[0]
    pp2 = run_workers(_built, 2, f"{BF16_ENDS} --pipeline-model-parallel-size 2")
    assert {n.split(".")[2] for n in one} == {"1"} and len(one) == 4
    assert pp2 == [one, []]
