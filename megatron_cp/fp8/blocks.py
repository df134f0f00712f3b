"""Block-scaled FP8: Megatron-LM's ``--fp8-recipe blockwise`` (Transformer Engine's
Float8BlockScaling) and ``--fp8-recipe mxfp8`` (MXFP8BlockScaling), without Transformer Engine.

Each block of a tensor has its own scale, a power of 2, from the block's amax (NaN elements
skipped, as TE's fmaxf reductions skip them):

- blockwise: 1 x 128 blocks along the last dim for inputs and output gradients, 128 x 128
  blocks for weights; ``scale = fp8_max / amax`` rounded to fp32, then down to a power of 2
  (its mantissa bits cleared), 2^127 where that quotient overflows fp32, 1 where the amax is 0
  or inf (TE's compute_scale_from_amax with power-of-2 scales and amax_epsilon 0);
- mxfp8: 1 x 32 blocks everywhere (weights too, one copy per GEMM direction) with E8M0
  scales: the block's ``amax * (1 / fp8_max)`` (an fp32 product, the reciprocal an fp32
  constant) rounded UP to a power of 2 in E8M0's range [2^-127, 2^127] (TE's float_to_e8m0:
  0 gives 2^-127, inf 2^127); an element is multiplied by the reciprocal of that power.

The cast is the tensorwise one (scaling.quantize): ``x * scale`` in fp32, saturated to
+-fp8_max, rounded to nearest-even. A partial block (a dim not a multiple of the block) is
the block's existing elements, as TE's kernels bound their loads. The wgrad GEMM contracts
the tokens, so it takes x and dy quantized a second time, from high precision, in blocks
along the token dim ("columnwise", TE's name): :func:`quantize_1d` of the transposed tensor
with the tokens' one-process coordinates (megatron_cp/fp8/rows.py), so that a block holds
the tokens one process groups whatever the layout, its amax reduced over the ranks holding
them (CP).

GEMMs (:func:`block_matmul`): on the CPU the dequantized operands are exact in fp32 (an FP8
value over a power of 2) and one fp32 matmul multiplies them, so the only error is fp32
summation's; on a GPU ``torch.nn.functional.scaled_mm`` with BlockWise1x128 /
BlockWise128x128 scales (Hopper) or BlockWise1x32 E8M0 scales (Blackwell), checked against
the CPU reference by tools/gpu_check_fp8.py.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_cp.config.fp8 import BLOCK_LENGTH
from megatron_cp.fp8.scaling import fp8_max, quantize, reduce_max

def _abs_skipping_nan(x):
    """|x| in fp32 with NaN as 0: the amax TE's fmaxf reductions compute skips NaN."""
    a = x.detach().abs().to(torch.float32)
    return a.masked_fill(torch.isnan(a), 0.0)


def power2_scale(amax, dtype):
    """Float8BlockScaling's scale of fp32 ``amax`` (any shape): ``fp8_max / amax`` rounded
    to fp32, its mantissa cleared (down to a power of 2); 2^127 where the quotient overflows
    fp32; 1 where amax is 0 or inf."""
    quotient = (fp8_max(dtype) / amax.to(torch.float64)).to(torch.float32)
    quotient = torch.where(torch.isinf(quotient), 2.0 ** 127, quotient)
    scale = (quotient.view(torch.int32) & -0x800000).view(torch.float32)  # sign and exponent
    return torch.where((amax == 0) | torch.isinf(amax), 1.0, scale)


def e8m0_exponent(amax, dtype):
    """MXFP8's biased E8M0 exponent (int32, 0..254) of fp32 ``amax``: ``amax * (1/fp8_max)``
    in fp32, rounded up to a power of 2, saturated to [2^-127, 2^127]."""
    reciprocal = torch.tensor(1.0 / fp8_max(dtype), dtype=torch.float32)
    bits = (amax.to(torch.float32) * reciprocal).view(torch.int32)
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    # a subnormal product above 2^-127 rounds up to 2^-126; a normal one with any mantissa
    # bit up by one power, but 2^127 is the largest finite E8M0 value (inf lands there too)
    up = (mantissa > 0) & (exponent < 254) & ((exponent > 0) | (mantissa > 0x400000))
    return torch.where(exponent == 255, 254, exponent + up.to(torch.int32))


def e8m0_scale(amax, dtype):
    """MXFP8's scale (the multiplier, fp32): ``2^(127 - e8m0_exponent)``."""
    return torch.exp2(127.0 - e8m0_exponent(amax, dtype).to(torch.float64)).to(torch.float32)


SCALE_RULES = {"blockwise": power2_scale, "mxfp8": e8m0_scale}


