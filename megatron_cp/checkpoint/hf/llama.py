"""Name and layout mapping between megatron_cp's full state dict and Hugging Face Llama.

megatron_cp fuses QKV per query group ([q heads of the group | k | v] rows) and stacks
SwiGLU's [gate; up] in fc1; Llama keeps q/k/v and gate/up separate. Both use the
half-split rotary convention, so no permutation of head dims is needed. Llama 3.1's RoPE
scaling (``--use-rope-scaling``, ``--rope-scaling-factor``) is config.json's ``rope_scaling``
of rope type "llama3", with Megatron-LM's fixed constants (low / high frequency factors 1 and 4,
8192 original positions); a folder with other constants is refused.

Everything but the MLPs (embedding, norms, attention, output layer, most of config.json) is
shared with Mixtral (mixtral.py): ``shared_to_hf`` / ``shared_config`` on export,
``check_config`` / ``shared_from_hf`` / ``shared_args`` on import.
"""
import torch

from megatron_cp.checkpoint.hf.io import (dtype_name, read_config, read_weights, real_rows,
                                          require, rope_entries, write_folder)
from megatron_cp.layers.rotary import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                       LLAMA3_ORIGINAL_MAX_POSITIONS)

REQUIRED = {"normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
            "position_embedding_type": "rope"}


def _dims(args):
    nh, h = args["num_attention_heads"], args["hidden_size"]
    ng = args.get("num_query_groups") or nh
    d = args.get("kv_channels") or h // nh
    return nh, ng, d, h


def check_export(args, layout):
    """Raise ValueError for a setting of ``args`` the Llama-style ``layout`` cannot express."""
    require(args, REQUIRED, layout)
    if args.get("rotary_percent", 1.0) != 1.0:
        raise ValueError(f"rotary_percent ({args['rotary_percent']}) must be 1.0: {layout} "
                         f"rotates every head dim")
    if args.get("rotary_seq_len_interpolation_factor") is not None:
        raise ValueError(f"rotary_seq_len_interpolation_factor "
                         f"({args['rotary_seq_len_interpolation_factor']}): the {layout} export "
                         f"writes plain or Llama 3.1 RoPE only")


# Llama 3.1's rope_scaling entries other than the factor: Megatron-LM's fixed constants
LLAMA3_CONSTANTS = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                    "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                    "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS}


def _rope_scaling(args):
    """config.json's ``rope_scaling`` of --use-rope-scaling ({} without it)."""
    if not args.get("use_rope_scaling"):
        return {}
    return {"rope_scaling": {"rope_type": "llama3", "factor": args.get("rope_scaling_factor", 8.0),
                             **LLAMA3_CONSTANTS}}


