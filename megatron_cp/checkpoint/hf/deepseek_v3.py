"""Name and layout mapping between megatron_cp's full state dict and Hugging Face DeepSeek-V3
(``DeepseekV3ForCausalLM``): multi-latent attention, dense then MoE layers with a grouped
sigmoid router, an expert bias and shared experts, and multi-token prediction.

megatron_cp runs it with --multi-latent-attention (--q-lora-rank, --kv-lora-rank,
--qk-head-dim = ``qk_nope_head_dim``, --qk-pos-emb-head-dim = ``qk_rope_head_dim``,
--v-head-dim), --qk-layernorm (the latent norms), --rope-type yarn (``rope_parameters``:
--rotary-scaling-factor = ``factor``, --mscale, --mscale-all-dim), --moe-layer-freq
``[0]*first_k_dense_replace + [1]*rest``, --moe-router-score-function sigmoid with
--moe-router-enable-expert-bias (``e_score_correction_bias``), --moe-router-num-groups
(``n_group``) / --moe-router-group-topk (``topk_group``), --moe-router-topk-scaling-factor
(``routed_scaling_factor``), --moe-shared-expert-intermediate-size (``n_shared_experts`` x
``moe_intermediate_size``) and --mtp-num-layers (``num_nextn_predict_layers``).

The attention weights are a rename: both lay q_b_proj out per head as [nope | rope], kv_b_proj
per head as [k_nope | v] and kv_a_proj_with_mqa as [latent | shared rope key]. Both turn the
rope channels in interleaved pairs (2i, 2i + 1) (``rope_interleave`` True: transformers takes
the even and the odd channels apart before turning them, the same permutation of q and k,
so every score is the same). A folder with ``rope_interleave`` False pairs (i, i + d/2): its
rope rows are permuted on import into the pairs megatron_cp turns; the export always writes
the interleaved layout DeepSeek released.

Routing. transformers scores each group of experts by the sum of its top 2 scores,
Megatron-LM (and megatron_cp) by the sum of its top topk / group_topk: the same when
topk / group_topk is 2 (DeepSeek-V3: 8 / 4). megatron_cp normalises the top-k sigmoid scores
whenever k > 1, which is ``norm_topk_prob`` True. transformers computes the router in fp32
(the import sets --moe-router-dtype fp32).

Multi-token prediction. DeepSeek's checkpoints hold depth k at ``model.layers.{L + k}``
(L = num_hidden_layers): ``enorm``, ``hnorm``, ``eh_proj`` (over [enorm(embedding);
hnorm(hidden)], megatron_cp's order), one decoder layer, ``shared_head.norm`` (the depth's
final norm) and copies of the embedding and output layer (``embed_tokens``,
``shared_head.head``; megatron_cp's depths share the model's). transformers' model ignores
these weights; the export writes them and the import reads them.

Fixed in transformers and therefore required: the latent norms' epsilon 1e-6
(--norm-epsilon 1e-6), q-LoRA (without it transformers has no query norm, megatron_cp's
--qk-layernorm normalises the hidden states entering linear_q_proj), SiLU, no biases.
"""
import torch

from megatron_cp.config.layer_pattern import parse_layer_freq
from megatron_cp.layers.rotary import yarn_concentration_factor, yarn_mscale
from megatron_cp.checkpoint.hf.io import (dtype_name, experts_from_hf, experts_to_hf, read_config, read_weights,
                         real_rows, require, rope_entries, swiglu_from_hf, swiglu_to_hf, write_folder)

# megatron_cp's name in a layer: DeepseekV3's (a rename, the same layout)
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight"}
ROUTER_NAMES = {"mlp.router.weight": "mlp.gate.weight",
                "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"}
# an MTP depth's own weights: megatron_cp's name under mtp.layers.<k>: DeepSeek's
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}
MTP_LAYER = "mtp_model_layer."  # the depth's transformer layer, under mtp.layers.<k>
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm take no config epsilon
YARN_DEFAULTS = {"original_max_position_embeddings": ("yarn_original_max_position_embeddings", 4096),
                 "beta_fast": ("yarn_beta_fast", 32.0), "beta_slow": ("yarn_beta_slow", 1.0),
                 "truncate": ("yarn_correction_range_round_to_int", True)}
# DeepseekV3Config's defaults, for a config.json that leaves a key out
HF_DEFAULTS = {"n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "norm_topk_prob": True,
               "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "n_shared_experts": 1,
               "rope_interleave": True, "rms_norm_eps": 1e-6, "hidden_act": "silu",
               "attention_bias": False, "tie_word_embeddings": False, "q_lora_rank": 1536}
