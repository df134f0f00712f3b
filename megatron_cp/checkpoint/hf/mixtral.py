"""Name and layout mapping between megatron_cp's full state dict and Hugging Face Mixtral.

Mixtral is Llama (llama.py: embedding, norms, attention, most of config.json) with
every MLP replaced by a sparse MoE block: a router ``gate`` [E, h] and E SwiGLU experts. The
export writes the experts as the Hugging Face Hub checkpoints and ``save_pretrained`` do::

    model.layers.N.block_sparse_moe.gate.weight          [E, h] <- mlp.router.weight
    model.layers.N.block_sparse_moe.experts.e.w1.weight  [F, h] <- experts.linear_fc1[e, :F] (gate)
    model.layers.N.block_sparse_moe.experts.e.w3.weight  [F, h] <- experts.linear_fc1[e, F:] (up)
    model.layers.N.block_sparse_moe.experts.e.w2.weight  [h, F] <- experts.linear_fc2[e]

(transformers 5 fuses them on load into ``mlp.experts.gate_up_proj`` [E, 2F, h] = [w1; w3]
per expert and ``mlp.experts.down_proj`` [E, h, F]; the import reads either form).

Routing: Mixtral takes the softmax over all experts, keeps the top k and renormalises them to
sum to 1, which is the softmax over the top-k logits: megatron_cp's default softmax router
(no ``--moe-router-pre-softmax``, no scaling factor, no groups, no expert bias). Export
refuses what Mixtral cannot express, naming the flag. Token dropping
(``--moe-expert-capacity-factor``) is a property of the run, not of the weights: the exported
model runs dropless, as Mixtral does.
"""
import torch

from megatron_cp.config.layer_pattern import parse_layer_freq
from megatron_cp.checkpoint.hf import llama as hf_llama
from megatron_cp.checkpoint.hf.io import read_config, read_weights, real_rows, write_folder

REQUIRED = hf_llama.REQUIRED  # Llama-style attention, norms and SwiGLU experts
FLAGS = {"normalization": "--normalization RMSNorm", "swiglu": "--swiglu",
         "disable_bias_linear": "--disable-bias-linear",
         "position_embedding_type": "--position-embedding-type rope"}
MIXTRAL_ROPE_THETA = 1e6  # MixtralConfig's default when config.json names none


def ffn_size(args):
    """The routed experts' hidden size: ``--moe-ffn-hidden-size``, default ``--ffn-hidden-size``."""
    return args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"]


def check_args(args):
    """Raise one ValueError naming every setting of ``args`` that MixtralForCausalLM cannot
    express, each with the flag that fixes it."""
    wrong = [f"{key}={args.get(key)!r} (train with {FLAGS[key]})"
             for key, value in REQUIRED.items() if args.get(key) != value]
    if args.get("rotary_percent", 1.0) != 1.0:
        wrong.append(f"rotary_percent={args['rotary_percent']!r} (Mixtral rotates every head "
                     f"dim: --rotary-percent 1.0)")
    if not args.get("num_experts"):
        wrong.append(f"num_experts={args.get('num_experts')!r} (a dense model: export it as "
                     f"LlamaForCausalLM)")
    else:
        pattern = parse_layer_freq(args.get("moe_layer_freq") or 1, args["num_layers"])
        if not all(pattern):
            dense = [i for i, moe in enumerate(pattern) if not moe]
            wrong.append(f"moe_layer_freq={args.get('moe_layer_freq')!r} leaves layers {dense} "
                         f"dense (every Mixtral layer is MoE: --moe-layer-freq 1)")
    if args.get("moe_shared_expert_intermediate_size") or args.get("moe_shared_expert_gate"):
        wrong.append(f"moe_shared_expert_intermediate_size="
                     f"{args.get('moe_shared_expert_intermediate_size')!r}, moe_shared_expert_gate="
                     f"{bool(args.get('moe_shared_expert_gate'))} (Mixtral has no shared expert: "
                     f"drop --moe-shared-expert-intermediate-size and --moe-shared-expert-gate)")
    if (args.get("moe_router_score_function") or "softmax") != "softmax":
        wrong.append(f"moe_router_score_function={args['moe_router_score_function']!r} "
                     f"(Mixtral's router is a softmax: --moe-router-score-function softmax)")
    if args.get("moe_router_pre_softmax"):
        wrong.append("moe_router_pre_softmax=True (Mixtral renormalises the top-k probabilities "
                     "to sum to 1, which is the softmax over the top-k logits: drop "
                     "--moe-router-pre-softmax)")
    if args.get("moe_router_topk_scaling_factor") not in (None, 1.0):
        wrong.append(f"moe_router_topk_scaling_factor={args['moe_router_topk_scaling_factor']!r} "
                     f"(Mixtral does not scale the routing weights: drop "
                     f"--moe-router-topk-scaling-factor)")
    if args.get("moe_router_num_groups"):
        wrong.append(f"moe_router_num_groups={args['moe_router_num_groups']!r} (Mixtral picks the "
                     f"top k among all experts: drop --moe-router-num-groups and "
                     f"--moe-router-group-topk)")
    if args.get("moe_router_enable_expert_bias"):
        wrong.append("moe_router_enable_expert_bias=True (Mixtral's router has no expert bias: "
                     "drop --moe-router-enable-expert-bias)")
    if wrong:
        raise ValueError("the checkpoint does not map onto MixtralForCausalLM: " + "; ".join(wrong))


