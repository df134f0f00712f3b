"""Rotary position embedding (RoPE) driven by per-token position ids.

Positions are the GLOBAL ones (context parallelism keeps each token's original position;
reset-position-ids restarts them per document), so the angles are computed from the ids,
never sliced from a table.

Half-split (GPT-NeoX / Llama) convention: channel i pairs with i + rotary_dim/2, and both
channels of a pair turn by the same angle, so only the half-dim cos and sin are built
(:func:`rotary_cos_sin`, once per attention call, shared by q and k). :func:`rotate` applies
them with the arithmetic in fp32 (as the angles are) and writes each half straight into one
output of the input's dtype: no ``torch.cat``, no fp32 copy of the input, and backward saves
only cos and sin.
"""
import torch


def rotary_frequencies(dim, base, device=None):
    """Inverse frequencies [dim/2] (fp32) of the rotary embedding, made on ``device``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim  # [dim/2]
    return 1.0 / (base ** exponents)


def rotary_cos_sin(position_ids, rotary_dim, base):
    """(cos, sin), each [s, b, 1, rotary_dim/2] fp32, of the angles of ``position_ids`` [b, s]."""
    inv_freq = rotary_frequencies(rotary_dim, base, position_ids.device)  # [rd/2]
    angles = position_ids.t().unsqueeze(-1).float() * inv_freq  # [s, b, rd/2]
    angles = angles.unsqueeze(2)  # [s, b, 1, rd/2]: broadcast over heads
    return angles.cos(), angles.sin()


def _addcmul_into(out, x, y, z, value):
    """out[...] = x + value * y * z, computed in the inputs' promoted dtype, cast on the write.

    Eager: ``out=`` writes the strided view directly (no temporary). Under torch.compile,
    which does not trace ``out=`` into a strided view, a copy that inductor fuses instead.
    """
    if torch.compiler.is_compiling():
        out.copy_(torch.addcmul(x, y, z, value=value))
    else:
        torch.addcmul(x, y, z, value=value, out=out)


def _rotate_into(out, x, cos, sin, sign):
    """out = x with each pair (x1, x2) of its first 2 x half channels turned by ``sign`` x angle:
    (x1 cos - sign x2 sin, x2 cos + sign x1 sin); the channels past them are copied.

    The products promote to fp32 (cos, sin are fp32) and are cast once, when written to ``out``.
    """
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]  # views, [s, b, n, rd/2] each
    _addcmul_into(out[..., :half], x1 * cos, x2, sin, -sign)
    _addcmul_into(out[..., half:2 * half], x2 * cos, x1, sin, sign)
    if x.shape[-1] > 2 * half:  # --rotary-percent < 1: the rest passes through
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


class _Rotate(torch.autograd.Function):
    """Forward: turn each channel pair by its angle. Backward: turn the gradient by minus the
    angle (a rotation's transpose is its inverse). Saves cos and sin only."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate_into(torch.empty_like(x), x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate_into(torch.empty_like(grad), grad, cos, sin, -1.0), None, None


def rotate(x, cos, sin):
    """``x`` [s, b, n, d] rotated by (cos, sin) [s, b, 1, rd/2] from :func:`rotary_cos_sin`;
    the first rd channels turn, the rest pass through. Returns a new tensor of x's dtype."""
    return _Rotate.apply(x, cos, sin)


def apply_rotary(x, position_ids, rotary_dim, base):
    """Rotate the first ``rotary_dim`` channels of ``x`` [s, b, n, d] by ``position_ids`` [b, s].

    One-tensor convenience; the attention layer builds cos/sin once for q and k instead.
    """
    cos, sin = rotary_cos_sin(position_ids, rotary_dim, base)
    return rotate(x, cos, sin)
