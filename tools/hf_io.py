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