REQUIRED = {"multi_latent_attention": True, "qk_layernorm": True, "normalization": "RMSNorm",
            "swiglu": True, "disable_bias_linear": True, "position_embedding_type": "rope"}


def _moe_pattern(args):
    """0/1 per decoder layer: which layers are MoE."""
    if not args.get("num_experts"):
        return [0] * args["num_layers"]
    return parse_layer_freq(args.get("moe_layer_freq") or 1, args["num_layers"])


def _shared_experts(args):
    """n_shared_experts: the shared expert's hidden size in routed experts' sizes."""
    shared, ffn = args.get("moe_shared_expert_intermediate_size"), args.get("moe_ffn_hidden_size")
    return shared // ffn if shared and ffn and shared % ffn == 0 else None


def check_args(args):
    """Raise one ValueError naming every setting of ``args`` DeepseekV3ForCausalLM cannot
    express, each with the flag that fixes it."""
    try:
        require(args, REQUIRED, "DeepseekV3ForCausalLM")
        wrong = []
    except ValueError as e:
        wrong = [str(e).split(": ", 1)[1]]
    if args.get("q_lora_rank") is None:
        wrong.append("q_lora_rank=None (DeepseekV3 without q-LoRA has no query norm: train "
                     "with --q-lora-rank)")
    if args.get("norm_epsilon", 1e-5) != LATENT_NORM_EPS:
        wrong.append(f"norm_epsilon={args.get('norm_epsilon', 1e-5)!r} (DeepseekV3's latent norms "
                     f"use 1e-6: --norm-epsilon 1e-6)")
    if args.get("apply_layernorm_1p"):
        wrong.append("apply_layernorm_1p=True (DeepseekV3's norms scale by w: drop "
                     "--apply-layernorm-1p)")
    if args.get("rotary_percent", 1.0) != 1.0:
        wrong.append(f"rotary_percent={args['rotary_percent']!r} (--rotary-percent 1.0)")
    if args.get("rope_type") == "rope" and args.get("rotary_scaling_factor", 1.0) > 1 and \
            args.get("mscale_all_dim"):
        wrong.append("rope_type='rope' with --rotary-scaling-factor and --mscale-all-dim "
                     "(DeepseekV3 applies the softmax correction with YaRN only: --rope-type yarn)")
    pattern = _moe_pattern(args)
    first_k = pattern.index(1) if 1 in pattern else len(pattern)
    if any(pattern[first_k:]) and not all(pattern[first_k:]):
        wrong.append(f"moe_layer_freq={args.get('moe_layer_freq')!r} (DeepseekV3 has dense layers "
                     f"first, then MoE: --moe-layer-freq ([0]*k+[1]*(L-k)))")
    if args.get("num_experts"):
        wrong += _router_wrong(args)
    if wrong:
        raise ValueError("the checkpoint does not map onto DeepseekV3ForCausalLM: " + "; ".join(wrong))


def _router_wrong(args):
    wrong = []
    topk, groups = args["moe_router_topk"], args.get("moe_router_num_groups")
    if args.get("moe_router_score_function") != "sigmoid":  # (--moe-router-pre-softmax is
        # a softmax router's setting: a sigmoid router ignores it)
        wrong.append(f"moe_router_score_function={args.get('moe_router_score_function')!r} "
                     f"(DeepseekV3's router: --moe-router-score-function sigmoid)")
    if groups and topk != 2 * args.get("moe_router_group_topk", 0):
        wrong.append(f"moe_router_topk={topk} with moe_router_group_topk="
                     f"{args.get('moe_router_group_topk')!r} (transformers scores a group by its "
                     f"top 2 experts: --moe-router-topk = 2 x --moe-router-group-topk)")
    if _shared_experts(args) is None or args.get("moe_shared_expert_gate"):
        wrong.append(f"moe_shared_expert_intermediate_size="
                     f"{args.get('moe_shared_expert_intermediate_size')!r} (DeepseekV3 has an "
                     f"ungated shared expert of n x --moe-ffn-hidden-size; no "
                     f"--moe-shared-expert-gate)")
    return wrong


def _yarn_parameters(args):
    """``rope_parameters`` of a --rope-type yarn model: transformers' YaRN gives cos and sin
    m(mscale) / m(mscale_all_dim) only when both are set, m(1) otherwise; an explicit
    ``attention_factor`` then carries megatron_cp's."""
    factor = args.get("rotary_scaling_factor", 1.0)
    mscale, all_dim = args.get("mscale", 1.0), args.get("mscale_all_dim", 0.0)
    params = {"rope_type": "yarn", "rope_theta": args.get("rotary_base", 1e4), "factor": factor,
              "mscale": mscale, "mscale_all_dim": all_dim}
    for hf_key, (key, default) in YARN_DEFAULTS.items():  # None: the command line's default
        params[hf_key] = default if args.get(key) is None else args[key]
    ours = yarn_concentration_factor(factor, mscale, all_dim)
    if not (mscale and all_dim) and ours != yarn_mscale(factor):
        params["attention_factor"] = ours
    return params


