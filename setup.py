"""Packaging for megatron_cp.

Install torch first on CPU machines (``pip install torch==2.13.0``) so that the
``torch>=2.3`` requirement below is already met and no CUDA wheels are pulled;
``scripts/env.sh`` does it. apex and Transformer Engine are optional accelerators installed
by hand (see the README), not extras: the package index's ``apex`` is another project.
Weights & Biases logging (``--wandb-project``) needs the ``wandb`` extra; the ``gpu`` extra
adds flash-linear-attention's kernels (fla-core) for the Gated DeltaNet layers on CUDA.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_cp",
    version="0.1.0",
    description="Megatron-style GPT pretraining over TP/SP, CP, PP, DP and EP, "
    "proven on CPU with gloo",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_cp", "megatron_cp.*"]),
    install_requires=[
        "torch>=2.3",
        "numpy",
        "sentencepiece",
        "tensorboard",
    ],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "tokenizers", "safetensors", "transformers",
                "wandb", "tiktoken"],  # tiktoken: the TikTokenizer tests (optional at run time)
        "bench": ["transformers"],
        "wandb": ["wandb"],  # --wandb-project
        # flash-linear-attention's ops: the Gated DeltaNet kernel on CUDA for bf16 / fp16 models
        # (layers/gated_delta_rule.py calls its chunk_gated_delta_rule's 0.6.0 entry point);
        # Triton comes with the CUDA build of torch
        "gpu": ["fla-core==0.6.0"],
    },
)
