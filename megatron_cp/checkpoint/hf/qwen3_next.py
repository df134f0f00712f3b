"""Name and layout mapping between megatron_cp's full state dict and Hugging Face Qwen3-Next
(``Qwen3NextForCausalLM``): a hybrid of Gated DeltaNet and gated full-attention layers, MoE
MLPs with a gated shared expert.

megatron_cp runs it with --apply-layernorm-1p (Qwen3-Next's RMSNorms scale by 1 + w, so
those weights map as they are), --qk-layernorm, --attention-output-gate, --rotary-percent
(``partial_rotary_factor``), --experimental-attention-variant gdn and --linear-attention-freq
(the ``layer_types`` as a 0/1 list). What differs in layout:

- attention ``q_proj`` [nh * 2d, h] holds per head [q_h; gate_h]; megatron_cp's linear_qkv
  holds per query group [q heads | gate heads | k | v];
- GDN ``in_proj_qkvz`` (per key head [q | k | v | z]) and ``in_proj_ba`` (per key head
  [b | a]) are megatron_cp's in_proj (per key head [q | k | v | z | b | a]); ``conv1d`` runs
  over [all q | all k | all v] channels, megatron_cp's per key head [q_j | k_j | v_j];
- the gated output norm ``norm`` scales by w (megatron_cp's out_norm is zero-centred: w - 1);
- experts: transformers' fused ``gate_up_proj`` [E, 2F, h] ([gate; up]) and ``down_proj``
  are megatron_cp's experts' fc1 / fc2; the shared expert's gate_proj / up_proj stack into
  its fc1 and ``shared_expert_gate`` [1, h] is its gate_weight (on disk the Hub's
  per-expert ``experts.e.{gate,up,down}_proj``, which save_pretrained writes; either read).

The router is softmax, top-k, renormalised (``norm_topk_prob``), megatron_cp's default.
"""
import torch

from megatron_cp.config.layer_pattern import parse_layer_freq
from megatron_cp.checkpoint.hf.io import (dtype_name, experts_from_hf, experts_to_hf, read_config, read_weights,
                         real_rows, swiglu_from_hf, swiglu_to_hf, write_folder)


def _gdn_dims(a):
    nk, nv = a["linear_num_key_heads"], a["linear_num_value_heads"]
    return nk, nv, a["linear_key_head_dim"], a["linear_value_head_dim"], nv // nk


def _attn_dims(a):
    nh, h = a["num_attention_heads"], a["hidden_size"]
    return nh, a.get("num_query_groups") or nh, a.get("kv_channels") or h // nh, h


def _conv_channels(w, nk, dk, dvr, grouped):
    """conv1d [C, 1, k]: HF's [q all | k all | v all] <-> per key head [q_j | k_j | v_j]
    (``grouped``: the input is HF's; False: the input is megatron_cp's)."""
    if grouped:
        q, k, v = w.split([nk * dk, nk * dk, nk * dvr])
        parts = [t.reshape(nk, -1, *w.shape[1:]) for t in (q, k, v)]
        return torch.cat(parts, dim=1).reshape(w.shape)
    per = w.reshape(nk, 2 * dk + dvr, *w.shape[1:])
    q, k, v = per.split([dk, dk, dvr], dim=1)
    return torch.cat([t.reshape(-1, *w.shape[1:]) for t in (q, k, v)])


def _attention_from_hf(weights, src, nh, ng, d, h):
    hpg = nh // ng
    qg = weights[src + "q_proj.weight"].view(ng, hpg, 2, d, h)  # per head [q; gate]
    k = weights[src + "k_proj.weight"].view(ng, 1, d, h)
    v = weights[src + "v_proj.weight"].view(ng, 1, d, h)
    q, gate = qg[:, :, 0], qg[:, :, 1]  # [ng, hpg, d, h]
    return torch.cat([q, gate, k, v], dim=1).reshape(-1, h)


def _attention_to_hf(qkv, nh, ng, d, h):
    hpg = nh // ng
    per = qkv.view(ng, 2 * hpg + 2, d, h)
    q, gate = per[:, :hpg], per[:, hpg:2 * hpg]
    q_proj = torch.stack([q, gate], dim=2).reshape(nh * 2 * d, h)
    return q_proj, per[:, 2 * hpg].reshape(ng * d, h), per[:, 2 * hpg + 1].reshape(ng * d, h)


def _layer_kinds(c):
    """(is GDN, is MoE) per layer of HF config ``c``."""
    n = c["num_hidden_layers"]
    kinds = c.get("layer_types") or ["full_attention" if (i + 1) % c.get(
        "full_attention_interval", 4) == 0 else "linear_attention" for i in range(n)]
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    moe = [c.get("num_experts", 0) > 0 and i not in dense and (i + 1) % step == 0
           for i in range(n)]
    return [k == "linear_attention" for k in kinds], moe


