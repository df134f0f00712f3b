"""Hugging Face Qwen3-Next (Gated DeltaNet + gated attention hybrid, MoE with a gated shared
expert): a transformers-made model imports with transformers' logits and exports back
tensor-equal."""
import ast

import torch

from megatron_cp.checkpoint.hf import convert as hf_convert
from megatron_cp.model import GPTConfig, GPTModel
from model_utils import qwen3_next_hf_model
from tools import checkpoint_convert as convert


def _our_model(args, full):
    pattern = ast.literal_eval(args["moe_layer_freq"])
    config = GPTConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        vocab_size=120, make_vocab_size_divisible_by=32, ffn_hidden_size=48,
        max_position_embeddings=64, position_embedding_type="rope",
        rotary_percent=args["rotary_percent"], normalization="RMSNorm", norm_epsilon=1e-6,
        layernorm_zero_centered_gamma=True, qk_layernorm=True, activation="swiglu",
        add_bias_linear=False, attention_output_gate=True, hidden_dropout=0.0,
        attention_dropout=0.0, untie_embeddings_and_output_weights=True,
        experimental_attention_variant="gdn", linear_attention_freq=args["linear_attention_freq"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_layer_freq=str(pattern), moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True)
    model = GPTModel(config).eval()
    model.load_state_dict(convert.pad_vocab_rows(full, args, 1))
    return model


def test_qwen3_next_import_logits_and_export_round_trip(tmp_path):
    hf = qwen3_next_hf_model(tmp_path / "hf")
    full, args, _ = hf_convert.import_hf(str(tmp_path / "hf"))
    assert args["linear_attention_freq"] == "[1, 1, 1, 0]"
    assert args["moe_layer_freq"] == "[1, 0, 1, 1]"
    ours = _our_model(args, full)
    tokens = torch.randint(0, 120, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits  # [b, s, v]
        got = ours(tokens, torch.arange(40).expand(2, 40)).transpose(0, 1)[..., :120]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert hf_convert.export_hf(full, args, str(tmp_path / "out"), tokenizer=False) == \
        "Qwen3NextForCausalLM"
    from transformers import Qwen3NextForCausalLM
    back = Qwen3NextForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    original = hf.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert back.state_dict().keys() == original.keys()
