"""Rotary position embedding (RoPE) driven by per-token position ids.

Positions are the GLOBAL ones (context parallelism keeps each token's original position;
reset-position-ids restarts them per document), so the table is indexed, never sliced.
"""
import torch


def rotary_frequencies(dim, base):
    """Inverse frequencies [dim/2] of the rotary embedding."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def apply_rotary(x, position_ids, rotary_dim, base):
    """Rotate the first ``rotary_dim`` channels of ``x`` [s, b, n, d] by ``position_ids`` [b, s].

    Uses the half-split (GPT-NeoX / Llama) convention: channel i pairs with i + rotary_dim/2.
    """
    inv_freq = rotary_frequencies(rotary_dim, base).to(x.device)  # [rd/2]
    angles = position_ids.t().float().unsqueeze(-1) * inv_freq  # [s, b, rd/2]
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).unsqueeze(2)  # [s, b, 1, rd]
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).unsqueeze(2)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # [s, b, n, rd]
    out = (rot.float() * cos + rotated * sin).to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
