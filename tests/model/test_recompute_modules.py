"""--recompute-modules (selective recomputation of chosen modules) and --moe-layer-recompute:
each leaves the losses and every gradient of the run without it, with dropout on (the RNG
tracker and the hashed masks give the recomputed forward the same masks), in one process
and under TP2 + SP against the one-process model without it; and Megatron-LM's rules."""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTModel
from model_utils import full_grads, tiny_config

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=0.01,
           normalization="RMSNorm", activation="swiglu", add_bias_linear=False)
MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, normalization="RMSNorm", qk_layernorm=True)
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
# name: (model, the saver's settings)
CASES = {
    "core_attn": ({}, dict(recompute_modules=("core_attn",))),
    "layernorm": ({}, dict(recompute_modules=("layernorm",))),
    "mlp": ({}, dict(recompute_modules=("mlp",))),
    "dense_all": ({}, dict(recompute_modules=("core_attn", "layernorm", "mlp"))),
    "moe": (MOE, dict(recompute_modules=("moe",))),
    "moe_layer_recompute": (MOE, dict(moe_layer_recompute=True)),
    "shared_experts": (MOE, dict(recompute_modules=("shared_experts",))),
    "moe_act": (MOE, dict(recompute_modules=("moe_act",))),
    "moe_all": (MOE, dict(recompute_modules=("layernorm", "moe_act", "shared_experts"))),
    "mla_up_proj": (MLA, dict(recompute_modules=("mla_up_proj",))),
    "mla_up_proj_core_attn": (MLA, dict(recompute_modules=("mla_up_proj", "core_attn"))),
}


def _batch(b=2, s=16, vocab=120):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (b, s), generator=gen)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    return tokens, torch.arange(s).expand(b, s), labels


def _config(case, saver, **extra):
    model, saver_kw = CASES[case]
    kw = dict(model, **DROPOUT, **extra)
    if saver:
        kw.update(saver_kw)
        kw.setdefault("recompute_granularity", "selective")
    return tiny_config(**kw)


def _loss_and_grads(model, tokens, pos, labels):
    model.train()  # dropout masks from the samples' numbers: the same under every layout
    loss = model(tokens, pos, labels=labels, sample_ids=torch.tensor([40, 41]))
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    return loss.detach()


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_losses_and_gradients_are_unchanged(case):
    tokens, pos, labels = _batch()
    runs = []
    for saver in (False, True):
        model = GPTModel(_config(case, saver))
        loss = _loss_and_grads(model, tokens, pos, labels)
        runs.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss_ref, grads_ref), (loss, grads) = runs
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad,  # fp32 rounding: summation order
                                   msg=lambda m: f"{case} {name}: {m}")


def _tp2_sp(rank, world, cases):
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    tokens, pos, labels = _batch()
    for case in cases:
        ref = GPTModel(_config(case, False))
        model = GPTModel(_config(case, True, sequence_parallel=True), state=state)
        loss_ref = _loss_and_grads(ref, tokens, pos, labels)
        loss = _loss_and_grads(model, tokens, pos, labels)
        torch.testing.assert_close(loss, loss_ref)
        got = full_grads(model, state.group("tp"))
        for name, p in model.named_parameters():
            if getattr(p, "is_expert", False):  # ETP 1: whole experts, each TP rank's tokens
                got[name] = p.grad.clone()
                torch.distributed.all_reduce(got[name], group=state.group("tp"))
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.grad, msg=lambda m: f"{case} {name}: {m}")
    return True


def test_tp2_sp_matches_one_process_without_recompute():
    assert all(run_workers(_tp2_sp, 2, list(CASES), timeout=300))


def test_moe_layer_recompute_is_selective_with_moe():
    config = tiny_config(**MOE, moe_layer_recompute=True)
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ("core_attn", "moe")
    assert tiny_config().recompute_modules == ("core_attn",)  # Megatron-LM's default


@pytest.mark.parametrize("kw, words", [
    (dict(recompute_modules=("gdp_qkv",)), "Gated DeltaProduct is not built"),
    (dict(recompute_modules=("mhc",)), "hyper-connections"),
    (dict(recompute_modules=("attention",)), "'attention' is not one of"),
    (dict(recompute_modules=("mla_up_proj",)), "multi_latent_attention only"),
])
def test_refusals_name_the_module(kw, words):
    with pytest.raises(ValueError, match=words):
        tiny_config(recompute_granularity="selective", **kw)


def test_moe_layer_recompute_refuses_full_granularity():
    with pytest.raises(ValueError, match="moe_layer_recompute"):
        tiny_config(**MOE, moe_layer_recompute=True, recompute_granularity="full",
                    recompute_method="uniform", recompute_num_layers=1)


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _tp2_distributed(rank, world):
    """TP2 without SP, full recomputation: with --distribute-saved-activations each rank
    keeps half of every recomputed layer's input, and the losses and gradients are the
    one-process model's without recomputation."""
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    tokens, pos, labels = _batch()
    ref = GPTModel(tiny_config(**DROPOUT))
    loss_ref = _loss_and_grads(ref, tokens, pos, labels)
    for method in ("uniform", "block"):
        model = GPTModel(tiny_config(**DROPOUT, **dict(FULL, recompute_method=method),
                                     distribute_saved_activations=True), state=state)
        loss = _loss_and_grads(model, tokens, pos, labels)
        torch.testing.assert_close(loss, loss_ref)
        got = full_grads(model, state.group("tp"))
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.grad, msg=lambda m: f"{method} {name}: {m}")
    return True


def test_distribute_saved_activations_tp2_matches_one_process():
    assert all(run_workers(_tp2_distributed, 2, timeout=300))


@pytest.mark.parametrize("kw, words", [
    (dict(FULL, sequence_parallel=True), "must be off with sequence_parallel"),
    (dict(recompute_granularity="selective"), "use recompute_granularity full"),
])
def test_distribute_saved_activations_rules(kw, words):
    with pytest.raises(ValueError, match=words):
        tiny_config(distribute_saved_activations=True, **kw)


def test_distribute_saved_activations_needs_tp():
    with pytest.raises(ValueError, match="tensor_model_parallel_size is 1"):
        tiny_config(distribute_saved_activations=True, **FULL).validate_parallel(1)
