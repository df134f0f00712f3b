"""Rotary position embedding (RoPE, and YaRN's rescaled RoPE) driven by per-token position ids.

Positions are the GLOBAL ones (context parallelism keeps each token's original position;
reset-position-ids restarts them per document), so the angles are computed from the ids,
never sliced from a table.

Two pairings of channels, Megatron-LM's two conventions:

- half-split (GPT-NeoX / Llama, the default): channel i pairs with i + rotary_dim/2;
- interleaved (RoFormer / GPT-J, ``--rotary-interleaved``): channel 2i pairs with 2i + 1.

Both channels of a pair turn by the same angle, so only the half-dim cos and sin are built
(:meth:`RotaryEmbedding.cos_sin`, once per attention call, shared by q and k). :func:`rotate`
applies them with the arithmetic in fp32 (as the angles are) and writes each half straight
into one output of the input's dtype: no ``torch.cat``, no fp32 copy of the input, and
backward saves only cos and sin.

YaRN (``--position-embedding-type yarn``, Peng et al. 2023, Megatron-LM's
``YarnRotaryEmbedding``) blends each frequency between the original one (fast-turning
channels, kept) and the one divided by ``--rotary-scaling-factor`` (slow channels,
interpolated), with a linear ramp between the channels that turn ``beta_fast`` and
``beta_slow`` times over ``--yarn-original-max-position-embeddings`` positions, and multiplies
cos and sin by the concentration factor (Megatron's "mscale"), so the attention logits grow
by its square.

Llama 3.1's scaling (``--use-rope-scaling``, Megatron-LM's ``rope_scaling``, Hugging Face's
"llama3" rope type) divides the frequencies whose wavelength exceeds the original context
(8192 positions) by ``--rope-scaling-factor``, keeps those shorter than a quarter of it, and
blends the two linearly in the number of turns over the original context in between.
``--rotary-seq-len-interpolation-factor`` (position interpolation) turns every position p
by the angles of p / factor instead.
"""
import math

import torch


def rotary_frequencies(dim, base, device=None):
    """Inverse frequencies [dim/2] (fp32) of the rotary embedding, made on ``device``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim  # [dim/2]
    return 1.0 / (base ** exponents)


# Megatron-LM's (and Llama 3.1's) fixed constants of the llama3 scaling
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192


def llama3_frequencies(dim, base, factor, device=None, low_freq_factor=LLAMA3_LOW_FREQ_FACTOR,
                       high_freq_factor=LLAMA3_HIGH_FREQ_FACTOR,
                       original_max_positions=LLAMA3_ORIGINAL_MAX_POSITIONS):
    """Llama 3.1's inverse frequencies [dim/2] (fp32): RoPE's, divided by ``factor`` where the
    wavelength is longer than ``original_max_positions / low_freq_factor``, kept where it is
    shorter than ``original_max_positions / high_freq_factor``, and in between the mix
    (1 - t) f / factor + t f with t = (original / wavelength - low) / (high - low)."""
    freqs = rotary_frequencies(dim, base, device)  # [dim/2]
    wavelengths = 2 * math.pi / freqs
    long_limit = original_max_positions / low_freq_factor  # slower than this: interpolated
    short_limit = original_max_positions / high_freq_factor  # faster than this: kept
    divided = torch.where(wavelengths > long_limit, freqs / factor, freqs)
    turns = (original_max_positions / wavelengths - low_freq_factor) / \
        (high_freq_factor - low_freq_factor)
    mixed = (1 - turns) * divided / factor + turns * divided
    between = (wavelengths >= short_limit) & (wavelengths <= long_limit)
    return torch.where(between, mixed, divided)


def _yarn_correction_dim(num_rotations, dim, base, original_max_positions):
    """The (fractional) channel pair whose frequency turns ``num_rotations`` times over
    ``original_max_positions`` positions."""
    return dim * math.log(original_max_positions / (num_rotations * 2 * math.pi)) / \
        (2 * math.log(base))


def yarn_frequencies(dim, base, scaling_factor, original_max_positions, beta_fast, beta_slow,
                     round_to_int=True, device=None):
    """YaRN's inverse frequencies [dim/2] (fp32): the pairs below the ramp keep the RoPE
    frequency, those above it take it divided by ``scaling_factor``, linearly in between.

    The ramp runs from the pair that turns ``beta_fast`` times over the original context to
    the one that turns ``beta_slow`` times (ends floored / ceiled when ``round_to_int``),
    clamped to the channel range, as Megatron-LM and Hugging Face compute it."""
    low = _yarn_correction_dim(beta_fast, dim, base, original_max_positions)
    high = _yarn_correction_dim(beta_slow, dim, base, original_max_positions)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp: no division by zero
    pairs = torch.arange(dim // 2, dtype=torch.float32, device=device)  # [dim/2]
    kept = 1 - ((pairs - low) / (high - low)).clamp(0, 1)  # 1: keep, 0: interpolate
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    # the same operations, in the same order, as the reference implementations
    return 1.0 / (scaling_factor * powers) * (1 - kept) + 1.0 / powers * kept


def yarn_mscale(scaling_factor, mscale=1.0):
    """YaRN's m(k) = 0.1 k ln(scaling_factor) + 1 for k = ``mscale``, and 1 when the factor
    does not stretch the context (<= 1)."""
    if scaling_factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def yarn_concentration_factor(scaling_factor, mscale=1.0, mscale_all_dim=0.0):
    """YaRN's factor on cos and sin (Megatron's "mscale", Hugging Face's "attention_factor"):
    m(mscale) / m(mscale_all_dim) with :func:`yarn_mscale`'s m."""
    return yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim)


