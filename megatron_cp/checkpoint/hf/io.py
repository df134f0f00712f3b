"""Hugging Face model folders on disk, and the checks every HF layout shares.

A folder is ``config.json`` + ``model.safetensors`` (written here) or any of the weight files
Hugging Face writes (``*.safetensors`` shards, ``pytorch_model*.bin``: read here).
"""
import json
import os

import torch

VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def require(args, required, layout):
    """Raise ValueError naming every setting of ``args`` that ``layout`` cannot express."""
    wrong = [f"{key}={args.get(key)!r} (needs {value!r})" for key, value in required.items()
             if args.get(key) != value]
    if wrong:
        raise ValueError(f"the checkpoint does not map onto {layout}: " + ", ".join(wrong))


def real_rows(full, args):
    """``full`` with the vocabulary rows cut to ``true_vocab_size`` (no TP padding rows)."""
    rows = args.get("true_vocab_size")
    return {name: (t[:rows] if rows and name in VOCAB_ROWS else t) for name, t in full.items()}


def dtype_name(tensor):
    """``torch.bfloat16`` -> ``"bfloat16"`` (config.json's ``torch_dtype``)."""
    return str(tensor.dtype).replace("torch.", "")


def write_folder(out_dir, tensors, config):
    """Write ``model.safetensors`` (contiguous copies of ``tensors``) and ``config.json``."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def read_config(hf_dir):
    """The folder's ``config.json`` as a dict."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{hf_dir} has no config.json: not a Hugging Face model folder "
                         f"(give the folder written by save_pretrained)")
    with open(path) as f:
        return json.load(f)


def rope_entries(c):
    """(rope type, its entries) of config.json ``c``: transformers 5's ``rope_parameters``
    {"rope_theta", "rope_type", ...} or, as transformers 4 (and DeepSeek's released
    config.json) write it, ``rope_scaling`` (with ``rope_type``, or ``type``) with
    ``rope_theta`` at the top; "default" for plain RoPE."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return rope.get("rope_type") or rope.get("type") or "default", rope


def read_weights(hf_dir):
    """Every tensor of the folder's safetensors files (or, without any, its ``.bin`` files)."""
    names = sorted(os.listdir(hf_dir))
    weights = {}
    safetensors = [n for n in names if n.endswith(".safetensors")]
    if safetensors:
        from safetensors.torch import load_file
        for name in safetensors:
            weights.update(load_file(os.path.join(hf_dir, name)))
    else:
        for name in (n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")):
            weights.update(torch.load(os.path.join(hf_dir, name), map_location="cpu",
                                      weights_only=True))
    if not weights:
        raise ValueError(f"{hf_dir} holds no *.safetensors or pytorch_model*.bin weights")
    return weights


def swiglu_from_hf(weights, prefix):
    """(fc1 [2F, h] = [gate; up], fc2 [h, F]) of the SwiGLU MLP ``prefix`` names with the
    Hub's gate_proj / up_proj / down_proj."""
    fc1 = torch.cat([weights[prefix + "gate_proj.weight"], weights[prefix + "up_proj.weight"]])
    return fc1, weights[prefix + "down_proj.weight"]


def swiglu_to_hf(out, prefix, fc1, fc2):
    """Put a SwiGLU MLP's fc1 [2F, h] ([gate; up]) and fc2 [h, F] into ``out`` under the
    Hub's gate_proj / up_proj / down_proj names at ``prefix``."""
    gate, up = fc1.chunk(2)
    out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = gate, up
    out[prefix + "down_proj.weight"] = fc2


def experts_from_hf(weights, prefix, experts):
    """(fc1 [E, 2F, h] = [gate; up], fc2 [E, h, F]) of one MoE block: transformers' fused
    tensors or the Hub's (and save_pretrained's) per-expert ones."""
    if prefix + "experts.gate_up_proj" in weights:
        return weights[prefix + "experts.gate_up_proj"], weights[prefix + "experts.down_proj"]
    per = [swiglu_from_hf(weights, f"{prefix}experts.{e}.") for e in range(experts)]
    return torch.stack([fc1 for fc1, _ in per]), torch.stack([fc2 for _, fc2 in per])


def experts_to_hf(out, prefix, fc1, fc2):
    """Put experts fc1 [E, 2F, h] and fc2 [E, h, F] into ``out`` as the Hub's per-expert
    tensors (what save_pretrained writes) at ``prefix``."""
    for e in range(fc1.shape[0]):
        swiglu_to_hf(out, f"{prefix}experts.{e}.", fc1[e], fc2[e])
