"""Hugging Face export and import: the layout a checkpoint maps to, and the folder as a whole.

The export picks the layout from the checkpoint's arguments: MoE models (``--num-experts``)
become ``MixtralForCausalLM`` (checkpoint/hf/mixtral.py: Llama-style with every MLP an MoE block),
and only that; dense Llama-style models (RMSNorm, SwiGLU, RoPE, no biases)
``LlamaForCausalLM`` (llama.py), multi-latent attention models
``DeepseekV3ForCausalLM`` (deepseek_v3.py, MTP depths included), Megatron's
default architecture (LayerNorm, GELU, learned absolute positions, biases) ``GPT2LMHeadModel`` (gpt2.py); the tokenizer
files travel along (tokenizer.py). The import picks the layout from
``config.json``'s ``model_type``.

Zero-centred norm weights (``--apply-layernorm-1p``: the norms scale by 1 + w) are exported as
the plain weights 1 + w, which every layout here multiplies by. Settings none of the layouts
express (QK norms, interleaved rotary pairs, squared ReLU; YaRN, which no layout picks) are
refused, naming the flag.

FP8 (``--fp8-format``): a Hugging Face folder has no place for delayed scaling's amax
histories and scales (Megatron-LM keeps them in Transformer Engine's ``_extra_state``, which
its own exports leave out too): the export drops the ``fp8_meta`` buffers, and a checkpoint
imported from Hugging Face starts every history fresh in an FP8 run.
"""
from megatron_cp.checkpoint.fp8_state import without_fp8
from megatron_cp.checkpoint.hf import deepseek_v3, gpt2, llama, mixtral, qwen3_next
from megatron_cp.checkpoint.hf.io import read_config

LAYOUTS = {"mixtral": (mixtral, "MixtralForCausalLM"), "llama": (llama, "LlamaForCausalLM"),
           "gpt2": (gpt2, "GPT2LMHeadModel"),
           "qwen3_next": (qwen3_next, "Qwen3NextForCausalLM"),
           "deepseek_v3": (deepseek_v3, "DeepseekV3ForCausalLM")}
SIGNATURE = ("normalization", "swiglu", "disable_bias_linear", "position_embedding_type")


# settings of the checkpoint's arguments that no Hugging Face layout here expresses
NOT_EXPRESSIBLE = {"qk_layernorm": "--qk-layernorm (a norm on every query and key head)",
                   "rotary_interleaved": "--rotary-interleaved (rotary pairs (2i, 2i + 1); "
                                         "Llama's are the halves' (i, i + d/2))",
                   "squared_relu": "--squared-relu (the layouts' MLPs use GELU or SwiGLU)"}


def check_expressible(args):
    """Raise ValueError naming every setting of ``args`` no Hugging Face layout expresses."""
    wrong = [why for key, why in NOT_EXPRESSIBLE.items() if args.get(key)]
    if wrong:
        raise ValueError(f"the checkpoint was trained with {'; '.join(wrong)}, which none of "
                         f"the Hugging Face layouts ({', '.join(LAYOUTS)}) express: it cannot "
                         f"be exported")


def plain_norm_weights(full, args):
    """``full`` with zero-centred norm weights w (``--apply-layernorm-1p``) replaced by the
    scale 1 + w they stand for (``full`` itself when the norms are plain)."""
    if not args.get("apply_layernorm_1p"):
        return full
    return {name: t + 1 if name.endswith("layernorm.weight") else t for name, t in full.items()}


def pick_layout(args):
    """The Hugging Face layout (a key of LAYOUTS) the checkpoint's arguments describe. An MoE
    checkpoint maps onto Mixtral only (ValueError naming each setting Mixtral cannot express);
    a dense one onto Llama or GPT-2; a Gated DeltaNet hybrid onto Qwen3-Next. Settings no
    layout expresses are refused first."""
    if args.get("experimental_attention_variant") in ("gdn", "gated_delta_net"):
        return "qwen3_next"  # its own checks (qwen3_next.py); it has QK norms
    if args.get("multi_latent_attention"):
        deepseek_v3.check_args(args)  # its latent norms are --qk-layernorm
        return "deepseek_v3"
    check_expressible(args)
    if args.get("num_experts"):
        mixtral.check_args(args)
        return "mixtral"
    dense = {name: entry for name, entry in LAYOUTS.items() if name in ("llama", "gpt2")}
    for name, (module, _) in dense.items():
        if all(args.get(key) == value for key, value in module.REQUIRED.items()):
            return name
    have = ", ".join(f"{key}={args.get(key)!r}" for key in SIGNATURE)
    wants = "; ".join(f"{cls} needs " + ", ".join(f"{k}={v!r}" for k, v in module.REQUIRED.items())
                      for module, cls in dense.values())
    raise ValueError(f"the checkpoint ({have}) maps onto no Hugging Face layout: {wants}")


def export_hf(full, args, out_dir, tokenizer=True):
    """Write ``full`` as a Hugging Face folder (the layout from ``args``) with the tokenizer
    files of the tokenizer ``args`` names; returns the architecture written."""
    from megatron_cp.checkpoint.hf import tokenizer as hf_tokenizer

    full = without_fp8(full)  # (see the module docstring)
    layout = pick_layout(args)
    module, architecture = LAYOUTS[layout]
    ids = hf_tokenizer.token_ids(args) if tokenizer else {}  # checks the files before writing
    if layout not in ("qwen3_next", "deepseek_v3"):  # Qwen3-Next's are zero-centred as ours,
        # DeepSeek-V3's refuse --apply-layernorm-1p (its MTP norms are not named *layernorm)
        full = plain_norm_weights(full, args)
    module.to_hf(full, args, out_dir, token_ids=ids)
    if tokenizer:
        hf_tokenizer.write_tokenizer(args, out_dir)
    return architecture


def import_hf(hf_dir):
    """(full state dict, args dict, meta dict) of a Hugging Face folder, by its model_type."""
    model_type = read_config(hf_dir).get("model_type")
    if model_type == "gpt2":
        return gpt2.from_hf(hf_dir)
    if model_type == "llama":
        return llama.from_hf(hf_dir)
    if model_type == "mixtral":
        return mixtral.from_hf(hf_dir)
    if model_type == "qwen3_next":
        return qwen3_next.from_hf(hf_dir)
    if model_type == "deepseek_v3":
        return deepseek_v3.from_hf(hf_dir)
    raise ValueError(f"{hf_dir}: model_type {model_type!r} has no import; megatron_cp reads "
                     f"{', '.join(LAYOUTS)} folders")