def shared_to_hf(full, args):
    """{HF name: tensor} of everything but the MLPs: embedding, final norm, output layer (when
    untied), and per layer the attention and both norms. ``full`` has the real vocab rows."""
    nh, ng, d, h = _dims(args)
    hpg = nh // ng
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"],
           "model.norm.weight": full["final_layernorm.weight"]}
    if args["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = full["output_layer.weight"]
    for i in range(args["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = full[src + "self_attention.linear_qkv.weight"].view(ng, hpg + 2, d, h)
        out[dst + "self_attn.q_proj.weight"] = qkv[:, :hpg].reshape(nh * d, h)
        out[dst + "self_attn.k_proj.weight"] = qkv[:, hpg].reshape(ng * d, h)
        out[dst + "self_attn.v_proj.weight"] = qkv[:, hpg + 1].reshape(ng * d, h)
        out[dst + "self_attn.o_proj.weight"] = full[src + "self_attention.linear_proj.weight"]
        out[dst + "input_layernorm.weight"] = full[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = full[src + "pre_mlp_layernorm.weight"]
    return out


def shared_config(args, embed, token_ids=None):
    """The config.json entries Llama and Mixtral share (``embed``: the exported embedding)."""
    nh, ng, d, h = _dims(args)
    return {"vocab_size": embed.shape[0], "hidden_size": h, "num_hidden_layers": args["num_layers"],
            "num_attention_heads": nh, "num_key_value_heads": ng, "head_dim": d,
            "max_position_embeddings": args["max_position_embeddings"],
            "rms_norm_eps": args.get("norm_epsilon", 1e-5),
            "rope_theta": args.get("rotary_base", 1e4),
            "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
            "hidden_act": "silu", "torch_dtype": dtype_name(embed), "bos_token_id": None,
            "eos_token_id": None, **_rope_scaling(args), **(token_ids or {})}


def to_hf(full, args, out_dir, token_ids=None):
    """Write ``config.json`` + ``model.safetensors`` loadable by LlamaForCausalLM.

    ``token_ids``: ``bos_token_id`` / ``eos_token_id`` for the config, from the tokenizer."""
    if args.get("num_experts"):
        raise ValueError(f"the checkpoint has MoE layers (num_experts={args['num_experts']}): "
                         f"LlamaForCausalLM has dense MLPs only; export it as MixtralForCausalLM "
                         f"(mixtral.py)")
    check_export(args, "LlamaForCausalLM")
    full = real_rows(full, args)
    out = shared_to_hf(full, args)
    for i in range(args["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        gate, up = full[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
        out[dst + "mlp.down_proj.weight"] = full[src + "mlp.linear_fc2.weight"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "intermediate_size": args["ffn_hidden_size"], "attention_bias": False,
              "mlp_bias": False, **shared_config(args, out["model.embed_tokens.weight"], token_ids)}
    write_folder(out_dir, out, config)


def check_config(c, hf_dir):
    """Raise ValueError for a Llama-style config.json setting megatron_cp cannot run."""
    for key, value in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if c.get(key, value) != value:
            raise ValueError(f"{hf_dir}: {key}={c[key]!r} has no megatron_cp equivalent "
                             f"(needs {value!r})")
    rope_type, rope = rope_entries(c)
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{hf_dir}: rope type {rope_type!r} ({rope}) is not imported: the "
                         f"import reads plain RoPE and Llama 3.1's (llama3) only")
    if rope_type == "llama3":
        wrong = [f"{key}={rope.get(key)!r} (needs {value!r})"
                 for key, value in LLAMA3_CONSTANTS.items() if rope.get(key) != value]
        if wrong:
            raise ValueError(f"{hf_dir}: llama3 rope scaling with {', '.join(wrong)}: "
                             f"Megatron-LM's --use-rope-scaling fixes these")


def _rope_theta(c, default=1e4):
    return c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", default)


def _hf_dims(c):
    nh, h = c["num_attention_heads"], c["hidden_size"]
    ng = c.get("num_key_value_heads") or nh
    return nh, ng, c.get("head_dim") or h // nh, h


def shared_from_hf(c, weights):
    """The full state dict entries of everything but the MLPs, from ``config.json`` ``c`` and
    the folder's ``weights``."""
    nh, ng, d, h = _hf_dims(c)
    full = {"embedding.word_embeddings.weight": weights["model.embed_tokens.weight"],
            "final_layernorm.weight": weights["model.norm.weight"]}
    if not c.get("tie_word_embeddings", False):
        full["output_layer.weight"] = weights["lm_head.weight"]
    hpg = nh // ng
    for i in range(c["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = weights[src + "self_attn.q_proj.weight"].view(ng, hpg, d, h)
        k = weights[src + "self_attn.k_proj.weight"].view(ng, 1, d, h)
        v = weights[src + "self_attn.v_proj.weight"].view(ng, 1, d, h)
        full[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        full[dst + "self_attention.linear_proj.weight"] = weights[src + "self_attn.o_proj.weight"]
        full[dst + "input_layernorm.weight"] = weights[src + "input_layernorm.weight"]
        full[dst + "pre_mlp_layernorm.weight"] = weights[src + "post_attention_layernorm.weight"]
    return full


def _rope_scaling_args(c):
    """--use-rope-scaling and --rope-scaling-factor of config.json ``c`` ({} for plain RoPE)."""
    rope_type, rope = rope_entries(c)
    if rope_type != "llama3":
        return {}
    return {"use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}


def shared_args(c, default_rope_theta=1e4):
    """The args dict entries of everything but the MLPs, from ``config.json`` ``c``
    (``default_rope_theta``: the model class's own default when the config names none)."""
    nh, ng, d, h = _hf_dims(c)
    # --group-query-attention gates --num-query-groups (without it: one group per head), and
    # the model's context is the sequence length --use-checkpoint-args gives a run
    return {"num_layers": c["num_hidden_layers"], "hidden_size": h, "num_attention_heads": nh,
            "num_query_groups": ng, "group_query_attention": ng != nh,
            "seq_length": c["max_position_embeddings"], "kv_channels": d if d != h // nh else None,
            "max_position_embeddings": c["max_position_embeddings"],
            "norm_epsilon": c.get("rms_norm_eps", 1e-5),
            "rotary_base": _rope_theta(c, default_rope_theta), **_rope_scaling_args(c),
            "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
            **REQUIRED, "true_vocab_size": c["vocab_size"],
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}


def from_hf(hf_dir):
    """Read a Llama folder into (full state dict, args dict, meta dict) for save_layout."""
    c = read_config(hf_dir)
    check_config(c, hf_dir)
    weights = read_weights(hf_dir)
    full = shared_from_hf(c, weights)
    for i in range(c["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        full[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [weights[src + "mlp.gate_proj.weight"], weights[src + "mlp.up_proj.weight"]], dim=0)
        full[dst + "mlp.linear_fc2.weight"] = weights[src + "mlp.down_proj.weight"]
    args = {**shared_args(c), "ffn_hidden_size": c["intermediate_size"]}
    return full, args, {"iteration": 0, "consumed_samples": 0}