@dataclass
class Blocked:
    """A block-scaled FP8 tensor: ``data`` float8 [r, c] stands for ``data / scale`` blockwise.

    ``scale`` fp32 [row blocks, column blocks] (powers of 2) and ``amax`` the same shape (the
    blocks' amaxes, whole over the ranks holding pieces of a block); ``block`` (rows,
    columns) of one block; ``columns`` int64 [c] or None: each column's block column when
    the columns are tokens in a layout's own order (None: column j is in block j // bc)."""
    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    block: tuple
    columns: torch.Tensor | None = None

    def dequantize(self):
        """The fp32 values it stands for, exactly: an FP8 value over a power of 2."""
        scales = _element_scales(self.scale, self.block, self.data.shape, self.columns)
        return self.data.to(torch.float32) / scales

    def t(self):
        """The transpose (a 128 x 128 weight's copy for the dgrad GEMM: the same blocks)."""
        assert self.columns is None
        return Blocked(self.data.t(), self.scale.t(), self.amax.t(), self.block[::-1])


def _element_scales(scale, block, shape, columns=None):
    """Block ``scale`` [row blocks, column blocks] expanded to one per element ``shape``."""
    (br, bc), (r, c) = block, shape
    s = scale.repeat_interleave(br, dim=0)[:r]
    return s[:, columns] if columns is not None else s.repeat_interleave(bc, dim=1)[:, :c]


def _padded(a, length, dim):
    pad = -a.shape[dim] % length
    if not pad:
        return a
    return F.pad(a, (0, pad) if dim == 1 else (0, 0, 0, pad))


