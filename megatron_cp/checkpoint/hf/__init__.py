"""Hugging Face conversion: our full weights and arguments to a Hugging Face model folder and
back (what ``tools/checkpoint_convert.py --to-hf`` / ``--from-hf`` runs).

- ``convert``: the front. ``export_hf`` picks the layout the checkpoint's arguments describe
  (``pick_layout``) and writes the folder with its tokenizer files; ``import_hf`` reads a
  folder by its ``config.json``'s ``model_type``.
- one module per layout, each with ``to_hf`` / ``from_hf``: ``gpt2`` (Megatron's default
  architecture), ``llama`` (dense Llama-style), ``mixtral`` (Llama with MoE MLPs, built on
  ``llama``), ``deepseek_v3`` (multi-latent attention, MTP depths) and ``qwen3_next`` (the
  Gated DeltaNet hybrid).
- ``io``: the folder on disk (config.json, safetensors / pytorch_model*.bin weights) and the
  checks every layout shares.
- ``tokenizer``: the tokenizer files an export carries; ``sentencepiece``: a SentencePiece
  ``.model`` as the ``tokenizer.json`` transformers reads.

safetensors, tokenizers and sentencepiece's protobuf are imported where they are used, and
transformers never, so importing this package needs only torch. This file imports nothing.
"""