def _mtp_to_hf(full, args, out, num_layers, moe):
    """DeepSeek's names of every MTP depth (``model.layers.{L + k}``) into ``out``."""
    for k in range(args.get("mtp_num_layers") or 0):
        src, dst = f"mtp.layers.{k}.", f"model.layers.{num_layers + k}."
        for ours, theirs in MTP_NAMES.items():
            out[dst + theirs] = full[src + ours]
        _layer_to_hf(full, src + MTP_LAYER, dst, moe, out)
        out[dst + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[dst + "shared_head.head.weight"] = out.get("lm_head.weight",
                                                       out["model.embed_tokens.weight"])


def _layer_to_hf(full, src, dst, moe, out):
    for ours, theirs in LAYER_NAMES.items():
        out[dst + theirs] = full[src + ours]
    s, t = src + "mlp.", dst + "mlp."
    if not moe:
        swiglu_to_hf(out, t, full[s + "linear_fc1.weight"], full[s + "linear_fc2.weight"])
        return
    router = full[s + "router.weight"]
    out[t + "gate.weight"] = router
    out[t + "gate.e_score_correction_bias"] = full.get(
        s + "router.expert_bias", torch.zeros(router.shape[0], dtype=torch.float32))
    experts_to_hf(out, t, full[s + "experts.linear_fc1.weight"], full[s + "experts.linear_fc2.weight"])
    swiglu_to_hf(out, t + "shared_experts.", full[s + "shared_experts.linear_fc1.weight"],
                 full[s + "shared_experts.linear_fc2.weight"])


def to_hf(full, args, out_dir, token_ids=None):
    """Write ``config.json`` + ``model.safetensors`` loadable by DeepseekV3ForCausalLM, the
    MTP depths under DeepSeek's names."""
    check_args(args)
    full = real_rows(full, args)
    n, pattern = args["num_layers"], _moe_pattern(args)
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"],
           "model.norm.weight": full["final_layernorm.weight"]}
    if args["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = full["output_layer.weight"]
    for i in range(n):
        _layer_to_hf(full, f"decoder.layers.{i}.", f"model.layers.{i}.", pattern[i], out)
    _mtp_to_hf(full, args, out, n, pattern[-1])
    nh, embed = args["num_attention_heads"], out["model.embed_tokens.weight"]
    rope = (_yarn_parameters(args) if (args.get("rope_type") or "yarn") == "yarn" else
            {"rope_type": "default", "rope_theta": args.get("rotary_base", 1e4)})
    experts = args.get("num_experts") or 0
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": embed.shape[0], "hidden_size": args["hidden_size"], "num_hidden_layers": n,
        "num_attention_heads": nh, "num_key_value_heads": nh,
        "intermediate_size": args["ffn_hidden_size"],
        "moe_intermediate_size": args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"],
        "first_k_dense_replace": pattern.index(1) if 1 in pattern else n,
        "n_routed_experts": experts, "num_experts_per_tok": args.get("moe_router_topk"),
        "n_shared_experts": _shared_experts(args) if experts else 1,
        "n_group": args.get("moe_router_num_groups") or 1,
        "topk_group": args.get("moe_router_group_topk") or 1,
        "norm_topk_prob": (args.get("moe_router_topk") or 1) > 1,
        "routed_scaling_factor": args.get("moe_router_topk_scaling_factor") or 1.0,
        "q_lora_rank": args["q_lora_rank"], "kv_lora_rank": args["kv_lora_rank"],
        "qk_nope_head_dim": args["qk_head_dim"], "qk_rope_head_dim": args["qk_pos_emb_head_dim"],
        "v_head_dim": args["v_head_dim"], "rope_interleave": True, "rope_parameters": rope,
        "max_position_embeddings": args["max_position_embeddings"],
        "rms_norm_eps": args["norm_epsilon"], "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": not args["untie_embeddings_and_output_weights"],
        "num_nextn_predict_layers": args.get("mtp_num_layers") or 0,
        "torch_dtype": dtype_name(embed), "bos_token_id": None, "eos_token_id": None,
        **(token_ids or {})}
    write_folder(out_dir, out, config)


