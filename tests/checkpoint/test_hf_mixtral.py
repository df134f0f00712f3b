"""Hugging Face Mixtral conversion: an MoE megatron_cp model exports as MixtralForCausalLM with
transformers' logits (the default softmax router is Mixtral's: top-k renormalised), imports
back bit-exactly, a transformers-made Mixtral imports with its logits, and what Mixtral cannot
express is refused by name.

Every model here is one process: the full state dict is a GPTModel's ``state_dict()`` (the
canonical names and shapes a checkpoint's full view has), weights moved away from init."""
import json

import pytest
import torch

from megatron_cp.checkpoint.hf import convert as hf_convert, llama as hf_llama, mixtral as hf_mixtral
from megatron_cp.checkpoint.hf.io import real_rows, write_folder
from megatron_cp.model import GPTModel
from model_utils import tiny_config
from test_hf_conversion import _gpt_model, _logits, _perturbed
from tools import checkpoint_convert as convert

# GPTConfig of the exported model: Llama-style, every layer MoE (4 experts, top-2), GQA, untied
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=64, max_position_embeddings=64, vocab_size=120,
             make_vocab_size_divisible_by=32, normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, num_moe_experts=4, moe_router_topk=2,
             moe_ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0)


def _args(**changes):
    """The saved args dict of a checkpoint of MODEL (the names the command line gives)."""
    args = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
            "kv_channels": None, "ffn_hidden_size": 64, "max_position_embeddings": 64,
            "true_vocab_size": 120, "make_vocab_size_divisible_by": 32, **hf_llama.REQUIRED,
            "untie_embeddings_and_output_weights": True, "norm_epsilon": 1e-5,
            "rotary_base": 10000.0, "rotary_percent": 1.0, "num_experts": 4,
            "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "moe_layer_freq": "1",
            "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
            "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
            "moe_router_group_topk": None, "moe_router_enable_expert_bias": False,
            "moe_expert_capacity_factor": None}
    return {**args, **changes}


def _ours(args, full, **changes):
    """A one-process megatron_cp MoE model of ``args`` holding ``full``."""
    moe = dict(num_query_groups=args["num_query_groups"], num_moe_experts=args["num_experts"],
               moe_router_topk=args["moe_router_topk"],
               moe_ffn_hidden_size=args["moe_ffn_hidden_size"], rotary_base=args["rotary_base"],
               norm_epsilon=args["norm_epsilon"])
    return _gpt_model(args, full, **{**moe, **changes})


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(input_ids=tokens).logits


def test_mixtral_export_logits_and_bit_exact_round_trip(tmp_path):
    from transformers import MixtralForCausalLM
    args, hf_dir = _args(), tmp_path / "hf"
    full = _perturbed(GPTModel(tiny_config(**MODEL)).state_dict())
    assert full["decoder.layers.1.mlp.experts.linear_fc1.weight"].shape == (4, 96, 32)
    assert hf_convert.pick_layout(args) == "mixtral"
    assert hf_convert.export_hf(full, args, str(hf_dir), tokenizer=False) == "MixtralForCausalLM"
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    assert config["num_experts_per_tok"] == 2 and config["intermediate_size"] == 48
    assert config["vocab_size"] == 120 and config["num_key_value_heads"] == 2
    assert config["router_jitter_noise"] == 0.0 and config["sliding_window"] is None
    assert not config["tie_word_embeddings"] and config["rope_theta"] == 1e4
    hf = MixtralForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                            attn_implementation="eager").eval()
    assert hf.config.rope_parameters["rope_theta"] == 1e4  # not Mixtral's default 1e6
    hf_state = hf.state_dict()  # transformers fused the Hub-style w1/w3/w2 on load
    assert torch.equal(hf_state["model.layers.1.mlp.experts.gate_up_proj"],
                       full["decoder.layers.1.mlp.experts.linear_fc1.weight"])
    assert torch.equal(hf_state["model.layers.0.mlp.experts.down_proj"],
                       full["decoder.layers.0.mlp.experts.linear_fc2.weight"])
    tokens = torch.randint(0, 120, (2, 64), generator=torch.Generator().manual_seed(0))
    hf_logits = _hf_logits(hf, tokens)  # [b, s, 120]
    ours_logits = _logits(_ours(args, full), tokens)  # [b, s, 128]
    assert torch.isinf(ours_logits[..., 120:]).all()
    assert (ours_logits[..., :120] - hf_logits).abs().max() <= 1e-4
    # sharp enough to see another router: the top-k of the softmax over all experts, not
    # renormalised (--moe-router-pre-softmax), or the top-1 expert only
    pre_softmax = _logits(_ours(args, full, moe_router_pre_softmax=True), tokens)[..., :120]
    assert (pre_softmax - hf_logits).abs().max() > 1e-2
    top1 = _logits(_ours(args, full, moe_router_topk=1), tokens)[..., :120]
    assert (top1 - hf_logits).abs().max() > 1e-2
    # back: every tensor bit-exact, the args describe the same model
    back, back_args, meta = hf_convert.import_hf(str(hf_dir))
    expected = real_rows(full, args)
    assert set(back) == set(expected) and meta == {"iteration": 0, "consumed_samples": 0}
    for name, value in expected.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "true_vocab_size",
                "untie_embeddings_and_output_weights", "rotary_base", "norm_epsilon",
                "moe_router_score_function", "moe_router_pre_softmax", *hf_llama.REQUIRED):
        assert back_args[key] == args[key], key
    assert back_args["moe_layer_freq"] == "1" and back_args["kv_channels"] is None
    assert hf_convert.pick_layout(back_args) == "mixtral"