def from_hf(hf_dir):
    """Read a Qwen3-Next folder into (full state dict, args dict, meta dict)."""
    c = read_config(hf_dir)
    if c.get("hidden_act", "silu") != "silu" or not c.get("norm_topk_prob", True):
        raise ValueError(f"{hf_dir}: hidden_act={c.get('hidden_act')!r}, norm_topk_prob="
                         f"{c.get('norm_topk_prob')!r}: megatron_cp imports SiLU models with "
                         f"renormalised top-k routing")
    weights = read_weights(hf_dir)
    gdn, moe = _layer_kinds(c)
    nh, h = c["num_attention_heads"], c["hidden_size"]
    ng, d = c.get("num_key_value_heads") or nh, c.get("head_dim") or h // nh
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, r = c["linear_key_head_dim"], c["linear_value_head_dim"], nv // nk
    full = {"embedding.word_embeddings.weight": weights["model.embed_tokens.weight"],
            "final_layernorm.weight": weights["model.norm.weight"]}
    if not c.get("tie_word_embeddings", False):
        full["output_layer.weight"] = weights["lm_head.weight"]
    for i in range(c["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        full[dst + "input_layernorm.weight"] = weights[src + "input_layernorm.weight"]
        full[dst + "pre_mlp_layernorm.weight"] = weights[src + "post_attention_layernorm.weight"]
        if gdn[i]:
            s, t = src + "linear_attn.", dst + "self_attention."
            qkvz = weights[s + "in_proj_qkvz.weight"].view(nk, -1, h)
            ba = weights[s + "in_proj_ba.weight"].view(nk, -1, h)
            full[t + "in_proj.weight"] = torch.cat([qkvz, ba], dim=1).reshape(-1, h)
            full[t + "conv1d.weight"] = _conv_channels(weights[s + "conv1d.weight"], nk, dk,
                                                       r * dv, grouped=True)
            full[t + "A_log"], full[t + "dt_bias"] = weights[s + "A_log"], weights[s + "dt_bias"]
            full[t + "out_norm.weight"] = weights[s + "norm.weight"] - 1
            full[t + "out_proj.weight"] = weights[s + "out_proj.weight"]
        else:
            s, t = src + "self_attn.", dst + "self_attention."
            full[t + "linear_qkv.weight"] = _attention_from_hf(weights, s, nh, ng, d, h)
            full[t + "linear_proj.weight"] = weights[s + "o_proj.weight"]
            full[t + "q_layernorm.weight"] = weights[s + "q_norm.weight"]
            full[t + "k_layernorm.weight"] = weights[s + "k_norm.weight"]
        s, t = src + "mlp.", dst + "mlp."
        if moe[i]:
            full[t + "router.weight"] = weights[s + "gate.weight"]
            fc1, fc2 = experts_from_hf(weights, s, c["num_experts"])
            full[t + "experts.linear_fc1.weight"], full[t + "experts.linear_fc2.weight"] = fc1, fc2
            s, t = s + "shared_expert.", t + "shared_experts."
            full[t + "gate_weight"] = weights[src + "mlp.shared_expert_gate.weight"]
        full[t + "linear_fc1.weight"], full[t + "linear_fc2.weight"] = swiglu_from_hf(weights, s)
    rope = c.get("rope_parameters") or {}
    args = {"num_layers": c["num_hidden_layers"], "hidden_size": h, "num_attention_heads": nh,
            "num_query_groups": ng, "group_query_attention": ng != nh,
            "kv_channels": d if d != h // nh else None,
            "seq_length": c["max_position_embeddings"],
            "max_position_embeddings": c["max_position_embeddings"],
            "ffn_hidden_size": c["intermediate_size"], "norm_epsilon": c.get("rms_norm_eps", 1e-6),
            "rotary_base": c.get("rope_theta") or rope.get("rope_theta", 1e4),
            "rotary_percent": c.get("partial_rotary_factor") or rope.get(
                "partial_rotary_factor", 1.0),
            "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
            "normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
            "position_embedding_type": "rope", "apply_layernorm_1p": True, "qk_layernorm": True,
            "attention_output_gate": True, "experimental_attention_variant": "gdn",
            "linear_attention_freq": str([int(x) for x in gdn]),
            "linear_conv_kernel_dim": c["linear_conv_kernel_dim"], "linear_key_head_dim": dk,
            "linear_value_head_dim": dv, "linear_num_key_heads": nk,
            "linear_num_value_heads": nv, "true_vocab_size": c["vocab_size"],
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    if any(moe):
        args.update(num_experts=c["num_experts"], moe_router_topk=c["num_experts_per_tok"],
                    moe_ffn_hidden_size=c["moe_intermediate_size"],
                    moe_layer_freq=str([int(x) for x in moe]),
                    moe_shared_expert_intermediate_size=c["shared_expert_intermediate_size"],
                    moe_shared_expert_gate=True, moe_router_score_function="softmax",
                    moe_router_pre_softmax=False)
    return full, args, {"iteration": 0, "consumed_samples": 0}


# The settings every Qwen3NextForCausalLM has (its norms store w of 1 + w: zero-centred)
REQUIRED = {"normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
            "apply_layernorm_1p": True, "qk_layernorm": True, "attention_output_gate": True,
            "experimental_attention_variant": "gdn", "position_embedding_type": "rope"}


def to_hf(full, args, out_dir, token_ids=None):
    """Write ``config.json`` + ``model.safetensors`` loadable by Qwen3NextForCausalLM."""
    wrong = [f"{k}={args.get(k)!r} (needs {v!r})" for k, v in REQUIRED.items() if args.get(k) != v]
    if args.get("num_experts") and not (args.get("moe_shared_expert_intermediate_size")
                                        and args.get("moe_shared_expert_gate")):
        wrong.append("every Qwen3-Next MoE block has a gated shared expert (needs "
                     "--moe-shared-expert-intermediate-size and --moe-shared-expert-gate)")
    if wrong:
        raise ValueError("the checkpoint does not map onto Qwen3NextForCausalLM: " + "; ".join(wrong))
    full = real_rows(full, args)
    n = args["num_layers"]
    gdn = parse_layer_freq(args["linear_attention_freq"], n, "linear_attention_freq",
                           every_kth=lambda k, i: 0 if (i + 1) % k == 0 else 1)
    experts = args.get("num_experts") or 0
    moe = parse_layer_freq(args.get("moe_layer_freq") or 1, n) if experts else [0] * n
    nh, ng, d, h = _attn_dims(args)
    nk, nv, dk, dv, r = _gdn_dims(args)
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"],
           "model.norm.weight": full["final_layernorm.weight"]}
    if args["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = full["output_layer.weight"]
    for i in range(n):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = full[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = full[src + "pre_mlp_layernorm.weight"]
        s = src + "self_attention."
        if gdn[i]:
            t = dst + "linear_attn."
            per = full[s + "in_proj.weight"].view(nk, -1, h)
            qkvz, ba = per.split([2 * dk + 2 * r * dv, 2 * r], dim=1)
            out[t + "in_proj_qkvz.weight"] = qkvz.reshape(-1, h)
            out[t + "in_proj_ba.weight"] = ba.reshape(-1, h)
            out[t + "conv1d.weight"] = _conv_channels(full[s + "conv1d.weight"], nk, dk, r * dv,
                                                      grouped=False)
            out[t + "A_log"], out[t + "dt_bias"] = full[s + "A_log"], full[s + "dt_bias"]
            out[t + "norm.weight"] = full[s + "out_norm.weight"] + 1
            out[t + "out_proj.weight"] = full[s + "out_proj.weight"]
        else:
            t = dst + "self_attn."
            q, k, v = _attention_to_hf(full[s + "linear_qkv.weight"], nh, ng, d, h)
            out[t + "q_proj.weight"], out[t + "k_proj.weight"], out[t + "v_proj.weight"] = q, k, v
            out[t + "o_proj.weight"] = full[s + "linear_proj.weight"]
            out[t + "q_norm.weight"] = full[s + "q_layernorm.weight"]
            out[t + "k_norm.weight"] = full[s + "k_layernorm.weight"]
        s, t = src + "mlp.", dst + "mlp."
        if moe[i]:
            out[t + "gate.weight"] = full[s + "router.weight"]
            experts_to_hf(out, t, full[s + "experts.linear_fc1.weight"],
                          full[s + "experts.linear_fc2.weight"])
            out[t + "shared_expert_gate.weight"] = full[s + "shared_experts.gate_weight"]
            s, t = s + "shared_experts.", t + "shared_expert."
        swiglu_to_hf(out, t, full[s + "linear_fc1.weight"], full[s + "linear_fc2.weight"])
    embed = out["model.embed_tokens.weight"]
    config = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": embed.shape[0], "hidden_size": h, "num_hidden_layers": n,
        "num_attention_heads": nh, "num_key_value_heads": ng, "head_dim": d,
        "intermediate_size": args["ffn_hidden_size"],
        "max_position_embeddings": args["max_position_embeddings"],
        "rms_norm_eps": args.get("norm_epsilon", 1e-5),
        "rope_parameters": {"rope_type": "default", "rope_theta": args.get("rotary_base", 1e4),
                            "partial_rotary_factor": args.get("rotary_percent", 1.0)},
        "partial_rotary_factor": args.get("rotary_percent", 1.0),
        "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
        "hidden_act": "silu", "attention_bias": False, "torch_dtype": dtype_name(embed),
        "layer_types": ["linear_attention" if x else "full_attention" for x in gdn],
        "linear_conv_kernel_dim": args["linear_conv_kernel_dim"], "linear_key_head_dim": dk,
        "linear_value_head_dim": dv, "linear_num_key_heads": nk, "linear_num_value_heads": nv,
        "num_experts": experts, "num_experts_per_tok": args.get("moe_router_topk", 1),
        "moe_intermediate_size": args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"],
        "shared_expert_intermediate_size": args.get("moe_shared_expert_intermediate_size") or 0,
        "decoder_sparse_step": 1, "norm_topk_prob": True,
        "mlp_only_layers": [i for i in range(n) if not moe[i]],
        "bos_token_id": None, "eos_token_id": None, **(token_ids or {})}
    write_folder(out_dir, out, config)