def quantize_1d(x, length, dtype, recipe, tokens=None, groups=()):
    """``x`` [r, c] in 1 x ``length`` blocks along its last dim.

    ``tokens`` (int64 [c] or None): the columns' one-process coordinates when they are
    tokens (-1: a pad token, no token of the logical tensor: its own block, never reduced);
    the block of a column is ``tokens // length``, and each block's amax is the MAX over
    ``groups`` (the ranks holding the other tokens of the microbatch: CP)."""
    a = _abs_skipping_nan(x)  # [r, c]
    r, c = a.shape
    columns = None
    if tokens is None:
        amax = _padded(a, length, 1).view(r, -1, length).amax(dim=-1)  # [r, c / length]
    else:
        ranks = math.prod(dist.get_world_size(g) for g in groups if g is not None)
        num_blocks = -(-c * ranks // length)  # covers the logical tensor's rows on every rank
        columns = torch.where(tokens >= 0, tokens // length, num_blocks)  # [c]
        amax = torch.zeros(r, num_blocks + 1, dtype=torch.float32, device=a.device)
        amax.scatter_reduce_(1, columns.expand(r, c), a, "amax")  # [r, blocks + pad block]
        whole = reduce_max(amax[:, :num_blocks].contiguous(), groups)
        amax = torch.cat([whole, amax[:, num_blocks:]], dim=1)
    scale = SCALE_RULES[recipe](amax, dtype)
    data = quantize(x, _element_scales(scale, (1, length), x.shape, columns), dtype) \
        if columns is not None else _quantize_tiles(x, scale, (1, length), dtype)
    return Blocked(data, scale, amax, (1, length), columns)


def quantize_2d(x, length, dtype, recipe):
    """``x`` [r, c] in ``length`` x ``length`` blocks (blockwise's weights)."""
    a = _padded(_padded(_abs_skipping_nan(x), length, 0), length, 1)
    rb, cb = a.shape[0] // length, a.shape[1] // length
    amax = a.view(rb, length, cb, length).amax(dim=(1, 3))  # [rb, cb]
    scale = SCALE_RULES[recipe](amax, dtype)
    data = _quantize_tiles(x, scale, (length, length), dtype)
    return Blocked(data, scale, amax, (length, length))


def _quantize_tiles(x, scale, block, dtype):
    """``x`` [r, c] cast in whole blocks, each under its ``scale`` (no per-element copy)."""
    (br, bc), (r, c) = block, x.shape
    padded = _padded(_padded(x, br, 0), bc, 1)
    tiles = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    q = quantize(tiles, scale[:, None, :, None], dtype).view(padded.shape)
    return q if q.shape == x.shape else q[:r, :c].contiguous()


class BlockRecipe:
    """One block recipe's quantizations for the three GEMMs of ``y = x W^T``, each operand
    laid out [rows, contracted dim] for :func:`block_matmul`:

    - fprop ``y = x W^T``: :meth:`input` rowwise [m, k], :meth:`weight` fprop [n, k];
    - dgrad ``dx = dy W``: :meth:`grad` rowwise [m, n], :meth:`weight` dgrad [k, n];
    - wgrad ``dW = dy^T x``: :meth:`grad` columnwise [n, m], :meth:`input` columnwise [k, m]
      (token blocks; ``tokens``, ``groups``: see :func:`quantize_1d`)."""

    def __init__(self, name):
        self.name, self.length = name, BLOCK_LENGTH[name]

    def activation(self, t, dtype, columnwise, tokens=None, groups=()):
        """(rowwise, columnwise or None) of an input or output gradient ``t`` [m, n], both
        from ``t`` itself (never the one from the other)."""
        rowwise = quantize_1d(t, self.length, dtype, self.name)
        if not columnwise:
            return rowwise, None
        return rowwise, quantize_1d(t.t(), self.length, dtype, self.name, tokens, groups)

    input = grad = activation

    def weight(self, w, dtype):
        """(fprop [n, k], dgrad [k, n]) of ``w`` [n, k]: blockwise one 128 x 128 copy and its
        transpose; mxfp8 two 1 x 32 copies, along k and along n."""
        if self.name == "blockwise":
            square = quantize_2d(w, self.length, dtype, self.name)
            return square, square.t()
        return (quantize_1d(w, self.length, dtype, self.name),
                quantize_1d(w.t(), self.length, dtype, self.name))


def block_matmul(a, b, out_dtype):
    """``a @ b^T`` [m, n] of Blocked ``a`` [m, k] and ``b`` [n, k] (each blocked along k),
    accumulated in fp32, returned as ``out_dtype``: the reference on the CPU (exact
    operands, one fp32 matmul), scaled_mm on a GPU."""
    if a.data.device.type == "cuda":
        return _scaled_mm_blocks(a, b, out_dtype)
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _token_order(a, b):
    """Both wgrad operands with their token columns regrouped so each run of ``length``
    columns is one block (zero columns fill a block's missing tokens): the layout the GPU
    kernels read. Exact: the contraction sums the same products in another order. Pad tokens
    are left out: their output gradient is 0 (megatron_cp/fp8/rows.py), so are their terms."""
    length, num_blocks = a.block[1], a.scale.shape[1] - 1  # the last block column: pads
    real = torch.nonzero(a.columns < num_blocks).squeeze(1)
    order = real[torch.argsort(a.columns[real], stable=True)]
    blocks = a.columns[order]
    first = torch.searchsorted(blocks, blocks, side="left")
    slot = blocks * length + torch.arange(len(blocks), device=blocks.device) - first
    out = []
    for t in (a, b):
        data = torch.zeros(t.data.shape[0], num_blocks * length, dtype=torch.uint8,
                           device=t.data.device)
        data[:, slot] = t.data.view(torch.uint8)[:, order]
        out.append(Blocked(data.view(t.data.dtype), t.scale[:, :num_blocks],
                           t.amax[:, :num_blocks], t.block))
    return out


def _scaled_mm_blocks(a, b, out_dtype):
    """:func:`block_matmul` on a GPU: operands padded with zeros (scale 1) to whole 128
    tiles, the second column-major; blockwise scales outer-dim-major fp32 reciprocals,
    MXFP8 scales E8M0 in cuBLAS's 128 x 4 swizzled tiles."""
    if a.columns is not None:
        a, b = _token_order(a, b)
    m, n = a.data.shape[0], b.data.shape[0]
    a_data, b_data = (_padded(_padded(t.data.view(torch.uint8), 128, 0), 128, 1).view(t.data.dtype)
                      for t in (a, b))
    scales, recipes, swizzle = [], [], None
    for t, data in ((a, a_data), (b, b_data)):
        br, bc = t.block
        inverse = t.scale.reciprocal()
        rows, cols = data.shape[0] // br, data.shape[1] // bc
        inverse = F.pad(inverse, (0, cols - inverse.shape[1], 0, rows - inverse.shape[0]),
                        value=1.0)
        if bc == 32:  # MXFP8
            scales.append(_swizzled(inverse.to(torch.float8_e8m0fnu)))
            recipes.append(F.ScalingType.BlockWise1x32)
            swizzle = F.SwizzleType.SWIZZLE_32_4_4
        else:
            scales.append(inverse if br == 128 else inverse.t().contiguous().t())
            recipes.append(F.ScalingType.BlockWise128x128 if br == 128 else
                           F.ScalingType.BlockWise1x128)
    out = F.scaled_mm(a_data, b_data.t(), scales[0], recipes[0], scales[1], recipes[1],
                      swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=out_dtype)
    return out[:m, :n]


def _swizzled(scale):
    """E8M0 ``scale`` [rows, cols] (rows a multiple of 128) in cuBLAS's block-scaling
    layout: 128 x 4 tiles, each stored as 32 rows of (4 row groups x 4 columns)."""
    rows, cols = scale.shape
    scale = F.pad(scale.view(torch.uint8), (0, -cols % 4)).view(torch.float8_e8m0fnu)
    tiles = scale.view(rows // 128, 4, 32, -1, 4).permute(0, 3, 2, 1, 4)  # [R, C, 32, 4, 4]
    return tiles.contiguous().flatten()
