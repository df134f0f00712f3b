"""Fine-grained activation offloading (--fine-grained-activation-offloading, --offload-modules,
--min-offloaded-tensor-size, --activation-offload-fraction, --delta-offload-bytes-across-pp-
ranks): Megatron-LM's choice of groups, the copies exercised on CPU tensors (a host copy of a
CPU tensor is a second one) leaving every loss and gradient as they were, in one process and
under TP2 + SP, and the bytes moved per microbatch equal to the memory model's count."""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.layers.activation_offload import ActivationOffloader
from megatron_cp.layers.fine_grained_offload import fine_grained_note, plan_offload
from megatron_cp.model import GPTModel
from megatron_cp.planning.memory import _Shapes, offloaded_bytes
from model_utils import full_grads, tiny_config

DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           normalization="RMSNorm", activation="swiglu", add_bias_linear=False)
B, S = 2, 16
CASES = {  # name: (model, offloading settings)
    "dense": ({}, dict(offload_modules=DENSE, min_offloaded_tensor_size=0)),
    # 512 elements: the norms' statistics and narrow tensors stay; half the groups move
    "dense_threshold_fraction": ({}, dict(offload_modules=DENSE, min_offloaded_tensor_size=512,
                                          activation_offload_fraction=0.5)),
    "moe": (MOE, dict(offload_modules=("mlp_norm", "expert_fc1", "moe_act"),
                      min_offloaded_tensor_size=0)),
    "moe_act_recomputed": (MOE, dict(offload_modules=("expert_fc1", "moe_act"),
                                     min_offloaded_tensor_size=0,
                                     recompute_granularity="selective",
                                     recompute_modules=("moe_act", "layernorm"))),
}


def test_plan_keeps_the_last_group_of_each_name_then_bytes_then_the_fraction():
    groups = [("a", 10), ("b", 0), ("a", 20), ("b", 5), ("a", 30), ("b", 6)]
    moves, _ = plan_offload(groups, 1.0)
    assert moves == [True, True, True, True, False, False]
    # rank 1 of a delta of 15 bytes: groups 0 and 1 (10 bytes, 0 bytes), then 2 covers it
    moves, left = plan_offload(groups, 1.0, keep_bytes=15)
    assert moves == [False, False, False, True, False, False] and left == 0
    # fraction 0.5 of the 3 groups with bytes (0, 2, 3): int(3 * 0.5) = 1 more stays, the last
    moves, _ = plan_offload(groups, 0.5)
    assert moves == [True, True, True, False, False, False]
    assert plan_offload(groups, 1.0, keep_last=False)[0] == [True] * 6


def _batch():
    gen = torch.Generator().manual_seed(5)
    tokens, labels = (torch.randint(0, 120, (B, S), generator=gen) for _ in range(2))
    return tokens, torch.arange(S).expand(B, S), labels


def _config(case, offload, **extra):
    model, settings = CASES[case]
    kw = dict(model, hidden_dropout=0.1, attention_dropout=0.1, **extra)
    if offload:
        kw.update(settings, fine_grained_activation_offloading=True)
    elif "recompute_modules" in settings:
        kw.update(recompute_granularity="selective", recompute_modules=settings["recompute_modules"])
    return tiny_config(**kw)


def _two_steps(model):
    """Two training forward + backward passes (the first is the offloader's warmup): the
    last loss, and each forward's moved bytes (None without offloading)."""
    offload = model.decoder.fine_offload
    if offload is not None:
        offload.move = True  # copy as a GPU would, to a second CPU tensor
    tokens, pos, labels = _batch()
    for _ in range(2):
        model.zero_grad()
        loss = model(tokens, pos, labels=labels, sample_ids=torch.tensor([40, 41]))
        weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
        (loss * weights).sum().backward()
    return loss.detach(), offload and offload.moved_bytes


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_same_losses_and_gradients_and_the_predicted_bytes(case):
    ref, model = GPTModel(_config(case, False)), GPTModel(_config(case, True))
    loss_ref, _ = _two_steps(ref)
    loss, moved = _two_steps(model)
    assert torch.equal(loss, loss_ref)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name
    sh = _Shapes(B, B * S, B * S, tp=1, cp=1, cp_comms=None, act=4, fused_norm=False)
    predicted, _ = offloaded_bytes(model.config, sh, [0, 1])
    assert moved[1] == predicted > 0, (moved, predicted)  # after the warmup forward
    assert moved[0] > moved[1]  # the warmup moves every group


def _tp2_sp(rank, world):
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    for case in ("dense", "moe"):
        ref = GPTModel(_config(case, False))
        model = GPTModel(_config(case, True, sequence_parallel=True), state=state)
        loss_ref, _ = _two_steps(ref)
        loss, moved = _two_steps(model)
        torch.testing.assert_close(loss, loss_ref)
        got = full_grads(model, state.group("tp"))
        for name, p in model.named_parameters():
            if getattr(p, "is_expert", False):  # ETP 1: whole experts, each rank's tokens
                got[name] = p.grad.clone()
                torch.distributed.all_reduce(got[name], group=state.group("tp"))
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.grad, msg=lambda m: f"{case} {name}: {m}")
        sh = _Shapes(B, B * S, B * S // 2, tp=2, cp=1, cp_comms=None, act=4, fused_norm=False)
        if case == "dense":  # the experts' share of tokens follows the routing
            assert moved[1] == offloaded_bytes(model.config, sh, [0, 1])[0] > 0
    return True


def test_tp2_sp_matches_one_process_without_offloading():
    assert all(run_workers(_tp2_sp, 2, timeout=200))


@pytest.mark.parametrize("kw, words", [
    (dict(offload_modules=("attn_proj",)), "attn_proj needs core_attn"),
    (dict(offload_modules=("fused_group_mlp",)), "op fuser"),
    (dict(offload_modules=("mlp",)), "'mlp' is not one of"),
    (dict(offload_modules=()), "needs offload_modules"),
    (dict(offload_modules=("core_attn",), cpu_offloading_num_layers=1), "cpu_offloading"),
    (dict(offload_modules=("core_attn",), activation_offload_fraction=1.5), "from 0 to 1"),
    (dict(offload_modules=("core_attn",), min_offloaded_tensor_size=-1), ">= 0"),
    (dict(MOE, offload_modules=("moe_act",), moe_layer_recompute=True), "recomputes whole"),
    (dict(offload_modules=("core_attn",), torch_compile=True), "drop one"),
])
def test_megatron_lm_rules(kw, words):
    with pytest.raises(ValueError, match=words):
        tiny_config(fine_grained_activation_offloading=True, **kw)


def test_cpu_start_up_note_says_nothing_moves():
    config = tiny_config(fine_grained_activation_offloading=True, offload_modules=DENSE)
    assert "nothing moves" in fine_grained_note(config, "cpu")
    assert fine_grained_note(tiny_config(), "cpu") is None


def test_retained_host_buffers_are_reused():
    """--cpu-offloading-retain-pinned-cpu-buffers: a buffer whose tensor came back serves the
    next tensor of its shape."""
    offloader = ActivationOffloader("cpu", pin=False, retain=True)
    first = offloader.pack(torch.randn(4, 6))
    offloader.unpack(first)
    second = offloader.pack(torch.randn(4, 6))
    assert second.host is first.host
    plain = ActivationOffloader("cpu", pin=False)
    one = plain.pack(torch.randn(4, 6))
    plain.unpack(one)
    assert plain.pack(torch.randn(4, 6)).host is not one.host