def _check_config(c, hf_dir):
    """Raise ValueError for a DeepseekV3 config.json setting megatron_cp cannot run."""
    wrong = [f"{key}={c[key]!r} (needs {value!r})"
             for key, value in (("hidden_act", "silu"), ("attention_bias", False))
             if c[key] != value]
    nh = c["num_attention_heads"]
    if c.get("num_key_value_heads", nh) != nh:
        wrong.append(f"num_key_value_heads={c['num_key_value_heads']} (MLA expands one latent to "
                     f"every head: needs num_attention_heads, {nh})")
    if c.get("q_lora_rank") is None:
        wrong.append("q_lora_rank=None (megatron_cp's MLA without q-LoRA normalises the hidden "
                     "states entering linear_q_proj, DeepseekV3 does not)")
    if c["rms_norm_eps"] != LATENT_NORM_EPS:
        wrong.append(f"rms_norm_eps={c['rms_norm_eps']} (DeepseekV3's latent norms use 1e-6 "
                     f"whatever it says; megatron_cp's --norm-epsilon is one for all norms)")
    topk, groups = c["num_experts_per_tok"], c["n_group"] or 1
    if groups > 1 and topk != 2 * c["topk_group"]:
        wrong.append(f"num_experts_per_tok={topk}, topk_group={c.get('topk_group')} (a group's "
                     f"score is the sum of its top 2 experts in transformers, of its top "
                     f"num_experts_per_tok / topk_group in megatron_cp: needs their ratio 2)")
    if c["norm_topk_prob"] != (topk > 1):
        wrong.append(f"norm_topk_prob={c['norm_topk_prob']} with num_experts_per_tok="
                     f"{topk} (megatron_cp normalises the top-k sigmoid scores exactly when k > 1)")
    rope_type, rope = rope_entries(c)
    if rope_type not in ("default", "yarn"):
        wrong.append(f"rope_parameters={rope} (default or yarn)")
    for hf_key, (key, default) in YARN_DEFAULTS.items():
        if rope_type == "yarn" and rope.get(hf_key, default) != default:
            wrong.append(f"rope_parameters[{hf_key!r}]={rope[hf_key]!r} (megatron_cp's MLA "
                         f"takes YaRN's default {default!r})")
    if wrong:
        raise ValueError(f"{hf_dir}: the DeepseekV3 model maps onto no megatron_cp model: "
                         + "; ".join(wrong))


def _rope_args(c, hf_dir):
    """--rope-type, --rotary-scaling-factor, --mscale, --mscale-all-dim, --rotary-base of
    config.json ``c`` (see :func:`_yarn_parameters` for how transformers reads them)."""
    rope_type, rope = rope_entries(c)
    base = rope.get("rope_theta") or c.get("rope_theta") or 1e4
    if rope_type != "yarn":
        return {"rope_type": "rope", "rotary_base": base, "rotary_scaling_factor": 1.0,
                "mscale": 1.0, "mscale_all_dim": 0.0}
    factor = rope.get("factor") or c["max_position_embeddings"] / rope[
        "original_max_position_embeddings"]
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim") or 0.0
    if not (mscale and all_dim):
        mscale = 1.0  # transformers' cos and sin factor is then m(1)
        if all_dim:
            raise ValueError(f"{hf_dir}: rope_parameters mscale_all_dim={all_dim} without mscale "
                             f"(cos and sin scaled by m(1), the softmax by m(mscale_all_dim)^2) "
                             f"has no megatron_cp equivalent")
    given = rope.get("attention_factor")
    if given is not None and abs(given - yarn_concentration_factor(factor, mscale, all_dim)) > 1e-12:
        raise ValueError(f"{hf_dir}: rope_parameters attention_factor={given} is not "
                         f"m(mscale) / m(mscale_all_dim) of its factor: megatron_cp derives it")
    return {"rope_type": "yarn", "rotary_base": base, "rotary_scaling_factor": float(factor),
            "mscale": float(mscale), "mscale_all_dim": float(all_dim)}


def _interleave_rope_rows(weight, rows, d):
    """``weight`` with each block of ``d`` rope rows at ``rows`` (row offsets) turned from
    pairs (i, i + d/2) into pairs (2i, 2i + 1)."""
    order = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=-1).flatten()
    weight = weight.clone()
    for start in rows:
        weight[start:start + d] = weight[start:start + d][order]
    return weight