def test_import_a_transformers_mixtral(tmp_path):
    """A MixtralForCausalLM made by transformers (tied embeddings, its default rope base 1e6)
    imports with its logits, from save_pretrained's Hub-style expert names and from the fused
    names of transformers 5's modules alike; the CLI writes it as a checkpoint."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    hf = MixtralForCausalLM(MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=48, rms_norm_eps=1e-6,
        initializer_range=0.2, tie_word_embeddings=True, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # norms away from their ones
                p.add_(0.3 * torch.randn(p.shape))
    hf.save_pretrained(str(tmp_path / "hub"))
    full, args, meta = hf_convert.import_hf(str(tmp_path / "hub"))
    assert meta["iteration"] == 0 and not args["untie_embeddings_and_output_weights"]
    assert "output_layer.weight" not in full and args["rotary_base"] == 1e6
    assert (args["num_experts"], args["moe_router_topk"], args["moe_ffn_hidden_size"]) == (4, 2, 40)
    assert args["num_query_groups"] == 2 and args["true_vocab_size"] == 100
    ours = _ours(args, full)
    tokens = torch.randint(0, 100, (3, 48), generator=torch.Generator().manual_seed(2))
    hf_logits = _hf_logits(hf, tokens)
    assert (_logits(ours, tokens)[..., :100] - hf_logits).abs().max() <= 1e-4
    # the fused names (a state_dict() written as is) give the same tensors
    fused = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    write_folder(str(tmp_path / "fused"), fused,
                 json.loads((tmp_path / "hub" / "config.json").read_text()))
    again, again_args, _ = hf_convert.import_hf(str(tmp_path / "fused"))
    assert again_args == args and set(again) == set(full)
    for name, value in full.items():
        assert torch.equal(again[name], value), name
    # --from-hf writes a one-process checkpoint of the same weights
    convert.main(["--from-hf", str(tmp_path / "hub"), "--save-dir", str(tmp_path / "ck")])
    saved, saved_args, _ = convert.load_full(str(tmp_path / "ck"))
    assert saved_args["num_experts"] == 4 and set(saved) == set(full)
    for name, value in full.items():
        assert torch.equal(saved[name], value), name


def test_mixtral_refusals_name_the_setting(tmp_path):
    out = tmp_path / "out"
    for change, named in [
        ({"moe_shared_expert_intermediate_size": 64}, "drop --moe-shared-expert-intermediate-size"),
        ({"moe_router_score_function": "sigmoid"},
         "moe_router_score_function='sigmoid'.*--moe-router-score-function softmax"),
        ({"moe_router_pre_softmax": True},
         "moe_router_pre_softmax=True.*drop --moe-router-pre-softmax"),
        ({"moe_router_topk_scaling_factor": 2.5}, "=2.5.*drop --moe-router-topk-scaling-factor"),
        ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, "drop --moe-router-num-groups"),
        ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
         "drop --moe-router-enable-expert-bias"),
        ({"moe_layer_freq": 2}, r"layers \[1\] dense.*--moe-layer-freq 1"),
        ({"moe_layer_freq": "([0]*1+[1]*1)"}, r"layers \[0\] dense"),
        ({"disable_bias_linear": False}, "disable_bias_linear=False.*--disable-bias-linear"),
        ({"normalization": "LayerNorm", "swiglu": False},
         "normalization='LayerNorm'.*swiglu=False.*--swiglu"),  # never GPT-2 for an MoE model
        ({"rotary_percent": 0.5}, "rotary_percent=0.5"),
    ]:
        with pytest.raises(ValueError, match="does not map onto MixtralForCausalLM: .*" + named):
            hf_convert.export_hf({}, _args(**change), str(out), tokenizer=False)
    assert not out.exists()
    # one error names every setting; to_hf refuses as pick_layout does
    with pytest.raises(ValueError, match="moe_router_pre_softmax.*topk_scaling_factor"):
        hf_mixtral.to_hf({}, _args(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.0),
                         str(out))
    # an MoE checkpoint never becomes a Llama, even asked directly; the same flags dense do
    with pytest.raises(ValueError, match="num_experts=4.*MixtralForCausalLM"):
        hf_llama.to_hf({}, _args(), str(out))
    assert hf_convert.pick_layout(_args(num_experts=None)) == "llama"
    # import: a sliding window shorter than the positions, router jitter
    base = {"model_type": "mixtral", "max_position_embeddings": 64, "hidden_act": "silu"}
    for change, named in [({"sliding_window": 16}, "sliding_window=16 .*no sliding window"),
                          ({"router_jitter_noise": 0.01}, "router_jitter_noise=0.01.*set it to 0")]:
        (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(ValueError, match=named):
            hf_convert.import_hf(str(tmp_path))