def to_hf(full, args, out_dir, token_ids=None):
    """Write ``config.json`` + ``model.safetensors`` loadable by MixtralForCausalLM.

    ``token_ids``: ``bos_token_id`` / ``eos_token_id`` for the config, from the tokenizer."""
    check_args(args)
    experts, ffn = args["num_experts"], ffn_size(args)
    full = real_rows(full, args)
    out = hf_llama.shared_to_hf(full, args)
    for i in range(args["num_layers"]):
        src, dst = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        out[dst + "gate.weight"] = full[src + "router.weight"]
        fc1 = full[src + "experts.linear_fc1.weight"]  # [E, 2F, h]: [gate; up] per expert
        fc2 = full[src + "experts.linear_fc2.weight"]  # [E, h, F]
        if fc1.shape[:2] != (experts, 2 * ffn) or (fc2.shape[0], fc2.shape[2]) != (experts, ffn):
            raise ValueError(f"layer {i}: experts of shape {tuple(fc1.shape)} / "
                             f"{tuple(fc2.shape)} are not num_experts ({experts}) SwiGLU experts "
                             f"of hidden size {ffn} (a full, unsharded state dict is needed)")
        for e in range(experts):
            out[dst + f"experts.{e}.w1.weight"] = fc1[e, :ffn]
            out[dst + f"experts.{e}.w3.weight"] = fc1[e, ffn:]
            out[dst + f"experts.{e}.w2.weight"] = fc2[e]
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
              "intermediate_size": ffn, "num_local_experts": experts,
              "num_experts_per_tok": args["moe_router_topk"], "router_jitter_noise": 0.0,
              "sliding_window": None, "output_router_logits": False,
              **hf_llama.shared_config(args, out["model.embed_tokens.weight"], token_ids)}
    write_folder(out_dir, out, config)


def _check_config(c, hf_dir):
    hf_llama.check_config(c, hf_dir)
    window = c.get("sliding_window")
    if window is not None and window < c["max_position_embeddings"]:
        raise ValueError(f"{hf_dir}: sliding_window={window} (< max_position_embeddings "
                         f"{c['max_position_embeddings']}): megatron_cp's attention has no "
                         f"sliding window")
    if c.get("router_jitter_noise"):
        raise ValueError(f"{hf_dir}: router_jitter_noise={c['router_jitter_noise']} scales the "
                         f"whole MoE input in training, megatron_cp's --moe-input-jitter-eps only "
                         f"the router's: set it to 0 in config.json to import the weights")


def _experts_from_hf(weights, i, experts):
    """(router [E, h], fc1 [E, 2F, h], fc2 [E, h, F]) of layer ``i``: the Hub's per-expert
    w1/w3/w2 (``block_sparse_moe``) or transformers 5's fused ``mlp.experts`` tensors."""
    fused = f"model.layers.{i}.mlp."
    if fused + "experts.gate_up_proj" in weights:
        return (weights[fused + "gate.weight"], weights[fused + "experts.gate_up_proj"],
                weights[fused + "experts.down_proj"])
    src = f"model.layers.{i}.block_sparse_moe."
    fc1 = torch.stack([torch.cat([weights[src + f"experts.{e}.w1.weight"],  # gate
                                  weights[src + f"experts.{e}.w3.weight"]])  # up
                       for e in range(experts)])
    fc2 = torch.stack([weights[src + f"experts.{e}.w2.weight"] for e in range(experts)])
    return weights[src + "gate.weight"], fc1, fc2


def from_hf(hf_dir):
    """Read a Mixtral folder into (full state dict, args dict, meta dict) for save_layout."""
    c = read_config(hf_dir)
    _check_config(c, hf_dir)
    experts, ffn = c.get("num_local_experts", 8), c["intermediate_size"]  # HF default 8
    weights = read_weights(hf_dir)
    full = hf_llama.shared_from_hf(c, weights)
    for i in range(c["num_hidden_layers"]):
        router, fc1, fc2 = _experts_from_hf(weights, i, experts)
        dst = f"decoder.layers.{i}.mlp."
        full[dst + "router.weight"] = router
        full[dst + "experts.linear_fc1.weight"] = fc1
        full[dst + "experts.linear_fc2.weight"] = fc2
    args = {**hf_llama.shared_args(c, MIXTRAL_ROPE_THETA), "ffn_hidden_size": ffn,
            "moe_ffn_hidden_size": ffn, "num_experts": experts,
            "moe_router_topk": c.get("num_experts_per_tok", 2), "moe_layer_freq": "1",
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": False}
    return full, args, {"iteration": 0, "consumed_samples": 0}
