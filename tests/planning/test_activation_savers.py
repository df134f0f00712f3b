"""The bytes each activation saver removes (--recompute-modules layernorm / mlp / moe /
shared_experts / moe_act, --distribute-saved-activations), measured on the CPU by the peak
meter (observability/memory_peak.py: what a layer's forward still holds when it returns is
what it saved for backward, plus its output) or, for the split checkpoint input, off its
storage, equal what the memory model (planning/memory.py) predicts, to the byte."""
import gc

import pytest
import torch

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTModel
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.planning.memory import _Shapes, _chunk_activation_bytes, layer_activation_bytes
from model_utils import tiny_config

B, S, H = 2, 256, 64
SIZES = dict(hidden_size=H, ffn_hidden_size=128, max_position_embeddings=S)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           moe_shared_expert_intermediate_size=32, normalization="RMSNorm",
           activation="swiglu", add_bias_linear=False)
SELECTIVE = dict(recompute_granularity="selective")
CASES = {  # name: (model, saver)
    "layernorm": ({}, dict(SELECTIVE, recompute_modules=("layernorm",))),
    "layernorm_rmsnorm_moe": (MOE, dict(SELECTIVE, recompute_modules=("layernorm",))),
    "mlp": ({}, dict(SELECTIVE, recompute_modules=("mlp",))),
    "shared_experts": (MOE, dict(SELECTIVE, recompute_modules=("shared_experts",))),
    "moe_act": (MOE, dict(SELECTIVE, recompute_modules=("moe_act",))),
}


def _held_after_forward(config, state=None):
    """Tensor bytes a training forward of the embedding and the layers still holds when it
    returns (after one forward and backward, so that nothing built once is counted)."""
    torch.manual_seed(0)
    model = GPTModel(config, state=state).train()
    tokens = torch.randint(0, 100, (B, S))
    positions = torch.arange(S).expand(B, S)
    model.decoder(model.embedding(tokens, positions), positions).sum().backward()
    gc.collect()  # an earlier graph freed inside the meter would count against this one
    with PeakMemory("cpu", measure_baseline=False) as meter:
        out = model.decoder(model.embedding(tokens, positions), positions)
    del out
    return meter.retained_bytes


def _shapes(tp=1):
    return _Shapes(micro_batch=B, tokens=B * S, norm_tokens=B * S, tp=tp, cp=1, cp_comms=None,
                   act=4, fused_norm=False)


@pytest.mark.parametrize("case", list(CASES))
def test_each_saver_removes_what_the_model_predicts(case):
    model, saver = CASES[case]
    plain = tiny_config(num_layers=1, **SIZES, **model)
    saving = tiny_config(num_layers=1, **SIZES, **model, **saver)
    measured = _held_after_forward(plain) - _held_after_forward(saving)
    predicted = layer_activation_bytes(plain, _shapes(), 0) - \
        layer_activation_bytes(saving, _shapes(), 0)
    assert measured > 0 and measured == predicted, (case, measured, predicted)


def test_a_recomputed_moe_layer_keeps_what_a_recomputed_mlp_keeps():
    """--recompute-modules moe: the layer keeps its input and the checkpoint's RNG states,
    as a recomputed dense MLP does, which is what the model predicts for both."""
    dense = dict(MOE, num_moe_experts=None, moe_shared_expert_intermediate_size=None)
    moe = tiny_config(num_layers=1, **SIZES, **MOE, **SELECTIVE, recompute_modules=("moe",))
    mlp = tiny_config(num_layers=1, **SIZES, **dense, **SELECTIVE, recompute_modules=("mlp",))
    assert _held_after_forward(moe) == _held_after_forward(mlp)
    assert layer_activation_bytes(moe, _shapes(), 0) == layer_activation_bytes(mlp, _shapes(), 0)


def _distributed(rank, world):
    """The checkpoint of the first layer keeps its input (the embedding's output): whole, or
    this rank's half with --distribute-saved-activations, as the memory model's two chunk
    inputs predict. (Read off the input's storage: gloo frees some temporaries on its own
    threads, which the CPU peak meter does not follow.)"""
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    full = dict(num_layers=2, **SIZES, recompute_granularity="full", recompute_method="uniform",
                recompute_num_layers=1)
    kept, predicted = {}, {}
    for distribute in (False, True):
        config = tiny_config(**full, distribute_saved_activations=distribute)
        predicted[distribute] = _chunk_activation_bytes(config, _shapes(tp=2), [0, 1], 1, 1)[0]
        model = GPTModel(config, state=state).train()
        tokens = torch.randint(0, 100, (B, S))
        positions = torch.arange(S).expand(B, S)
        h = model.embedding(tokens, positions)  # [s, b, h]
        out = model.decoder(h, positions)
        kept[distribute] = h.untyped_storage().nbytes()
        out.sum().backward()  # the recompute gathers it back
        assert h.shape == (S, B, H) and h.untyped_storage().nbytes() == B * S * H * 4
    assert kept[False] == B * S * H * 4 and kept[True] == kept[False] // 2
    # two recomputed chunks, each keeping its input
    assert predicted[False] - predicted[True] == 2 * (kept[False] - kept[True])
    return True


def test_distributed_saved_activations_keep_half_of_each_input_under_tp2():
    assert all(run_workers(_distributed, 2, timeout=200))