def _layer_from_hf(weights, src, dst, moe, c, full):
    for ours, theirs in LAYER_NAMES.items():
        full[dst + ours] = weights[src + theirs]
    if not c["rope_interleave"]:
        nh, dn, dr = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        q, kv = dst + "self_attention.linear_q_up_proj.weight", \
            dst + "self_attention.linear_kv_down_proj.weight"
        full[q] = _interleave_rope_rows(full[q], [h * (dn + dr) + dn for h in range(nh)], dr)
        full[kv] = _interleave_rope_rows(full[kv], [c["kv_lora_rank"]], dr)
    s, t = src + "mlp.", dst + "mlp."
    if not moe:
        full[t + "linear_fc1.weight"], full[t + "linear_fc2.weight"] = swiglu_from_hf(weights, s)
        return
    for ours, theirs in ROUTER_NAMES.items():
        full[dst + ours] = weights[src + theirs]
    full[t + "experts.linear_fc1.weight"], full[t + "experts.linear_fc2.weight"] = \
        experts_from_hf(weights, s, c["n_routed_experts"])
    full[t + "shared_experts.linear_fc1.weight"], full[t + "shared_experts.linear_fc2.weight"] = \
        swiglu_from_hf(weights, s + "shared_experts.")


def _mtp_from_hf(weights, c, full, moe, hf_dir):
    """Read the MTP depths the folder holds (``model.layers.{L + k}.eh_proj``); returns
    their number."""
    n, depths = c["num_hidden_layers"], 0
    while f"model.layers.{n + depths}.eh_proj.weight" in weights:
        depths += 1
    for k in range(depths):
        src, dst = f"model.layers.{n + k}.", f"mtp.layers.{k}."
        for ours, theirs in MTP_NAMES.items():
            full[dst + ours] = weights[src + theirs]
        _layer_from_hf(weights, src, dst + MTP_LAYER, moe, c, full)
        for copy, of in (("embed_tokens.weight", "model.embed_tokens.weight"),
                         ("shared_head.head.weight", "lm_head.weight")):
            original = weights.get(of, weights["model.embed_tokens.weight"])
            if src + copy in weights and not torch.equal(weights[src + copy], original):
                raise ValueError(f"{hf_dir}: {src + copy} differs from {of}: megatron_cp's MTP "
                                 f"depths share the model's embedding and output layer")
    return depths


def from_hf(hf_dir):
    """Read a DeepseekV3 folder into (full state dict, args dict, meta dict); the MTP
    depths too when the folder holds them."""
    c = {**HF_DEFAULTS, **read_config(hf_dir)}
    _check_config(c, hf_dir)
    weights = read_weights(hf_dir)
    n, nh = c["num_hidden_layers"], c["num_attention_heads"]
    first_k = min(c["first_k_dense_replace"] or 0, n)
    pattern = [0] * first_k + [1] * (n - first_k)
    full = {"embedding.word_embeddings.weight": weights["model.embed_tokens.weight"],
            "final_layernorm.weight": weights["model.norm.weight"]}
    tied = c["tie_word_embeddings"]
    if not tied:
        full["output_layer.weight"] = weights["lm_head.weight"]
    for i in range(n):
        _layer_from_hf(weights, f"model.layers.{i}.", f"decoder.layers.{i}.", pattern[i], c, full)
    depths = _mtp_from_hf(weights, c, full, pattern[-1], hf_dir)
    args = {"num_layers": n, "hidden_size": c["hidden_size"], "num_attention_heads": nh,
            "num_query_groups": nh, "group_query_attention": False,
            "seq_length": c["max_position_embeddings"],
            "max_position_embeddings": c["max_position_embeddings"],
            "ffn_hidden_size": c["intermediate_size"], "norm_epsilon": c["rms_norm_eps"],
            **REQUIRED, "q_lora_rank": c["q_lora_rank"], "kv_lora_rank": c["kv_lora_rank"],
            "qk_head_dim": c["qk_nope_head_dim"], "qk_pos_emb_head_dim": c["qk_rope_head_dim"],
            "v_head_dim": c["v_head_dim"], **_rope_args(c, hf_dir),
            "untie_embeddings_and_output_weights": not tied, "true_vocab_size": c["vocab_size"],
            "mtp_num_layers": depths or None,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    if any(pattern):
        groups = c["n_group"] or 1
        args.update(
            num_experts=c["n_routed_experts"], moe_router_topk=c["num_experts_per_tok"],
            moe_ffn_hidden_size=c["moe_intermediate_size"], moe_layer_freq=str(pattern),
            moe_shared_expert_intermediate_size=c["moe_intermediate_size"] * c["n_shared_experts"],
            moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=c["topk_group"] if groups > 1 else None,
            moe_router_topk_scaling_factor=c["routed_scaling_factor"])
    return full, args, {"iteration": 0, "consumed_samples": 0}