def rotary_cos_sin(position_ids, rotary_dim, base, inv_freq=None, scale=1.0,
                   interpolation=None):
    """(cos, sin), each [s, b, 1, rotary_dim/2] fp32, of the angles of ``position_ids`` [b, s]
    (``inv_freq``: the frequencies, default plain RoPE's; ``scale``: a factor on both;
    ``interpolation``: the positions are divided by it first, as 1/factor times them)."""
    if inv_freq is None:
        inv_freq = rotary_frequencies(rotary_dim, base, position_ids.device)  # [rd/2]
    positions = position_ids.t().unsqueeze(-1).float()  # [s, b, 1]
    if interpolation is not None:
        positions = positions * (1 / interpolation)
    angles = positions * inv_freq  # [s, b, rd/2]
    angles = angles.unsqueeze(2)  # [s, b, 1, rd/2]: broadcast over heads
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


class RotaryEmbedding:
    """The rotary embedding a config describes (``position_embedding_type`` rope or yarn,
    ``rotary_percent``, ``rotary_interleaved``, the YaRN settings, Llama 3.1's scaling and
    position interpolation) for heads of ``head_dim``; ``yarn`` / ``interleaved`` (None: from
    the config) let MLA choose its own (plain RoPE or YaRN, as Megatron-LM's MLA).

    :meth:`cos_sin` builds the angles' cos and sin of a batch's positions (YaRN's concentration
    factor included), :meth:`rotate` turns q or k by them."""

    def __init__(self, config, head_dim, yarn=None, interleaved=None):
        self.config, self.dim = config, int(head_dim * config.rotary_percent)
        self.base = config.rotary_base
        # MLA passes its own choice (--rope-type, interleaved pairs); others follow the config
        self.interleaved = config.rotary_interleaved if interleaved is None else interleaved
        self.yarn = config.position_embedding_type == "yarn" if yarn is None else yarn
        self.scale = yarn_concentration_factor(config.rotary_scaling_factor, config.mscale,
                                               config.mscale_all_dim) if self.yarn else 1.0
        own = yarn is None and not self.yarn  # the model's plain RoPE, not MLA's or YaRN
        self.llama3_factor = config.rope_scaling_factor if own and config.use_rope_scaling \
            else None
        self.interpolation = config.rotary_seq_len_interpolation_factor if own else None

    def frequencies(self, device=None):
        """The inverse frequencies [rotary_dim/2] (fp32) on ``device``."""
        if self.llama3_factor is not None:
            return llama3_frequencies(self.dim, self.base, self.llama3_factor, device)
        if not self.yarn:
            return rotary_frequencies(self.dim, self.base, device)
        c = self.config
        return yarn_frequencies(self.dim, self.base, c.rotary_scaling_factor,
                                c.yarn_original_max_position_embeddings, c.yarn_beta_fast,
                                c.yarn_beta_slow, c.yarn_correction_range_round_to_int, device)

    def cos_sin(self, position_ids):
        """(cos, sin), each [s, b, 1, rotary_dim/2] fp32, for ``position_ids`` [b, s]."""
        return rotary_cos_sin(position_ids, self.dim, self.base,
                              self.frequencies(position_ids.device), self.scale,
                              self.interpolation)

    def rotate(self, x, cos, sin):
        """``x`` [s, b, n, d] turned by :meth:`cos_sin`'s (cos, sin) in this embedding's
        pairing of channels."""
        return rotate(x, cos, sin, self.interleaved)


