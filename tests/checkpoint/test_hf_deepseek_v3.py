"""Hugging Face DeepSeek-V3 (multi-latent attention with q-LoRA and YaRN, a dense layer then an
MoE layer with a grouped sigmoid router, a random expert bias and a shared expert): a
transformers-made model imports with transformers' logits at TP=1 and TP=2, generates its
greedy tokens through the latent KV cache, and exports back tensor-equal (MTP depths under
DeepSeek's names included); a checkpoint trained here (MLA, the DeepSeek router, MTP) exports
to a DeepseekV3 with our logits; what DeepseekV3 cannot express is refused by name."""
import json

import pytest
import torch

from dist_harness import run_workers
from inference_utils import imported_checkpoint
from megatron_cp.checkpoint.hf import convert as hf_convert
from megatron_cp.checkpoint.hf.io import read_weights, write_folder
from test_gdn_generation import _args, _rounding_scale
from tools import checkpoint_convert as convert

VOCAB = 120  # test_gdn_generation's: NullTokenizer --vocab-size VOCAB - 1
NEW_TOKENS = 8
HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=64,
    rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0})


def deepseek_hf_model(folder, **changes):
    """A tiny DeepseekV3ForCausalLM (fp32, eager attention) with its norms moved off one and
    a random expert bias, saved to ``folder``; returns it in eval mode."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(0)
    config = DeepseekV3Config(**{**HF_CONFIG, **changes}, attn_implementation="eager")
    hf = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape))
        for layer in hf.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    hf.save_pretrained(str(folder))
    return hf


def _mtp_tensors(weights, num_layers, seed=1):
    """DeepSeek's names and shapes of one MTP depth (``model.layers.{L}``: its norms,
    eh_proj, an MoE decoder layer like the last one, the copies of the embedding and head)."""
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    out = {mtp + name[len(last):]: t + 0.1 * torch.randn(t.shape, generator=g)
           for name, t in weights.items() if name.startswith(last)}
    h = weights["model.norm.weight"].shape[0]
    out.update({mtp + "enorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                mtp + "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                mtp + "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=g),
                mtp + "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g),
                mtp + "embed_tokens.weight": weights["model.embed_tokens.weight"],
                mtp + "shared_head.head.weight": weights["lm_head.weight"]})
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers model, its folder, our torch_dist checkpoint of it)."""
    return imported_checkpoint(tmp_path_factory.mktemp("deepseek_v3"), deepseek_hf_model)


def _logits_and_generation(rank, world, load, tokens, prompt):
    """Worker: full-vocabulary logits [b, s, v] of ``tokens``; greedy generation from
    ``prompt`` with the latent cache and without; the rounding spread of the logits."""
    from megatron_cp.inference.generation import generate
    from megatron_cp.inference.logits import full_vocab_logits
    from megatron_cp.inference.launch import load_model
    from megatron_cp.inference.sampling import SamplingParams
    from training_utils import parallel_state
    from tools.run_text_generation import check_generation_args, get_generation_args
    args = _args(load, world, "--prompt x", get_generation_args, check_generation_args)
    model = load_model(args, parallel_state(args))
    chunk = model.model_chunks[0]
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad():
        local = chunk(tokens, positions)  # [s, b, v/tp]
        logits = full_vocab_logits(local, VOCAB, model.state.group("tp")).transpose(0, 1)
    runs = [generate(model, prompt, NEW_TOKENS, SamplingParams(greedy=True), use_cache=cache,
                     return_logits=True) for cache in (True, False)]
    return (logits, [(run.tokens, torch.stack(run.logits)) for run in runs],
            _rounding_scale(chunk, tokens, positions, local))


@pytest.mark.parametrize("world", [1, 2])
def test_import_logits_and_greedy_generation_match_transformers(imported, world):
    """Logits within 1e-4 of transformers' (fp32; the tiny model is moved far from init);
    greedy tokens with the latent cache equal those without it and transformers' generate."""
    hf, _, load = imported
    g = torch.Generator().manual_seed(2)
    tokens, prompt = torch.randint(0, VOCAB, (2, 48), generator=g), torch.randint(0, VOCAB, (2, 5),
                                                                                  generator=g)
    logits, ((cached, cached_logits), (full, full_logits)), scale = run_workers(
        _logits_and_generation, world, load, tokens, prompt)[0]
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits  # [b, s, v]
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert (logits - expected).abs().max() <= 1e-4
    assert torch.equal(cached, full) and torch.equal(cached, theirs)
    assert 0 < scale < 1e-2, scale
    torch.testing.assert_close(cached_logits, full_logits, rtol=0, atol=scale)


