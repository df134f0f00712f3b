"""Name and layout mapping between megatron_cp's full state dict and Hugging Face GPT-2.

Megatron's default architecture (LayerNorm, GELU, learned absolute positions, biases, tied
embeddings) is GPT2LMHeadModel. What differs on the way:

- megatron_cp fuses QKV per query group, which without grouped-query attention is per head:
  rows [q_0 | k_0 | v_0 | q_1 | ...]; GPT-2's ``c_attn`` holds all queries, then all keys,
  then all values: [q_0 q_1 ... | k_0 ... | v_0 ...]. Same for the bias.
- GPT-2's linear layers are ``Conv1D`` modules, whose weight is [in, out]: the transpose of
  ``torch.nn.Linear``'s [out, in].
- The GELU: Megatron-LM's default (its bias-GELU fusion) is the tanh approximation, GPT-2's
  own ``gelu_new``; ``--no-bias-gelu-fusion`` is the exact erf GELU, ``gelu``. Both ways,
  the config names the one the model computes.
- Both scale attention scores by 1/sqrt(head dim), apply the norms' epsilon from the config
  and add learned positions to the word embeddings; the position table has
  ``max_position_embeddings`` rows (GPT-2's ``n_positions``).
"""
from megatron_cp.checkpoint.hf.io import dtype_name, read_config, read_weights, real_rows, require, write_folder

REQUIRED = {"normalization": "LayerNorm", "swiglu": False, "disable_bias_linear": False,
            "position_embedding_type": "learned_absolute"}
EXACT_GELU = ("gelu", "gelu_python")  # ACT2FN names of erf GELU
# ACT2FN names of the tanh approximation (equal to F.gelu(approximate="tanh") to 1e-12)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate")
NORMS = (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))
# Conv1D weights: megatron_cp name -> GPT-2 name, both [out, in] vs [in, out]
LINEARS = (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
           ("mlp.linear_fc2", "mlp.c_proj"))


def _dims(args):
    """(heads, head dim, hidden) of a GPT-2-expressible checkpoint, or ValueError."""
    nh, h = args["num_attention_heads"], args["hidden_size"]
    ng = args.get("num_query_groups") or nh
    if ng != nh:
        raise ValueError(f"num_query_groups ({ng}) differs from num_attention_heads ({nh}): GPT-2 "
                         f"has no grouped-query attention; export a model trained without "
                         f"--group-query-attention")
    d = args.get("kv_channels") or h // nh
    if d * nh != h:
        raise ValueError(f"kv_channels ({d}) x num_attention_heads ({nh}) must equal hidden_size "
                         f"({h}): GPT-2's head dim is n_embd / n_head")
    return nh, d, h


def to_hf(full, args, out_dir, token_ids=None):
    """Write ``config.json`` + ``model.safetensors`` loadable by GPT2LMHeadModel.

    ``token_ids``: ``bos_token_id`` / ``eos_token_id`` for the config (the tokenizer's eod)."""
    require(args, REQUIRED, "GPT2LMHeadModel")
    if args.get("squared_relu"):
        raise ValueError("the checkpoint's MLP computes relu(x)^2 (--squared-relu); "
                         "GPT2LMHeadModel's activation_function has no squared ReLU")
    nh, d, h = _dims(args)
    full = real_rows(full, args)
    tied = not args["untie_embeddings_and_output_weights"]
    wte = full["embedding.word_embeddings.weight"]
    out = {"transformer.wte.weight": wte,
           "transformer.wpe.weight": full["embedding.position_embeddings"],
           "transformer.ln_f.weight": full["final_layernorm.weight"],
           "transformer.ln_f.bias": full["final_layernorm.bias"]}
    if not tied:
        out["lm_head.weight"] = full["output_layer.weight"]
    for i in range(args["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv = full[src + "self_attention.linear_qkv.weight"].view(nh, 3, d, h)  # per head q|k|v
        out[dst + "attn.c_attn.weight"] = qkv.transpose(0, 1).reshape(3 * h, h).t()  # [h, 3h]
        bias = full[src + "self_attention.linear_qkv.bias"].view(nh, 3, d)
        out[dst + "attn.c_attn.bias"] = bias.transpose(0, 1).reshape(3 * h)
        for ours, theirs in LINEARS:
            out[dst + theirs + ".weight"] = full[src + ours + ".weight"].t()  # [in, out]
            out[dst + theirs + ".bias"] = full[src + ours + ".bias"]
        for ours, theirs in NORMS:
            out[dst + theirs + ".weight"] = full[src + ours + ".weight"]
            out[dst + theirs + ".bias"] = full[src + ours + ".bias"]
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "vocab_size": wte.shape[0], "n_positions": out["transformer.wpe.weight"].shape[0],
              "n_embd": h, "n_layer": args["num_layers"], "n_head": nh,
              "n_inner": args.get("ffn_hidden_size") or 4 * h,
              "activation_function": "gelu_new" if args.get("bias_gelu_fusion") else "gelu",
              "layer_norm_epsilon": args.get("norm_epsilon", 1e-5),
              "resid_pdrop": args.get("hidden_dropout", 0.1),
              "embd_pdrop": args.get("hidden_dropout", 0.1),
              "attn_pdrop": args.get("attention_dropout", 0.1),
              "initializer_range": args.get("init_method_std", 0.02),
              "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
              "reorder_and_upcast_attn": False, "tie_word_embeddings": tied,
              "torch_dtype": dtype_name(wte), "bos_token_id": None, "eos_token_id": None,
              **(token_ids or {})}
    write_folder(out_dir, out, config)


def _check_config(c, hf_dir):
    act = c.get("activation_function", "gelu_new")
    if act not in EXACT_GELU + TANH_GELU:
        raise ValueError(f"{hf_dir}: activation_function {act!r} is neither the exact GELU "
                         f"({', '.join(EXACT_GELU)}) nor its tanh approximation "
                         f"({', '.join(TANH_GELU)}), the two megatron_cp's GPT MLP computes")
    for key, value in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False)):
        if c.get(key, value) != value:
            raise ValueError(f"{hf_dir}: {key}={c[key]!r} has no megatron_cp equivalent "
                             f"(needs {value!r})")