def _addcmul_into(out, x, y, z, value):
    """out[...] = x + value * y * z, computed in the inputs' promoted dtype, cast on the write.

    Eager: ``out=`` writes the strided view directly (no temporary). Under torch.compile,
    which does not trace ``out=`` into a strided view, a copy that inductor fuses instead.
    """
    if torch.compiler.is_compiling():
        out.copy_(torch.addcmul(x, y, z, value=value))
    else:
        torch.addcmul(x, y, z, value=value, out=out)


def _pairs(x, half, interleaved):
    """The two channels of every rotated pair of ``x`` [..., d], as views [..., half] each:
    (i, i + half) split in halves, or (2i, 2i + 1) interleaved."""
    if interleaved:
        return x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    return x[..., :half], x[..., half:2 * half]


def _rotate_into(out, x, cos, sin, sign, interleaved):
    """out = x with each pair (x1, x2) of its first 2 x half channels turned by ``sign`` x angle:
    (x1 cos - sign x2 sin, x2 cos + sign x1 sin); the channels past them are copied.

    The products promote to fp32 (cos, sin are fp32) and are cast once, when written to ``out``.
    """
    half = cos.shape[-1]
    x1, x2 = _pairs(x, half, interleaved)  # views, [s, b, n, rd/2] each
    out1, out2 = _pairs(out, half, interleaved)
    _addcmul_into(out1, x1 * cos, x2, sin, -sign)
    _addcmul_into(out2, x2 * cos, x1, sin, sign)
    if x.shape[-1] > 2 * half:  # --rotary-percent < 1: the rest passes through
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


class _Rotate(torch.autograd.Function):
    """Forward: turn each channel pair by its angle. Backward: turn the gradient by minus the
    angle (a rotation's transpose is its inverse). Saves cos and sin only."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate_into(torch.empty_like(x), x, cos, sin, 1.0, interleaved)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad_x = _rotate_into(torch.empty_like(grad), grad, cos, sin, -1.0, ctx.interleaved)
        return grad_x, None, None, None


def rotate(x, cos, sin, interleaved=False):
    """``x`` [s, b, n, d] rotated by (cos, sin) [s, b, 1, rd/2] from :func:`rotary_cos_sin`;
    the first rd channels turn (pairs (i, i + rd/2), or (2i, 2i + 1) when ``interleaved``),
    the rest pass through. Returns a new tensor of x's dtype."""
    return _Rotate.apply(x, cos, sin, interleaved)


def apply_rotary(x, position_ids, rotary_dim, base, interleaved=False):
    """Rotate the first ``rotary_dim`` channels of ``x`` [s, b, n, d] by ``position_ids`` [b, s].

    One-tensor convenience; the attention layer builds cos/sin once for q and k instead.
    """
    cos, sin = rotary_cos_sin(position_ids, rotary_dim, base)
    return rotate(x, cos, sin, interleaved)