def test_import_is_not_blind_and_exports_back_tensor_equal(imported, tmp_path):
    """Dropping the expert bias, the group limit, the scaling factor or YaRN's softmax
    correction moves the logits far beyond the 1e-4 above; the import exports back to the
    same tensors and config."""
    hf, folder, _ = imported
    full, args, _ = hf_convert.import_hf(str(folder))
    assert args["moe_layer_freq"] == "[0, 1]" and args["mtp_num_layers"] is None
    assert (args["moe_router_num_groups"], args["moe_router_group_topk"]) == (4, 2)
    assert args["rope_type"] == "yarn" and args["rotary_scaling_factor"] == 40.0
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits

    def max_diff(state, **changes):
        return (_our_logits(state, {**args, **changes}, tokens) - expected).abs().max().item()

    assert max_diff(full) <= 1e-4
    unbiased = dict(full, **{"decoder.layers.1.mlp.router.expert_bias": torch.zeros(8)})
    for state, changes in [(unbiased, {}), (full, {"moe_router_num_groups": None,
                                                    "moe_router_group_topk": None}),
                           (full, {"moe_router_topk_scaling_factor": None}),
                           (full, {"mscale_all_dim": 0.0})]:  # YaRN's softmax correction
        assert max_diff(state, **changes) > 1e-2, changes
    assert hf_convert.export_hf(full, args, str(tmp_path / "out"), tokenizer=False) == \
        "DeepseekV3ForCausalLM"
    original, back = read_weights(str(folder)), read_weights(str(tmp_path / "out"))
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    before = json.loads((folder / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor",
                "q_lora_rank", "kv_lora_rank", "rope_interleave", "n_shared_experts"):
        assert after[key] == before[key], key
    assert after["rope_parameters"] == {**before["rope_parameters"], "truncate": True}


def _our_logits(full, args, tokens):
    """[b, s, true vocab] logits of a one-process fp32 megatron_cp model of ``args`` holding
    ``full`` (every other argument at the command line's default)."""
    import argparse

    from megatron_cp.model import GPTModel
    from megatron_cp.startup import config_from_args
    vocab = args["true_vocab_size"]
    namespace = argparse.Namespace(**{**_defaults(), **args, "params_dtype": torch.float32})
    model = GPTModel(config_from_args(namespace, vocab)).eval()
    model.load_state_dict(convert.pad_vocab_rows(full, args, 1))
    b, s = tokens.shape
    with torch.no_grad():
        return model(tokens, torch.arange(s).expand(b, s)).transpose(0, 1)[..., :vocab]


def _defaults():
    """Every argument's default (the command line's), for a model built from an args dict."""
    from megatron_cp.cli.arguments import parse_args
    from training_utils import TINY
    return vars(parse_args(f"{TINY} --train-iters 10".split()))


def test_mtp_depths_import_and_export_under_deepseek_names(imported, tmp_path):
    """A folder with DeepSeek's MTP depth at model.layers.{L}.*: imported as --mtp-num-layers 1
    (the embedding and head copies are the model's own), exported back tensor-equal."""
    _, folder, _ = imported
    weights = read_weights(str(folder))
    config = json.loads((folder / "config.json").read_text())
    mtp = _mtp_tensors(weights, 2)
    write_folder(str(tmp_path / "hf"), {**weights, **mtp}, {**config, "num_nextn_predict_layers": 1})
    full, args, _ = hf_convert.import_hf(str(tmp_path / "hf"))
    assert args["mtp_num_layers"] == 1
    assert torch.equal(full["mtp.layers.0.eh_proj.weight"], mtp["model.layers.2.eh_proj.weight"])
    assert torch.equal(full["mtp.layers.0.final_layernorm.weight"],
                       mtp["model.layers.2.shared_head.norm.weight"])
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    _our_logits(full, args, tokens)  # an MTP model of these args loads every tensor (strict)
    hf_convert.export_hf(full, args, str(tmp_path / "out"), tokenizer=False)
    back = read_weights(str(tmp_path / "out"))
    assert back.keys() == {**weights, **mtp}.keys()
    for name, tensor in {**weights, **mtp}.items():
        assert torch.equal(back[name], tensor), name
    # a depth whose embedding copy is not the model's is refused
    mtp["model.layers.2.embed_tokens.weight"] = mtp["model.layers.2.embed_tokens.weight"] + 1
    write_folder(str(tmp_path / "bad"), {**weights, **mtp}, config)
    with pytest.raises(ValueError, match="embed_tokens.weight differs from model.embed_tokens"):
        hf_convert.import_hf(str(tmp_path / "bad"))


def test_released_config_form_imports_the_same(imported, tmp_path):
    """DeepSeek's released config.json (transformers 4's form: ``rope_scaling`` with ``type``,
    ``rope_theta`` at the top) gives the same arguments as transformers 5's
    ``rope_parameters``."""
    _, folder, _ = imported
    config = json.loads((folder / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    theta, rope["type"] = rope.pop("rope_theta"), rope.pop("rope_type")
    write_folder(str(tmp_path / "released"), read_weights(str(folder)),
                 {**config, "rope_scaling": rope, "rope_theta": theta})
    assert hf_convert.import_hf(str(tmp_path / "released"))[1] == \
        hf_convert.import_hf(str(folder))[1]


def test_rope_interleave_false_is_permuted_on_import(tmp_path):
    """A DeepseekV3 pairing rope channels (i, i + d/2) imports with its logits: the rope rows
    are permuted into megatron_cp's interleaved pairs."""
    hf = deepseek_hf_model(tmp_path / "hf", rope_interleave=False)
    full, args, _ = hf_convert.import_hf(str(tmp_path / "hf"))
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    assert (_our_logits(full, args, tokens) - expected).abs().max() <= 1e-4
    # the control: the same folder read as interleaved (no permutation) is another model
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    write_folder(str(tmp_path / "as_is"), read_weights(str(tmp_path / "hf")),
                 {**config, "rope_interleave": True})
    unpermuted, _, _ = hf_convert.import_hf(str(tmp_path / "as_is"))
    assert (_our_logits(unpermuted, args, tokens) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("change,named", [
    ({"q_lora_rank": None}, "q_lora_rank=None .*--q-lora-rank"),
    ({"norm_epsilon": 1e-5}, "norm_epsilon=1e-05 .*--norm-epsilon 1e-6"),
    ({"moe_router_score_function": "softmax"}, "--moe-router-score-function sigmoid"),
    ({"moe_router_topk": 2}, "moe_router_topk=2 with moe_router_group_topk=2 .*top 2"),
    ({"moe_shared_expert_intermediate_size": None}, "ungated shared expert"),
    ({"moe_layer_freq": "[1, 0]"}, r"moe_layer_freq='\[1, 0\]' .*dense layers first"),
    ({"qk_layernorm": False}, "qk_layernorm=False"),
])
def test_export_refusals_name_the_setting(imported, tmp_path, change, named):
    _, folder, _ = imported
    full, args, _ = hf_convert.import_hf(str(folder))
    with pytest.raises(ValueError, match="does not map onto DeepseekV3ForCausalLM: .*" + named):
        hf_convert.export_hf(full, {**args, **change}, str(tmp_path / "out"), tokenizer=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change,named", [
    ({"q_lora_rank": None}, "q_lora_rank=None"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ({"topk_group": 1}, "num_experts_per_tok=4, topk_group=1"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
])
def test_import_refusals_name_the_setting(tmp_path, change, named):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", **HF_CONFIG,
                                                      **change}))
    with pytest.raises(ValueError, match="maps onto no megatron_cp model: .*" + named):
        hf_convert.import_hf(str(tmp_path))


def test_our_trained_checkpoint_exports_to_transformers_with_equal_logits(tmp_path):
    """A few steps of pretraining (MLA with q-LoRA and YaRN, a dense layer then MoE layers
    with the grouped sigmoid router, expert bias, scaling factor and a shared expert: test_mla's
    DeepSeek flags; one MTP depth) at TP2 + SP, exported by the CLI: DeepseekV3ForCausalLM
    loads it (nothing missing; unexpected only the MTP depth at model.layers.4, which it
    ignores) and gives our logits; the import gives every tensor back, MTP included."""
    from test_mla import DEEPSEEK
    from training_utils import train_losses
    from transformers import DeepseekV3ForCausalLM
    ck, out = tmp_path / "ck", tmp_path / "hf"
    run_workers(train_losses, 2, f"{DEEPSEEK} --train-iters 3 --tensor-model-parallel-size 2 "
                f"--sequence-parallel --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 "
                f"--save {ck} --ckpt-format torch")
    convert.main(["--load-dir", str(ck), "--to-hf", str(out), "--hf-skip-tokenizer"])
    full, args, _ = convert.load_full(str(ck))
    assert any(full[f"decoder.layers.{i}.mlp.router.expert_bias"].abs().max() > 0
               for i in (1, 2, 3))  # the balancing moved it
    hf, info = DeepseekV3ForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                     attn_implementation="eager",
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(k.startswith("model.layers.4.")
                                           for k in info["unexpected_keys"]), info
    tokens = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf.eval()(input_ids=tokens).logits
    assert (_our_logits(full, args, tokens) - expected).abs().max() <= 1e-4
    back, back_args, _ = hf_convert.import_hf(str(out))
    assert back_args["mtp_num_layers"] == 1 and set(back) == set(full)
    for name, tensor in full.items():
        assert torch.equal(back[name], tensor), name