def from_hf(hf_dir):
    """Read a GPT-2 folder into (full state dict, args dict, meta dict) for save_layout; a
    tanh GELU (``gelu_new``, the original GPT-2s) keeps the bias-GELU fusion on, an exact one
    turns it off."""
    c = read_config(hf_dir)
    _check_config(c, hf_dir)
    # old checkpoints have no "transformer." prefix; "attn.bias" is their causal-mask buffer
    w = {k.removeprefix("transformer."): v for k, v in read_weights(hf_dir).items()}
    h, nh, num_layers = c["n_embd"], c["n_head"], c["n_layer"]
    d = h // nh
    tied = c.get("tie_word_embeddings", True)
    full = {"embedding.word_embeddings.weight": w["wte.weight"],
            "embedding.position_embeddings": w["wpe.weight"],
            "final_layernorm.weight": w["ln_f.weight"], "final_layernorm.bias": w["ln_f.bias"]}
    if not tied:
        full["output_layer.weight"] = w["lm_head.weight"]
    for i in range(num_layers):
        src, dst = f"h.{i}.", f"decoder.layers.{i}."
        qkv = w[src + "attn.c_attn.weight"].t().reshape(3, nh, d, h)  # [q heads | k | v]
        full[dst + "self_attention.linear_qkv.weight"] = qkv.transpose(0, 1).reshape(3 * h, h)
        bias = w[src + "attn.c_attn.bias"].view(3, nh, d)
        full[dst + "self_attention.linear_qkv.bias"] = bias.transpose(0, 1).reshape(3 * h)
        for ours, theirs in LINEARS:
            full[dst + ours + ".weight"] = w[src + theirs + ".weight"].t()
            full[dst + ours + ".bias"] = w[src + theirs + ".bias"]
        for ours, theirs in NORMS:
            full[dst + ours + ".weight"] = w[src + theirs + ".weight"]
            full[dst + ours + ".bias"] = w[src + theirs + ".bias"]
    full = {k: v.contiguous() for k, v in full.items()}
    args = {"num_layers": num_layers, "hidden_size": h, "num_attention_heads": nh,
            "ffn_hidden_size": c.get("n_inner") or 4 * h, "num_query_groups": nh,
            "group_query_attention": False, "kv_channels": None,
            "max_position_embeddings": c["n_positions"], "seq_length": c["n_positions"],
            "norm_epsilon": c.get("layer_norm_epsilon", 1e-5),
            "untie_embeddings_and_output_weights": not tied, **REQUIRED,
            "bias_gelu_fusion": c.get("activation_function", "gelu_new") in TANH_GELU,
            "true_vocab_size": c["vocab_size"],
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    return full, args, {"iteration": 0, "consumed_samples": 0}
