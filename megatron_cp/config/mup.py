"""Maximal Update Parameterization (muP) as Megatron-LM defines it (``--use-mup``).

The model is written at width ``hidden_size``; a base (proxy) model of width
``mup_base_hidden_size`` had its hyper-parameters tuned, and ``width_mult = hidden_size /
mup_base_hidden_size`` carries them over:

- init: hidden weights (QKV, fc1, routers, experts, GDN / MLA projections) start at
  ``init_method_std / sqrt(width_mult)``, the residual-branch output projections (attention
  proj, fc2) at ``init_method_std / (sqrt(2 num_layers) sqrt(width_mult))``; the word and
  position embeddings and an untied output layer keep ``init_method_std``
  (:attr:`GPTConfig.hidden_init_std`);
- forward: the embedding output is multiplied by ``mup_embedding_mult``, the logits by
  ``mup_output_mult`` (left at 1 it becomes ``1 / width_mult``), and the attention scores
  by ``sqrt(mup_base_head_dim) / kv_channels ** mup_attn_scale_power`` (1 / kv_channels by
  default) instead of ``1 / sqrt(kv_channels)``; multi-latent attention keeps its own scale,
  as in Megatron-LM;
- optimizer: Adam's hidden matrices (2-D or more, outside the embedding and output layer)
  get ``lr``, ``min_lr`` and ``adam_eps`` divided by ``width_mult``
  (megatron_cp.optimizer.optimizer.mup_group_overrides).

This module resolves the derived values when the config is built (:func:`resolve_mup`).
"""
import math

from megatron_cp.config.setting import resolve

# the muP settings that mean nothing without --use-mup, with their defaults
_MUP_SETTINGS = {"mup_width_mult": 1.0, "mup_base_hidden_size": None, "mup_embedding_mult": 1.0,
                 "mup_output_mult": 1.0, "mup_base_head_dim": None, "mup_attn_scale_power": 1.0}


def resolve_mup(config):
    """Check the muP settings of ``config`` (a GPTConfig with kv_channels resolved) and fill
    what --use-mup derives: mup_base_hidden_size, mup_width_mult, softmax_scale and
    mup_output_mult (Megatron-LM's TransformerConfig rules)."""
    if not config.use_mup:
        given = [f"{name} ({getattr(config, name)})" for name, default in _MUP_SETTINGS.items()
                 if getattr(config, name) != default]
        if given:
            raise ValueError(f"{', '.join(given)} only {'apply' if len(given) > 1 else 'applies'} "
                             f"with use_mup; add use_mup or drop "
                             f"{'them' if len(given) > 1 else 'it'}")
        return
    base = config.mup_base_hidden_size
    if base is None:
        base = config.hidden_size  # the base model itself: width_mult 1
    if base <= 0:
        raise ValueError(f"mup_base_hidden_size ({base}) must be positive")
    width_mult = config.hidden_size / base
    if config.mup_width_mult not in (1.0, width_mult):
        raise ValueError(f"mup_width_mult ({config.mup_width_mult}) is computed as hidden_size / "
                         f"mup_base_hidden_size ({config.hidden_size} / {base} = {width_mult}); "
                         f"drop it and set mup_base_hidden_size")
    if config.mup_base_head_dim is not None and not config.mup_base_head_dim > 0:
        raise ValueError(f"mup_base_head_dim ({config.mup_base_head_dim}) must be positive")
    resolve(config, mup_base_hidden_size=base, mup_width_mult=width_mult)
    if config.softmax_scale is None:
        base_dim = config.mup_base_head_dim
        base_scale = 1.0 if base_dim is None else math.sqrt(base_dim)
        resolve(config,
                softmax_scale=base_scale / config.kv_channels ** config.mup_attn_scale_power)
    if config.mup_output_mult == 1.0 and width_mult != 1.0:
        resolve(config, mup_output_mult=1.0 / width_mult)
