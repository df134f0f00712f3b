"""The block recipes (megatron_cp/fp8/blocks.py: --fp8-recipe blockwise and mxfp8) against a
reference written from Transformer Engine's rules, element by element in Python floats:

- blockwise (Float8BlockScaling: power-of-2 scales, amax_epsilon 0): a block's scale is
  ``fp8_max / amax`` rounded to fp32 (a quotient of two fp32 numbers computed in float64 and
  rounded once is the correctly rounded fp32 quotient), then the largest power of 2 not above
  it; 2^127 where the quotient overflows fp32; 1 for an amax of 0 or inf;
- mxfp8 (MXFP8BlockScaling): ``v = fp32(amax * fp32(1 / fp8_max))``, the E8M0 exponent
  ``ceil(log2 v)`` clamped to [-127, 127] (-127 for v = 0), the element multiplied by
  ``2^-exponent``;
- a block's amax skips NaN elements (TE reduces with fmaxf); a partial block is its existing
  elements; the cast is the table-searching reference of fp8_reference.py (saturating,
  nearest-even). Blocks: 1 x 128 rows and 128 x 128 weights (blockwise), 1 x 32 (mxfp8), the
  wgrad copies of x and dy in blocks along the tokens, made from x and dy themselves.

The GEMMs are held to fp32 accumulation's bound over the exact product of the reference's
dequantized operands. Token blocks under a layout (CP's zigzag halves and pad rows) are those
of one process's rows when their amax is reduced, and miss them when it is not.
"""
import math
import struct

import pytest
import torch

from dist_harness import run_workers
from fp8_reference import E4M3, E5M2, fp32_bound_ratio, fp8_max, make_meta, reference_cast
from megatron_cp.fp8 import fp8_linear
from megatron_cp.fp8.blocks import e8m0_scale, power2_scale, quantize_1d, quantize_2d

LENGTH = {"blockwise": 128, "mxfp8": 32}


def _f32(value):
    """``value`` rounded to the nearest fp32 (inf past fp32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def ref_power2_scale(amax, dtype):
    if amax == 0 or math.isinf(amax):
        return 1.0
    quotient = _f32(fp8_max(dtype) / amax)
    if math.isinf(quotient):
        return 2.0 ** 127
    return 2.0 ** (math.frexp(quotient)[1] - 1)


def ref_e8m0_scale(amax, dtype):
    v = _f32(amax * _f32(1.0 / fp8_max(dtype)))
    if v == 0:
        exponent = -127
    elif math.isinf(v):
        exponent = 127
    else:
        mantissa, exponent = math.frexp(v)
        exponent = exponent - 1 if mantissa == 0.5 else exponent  # ceil(log2 v)
        exponent = max(-127, min(127, exponent))
    return 2.0 ** -exponent


REF_SCALE = {"blockwise": ref_power2_scale, "mxfp8": ref_e8m0_scale}


def ref_quantize(x, recipe, dtype, block):
    """(uint8 codes [r, c], per-element scales [r, c] float64) of ``x`` in ``block`` blocks,
    block by block in Python."""
    r, c = x.shape
    br, bc = block
    scales = torch.empty(r, c, dtype=torch.float64)
    for i in range(0, r, br):
        for j in range(0, c, bc):
            piece = x[i:i + br, j:j + bc].to(torch.float64).abs()
            piece = piece[~torch.isnan(piece)]
            amax = _f32(piece.max().item()) if piece.numel() else 0.0
            scales[i:i + br, j:j + bc] = REF_SCALE[recipe](amax, dtype)
    return reference_cast(x, scales.to(torch.float32), dtype), scales


def _awkward(r, c, seed):
    """Rows of very different magnitudes, a zero block, subnormal fp32s, NaN and inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=gen) * torch.logspace(-30, 30, r).unsqueeze(1)
    x[:, :40] *= 1e-3
    x[0, :] = 0.0
    x[1, :] = 1e-44
    x[2, 5], x[3, 7], x[4, 9] = math.nan, math.inf, -math.inf
    return x


AMAXES = [0.0, math.inf, 1e-45, 1e-40, 2.0 ** -126, 1e-30, 3.0e-5, 0.1, 1.0, 448.0, 449.0,
          448.0 * 2 ** 20, 57344.0, 57344.0 * (1 + 2 ** -23), 3.4e38, 2.0 ** 127, 1.5 * 2 ** -127]


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_scales_follow_transformer_engines_rule(recipe):
    """Every amax kind: zero, inf, fp32 subnormals, exact powers and the edges around
    fp8_max, fp32's largest; plus a sweep."""
    gen = torch.Generator().manual_seed(0)
    sweep = (torch.rand(2000, generator=gen) * 260 - 140).exp2()
    amaxes = torch.cat([torch.tensor(AMAXES, dtype=torch.float32), sweep])
    rule = {"blockwise": power2_scale, "mxfp8": e8m0_scale}[recipe]
    for dtype in (E4M3, E5M2):
        got = rule(amaxes, dtype)
        want = torch.tensor([REF_SCALE[recipe](a, dtype) for a in amaxes.tolist()],
                            dtype=torch.float64)
        assert got.dtype == torch.float32
        assert torch.equal(got.double(), want), (recipe, dtype)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_block_payloads_are_the_references(recipe, dtype):
    """Rowwise blocks (and blockwise's 128 x 128) of a tensor whose dims are not multiples
    of the block: codes bitwise, and the dequantized values ``code / scale`` rounded once to
    fp32 (exact but where a tiny block's values are fp32 subnormals)."""
    length = LENGTH[recipe]
    x = _awkward(70, 200, seed=1)
    blocks = [(1, length)] + ([(length, length)] if recipe == "blockwise" else [])
    for block in blocks:
        q = quantize_1d(x, length, dtype, recipe) if block[0] == 1 else \
            quantize_2d(x, length, dtype, recipe)
        codes, scales = ref_quantize(x, recipe, dtype, block)
        assert torch.equal(q.data.view(torch.uint8), codes), block
        values = (q.data.to(torch.float64) / scales).float()
        finite = torch.isfinite(values)
        assert torch.equal(q.dequantize()[finite], values[finite])


def _operands(m, k, n, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    dy = (torch.randn(m, n, generator=gen) * torch.logspace(-3, 1, m).unsqueeze(1)).to(dtype)
    return x, w, dy


def _ref_values(t, recipe, dtype, block):
    codes, scales = ref_quantize(t, recipe, dtype, block)
    return codes.view(dtype).to(torch.float64) / scales


@pytest.mark.parametrize("recipe,fmt,dtype", [
    ("blockwise", "hybrid", torch.float32), ("blockwise", "e4m3", torch.bfloat16),
    ("mxfp8", "hybrid", torch.bfloat16), ("mxfp8", "e4m3", torch.float32)])
def test_linear_gemms_within_the_fp32_bound_of_the_references(recipe, fmt, dtype):
    """One FP8 linear: y from x's rowwise and W's blocks, dx from dy's rowwise and W's dgrad
    copy (blockwise: the same 128 x 128 blocks; mxfp8: W in blocks along n), dW from dy's and
    x's copies in blocks along the tokens; each within fp32 accumulation's bound."""
    length = LENGTH[recipe]
    meta = make_meta(fmt, recipe)
    fwd, bwd = meta.fwd_dtype, meta.bwd_dtype
    x, w, dy = _operands(136, 160, 72, seed=2, dtype=dtype)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_linear(xl, wl, None, meta)
    out.backward(dy)
    row = (1, length)
    w_block = (length, length) if recipe == "blockwise" else row
    wq = _ref_values(w, recipe, fwd, w_block)  # [n, k]
    w_dgrad = wq.t() if recipe == "blockwise" else _ref_values(w.t(), recipe, fwd, row)
    assert fp32_bound_ratio(out, _ref_values(x, recipe, fwd, row), wq.t()) <= 1
    assert fp32_bound_ratio(xl.grad, _ref_values(dy, recipe, bwd, row), w_dgrad.t()) <= 1
    dy_t, x_t = _ref_values(dy.t(), recipe, bwd, row), _ref_values(x.t(), recipe, fwd, row)
    assert fp32_bound_ratio(wl.grad, dy_t, x_t.t()) <= 1
    assert out.dtype == xl.grad.dtype == wl.grad.dtype == dtype


# ---------------------------------------------------------------- token blocks under CP
def _zigzag_rows(seq, cp_rank, cp_size, pad):
    """This rank's positions of a zigzag split of ``seq`` positions (two chunks), then
    ``pad`` pad positions (-1)."""
    chunk = seq // (2 * cp_size)
    mine = list(range(cp_rank * chunk, (cp_rank + 1) * chunk)) + \
        list(range((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk))
    return torch.tensor(mine + [-1] * pad)


def _cp_token_blocks(rank, world, recipe):
    """A rank's wgrad copy of its rows of x (rows s-major, b=2) in token blocks, put back at
    one-process rows and summed over the ranks: one process's (reduced) or not (local: the
    blocks of the rank's own row order)."""
    import torch.distributed as dist
    length, b, seq = LENGTH[recipe], 2, 96
    x = _awkward(seq * b, 40, seed=3)[:, :40]  # [s * b, k], one process's rows
    positions = _zigzag_rows(seq, rank, world, pad=3)
    tokens = (positions.unsqueeze(1) * b + torch.arange(b)).reshape(-1)  # [s_local * b]
    tokens = torch.where(positions.repeat_interleave(b) >= 0, tokens, -1)
    local = torch.where(tokens.unsqueeze(1) >= 0, x[tokens.clamp(min=0)], 0.0)  # [rows, k]
    out = {}
    for name, marks in (("reduced", tokens), ("local", None)):  # local: blocks of own rows
        q = quantize_1d(local.t(), length, E4M3, recipe, marks, (dist.group.WORLD,))
        values = torch.full((x.shape[1], x.shape[0]), math.nan)
        real = tokens >= 0
        values[:, tokens[real]] = q.dequantize()[:, real]
        gathered = [torch.empty_like(values) for _ in range(world)]
        dist.all_gather(gathered, values)
        out[name] = torch.stack(gathered).nan_to_num(0).sum(0).nan_to_num(0)
    one = quantize_1d(x.t(), length, E4M3, recipe).dequantize().nan_to_num(0)
    return {name: torch.equal(v, one) for name, v in out.items()}


def _two_ranks(rank, world):
    """Both checks that need two ranks, in one pair of processes."""
    return {"cp": {recipe: _cp_token_blocks(rank, world, recipe) for recipe in LENGTH},
            "shards": _shard_refusals(rank, world)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(_two_ranks, 2)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_token_blocks_are_one_process_blocks_under_cp(two_ranks, recipe):
    """CP2: each rank holds two zigzag chunks of the sequence and pad rows: with the tokens'
    one-process rows and the block amaxes reduced over CP, every token's wgrad copy is one
    process's, bit for bit; blocks of each rank's own rows miss it."""
    for rank in two_ranks:
        assert rank["cp"][recipe] == {"reduced": True, "local": False}, rank


# ---------------------------------------------------------------- start-up refusals
def _shard_refusals(rank, world):
    import torch.distributed as dist
    from megatron_cp.fp8.model import check_block_shard
    from megatron_cp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, normal_init
    group = dist.group.WORLD
    args = dict(tp_group=group, init_method=normal_init(0.02), seed=1)
    linears = {"qkv": ColumnParallelLinear(64, 192, **args),  # 96 rows a rank
               "fc1": ColumnParallelLinear(64, 256, stride=2, **args),  # gate, up: 64 each
               "proj": RowParallelLinear(256, 64, **args)}  # 128 columns a rank
    holder = torch.nn.ModuleDict(linears)
    out = {}
    for recipe in ("blockwise", "mxfp8"):
        for name, linear in linears.items():
            try:
                check_block_shard(recipe, linear, holder)
                out[recipe, name] = None
            except ValueError as error:
                out[recipe, name] = str(error)
    return out


def test_a_tp_shard_that_cuts_a_block_is_refused(two_ranks):
    """TP2: a column-parallel shard of 96 rows, SwiGLU's fc1 with gate and up pieces of 64
    each, a row-parallel shard of 128 columns."""
    out = two_ranks[0]["shards"]
    assert out["blockwise", "qkv"].startswith(
        "--fp8-recipe blockwise: qkv's output dim is split over --tensor-model-parallel-size 2 "
        "into pieces of 96, not a multiple of the 128-element block")
    assert "fc1's output dim" in out["blockwise", "fc1"] and "pieces of 64" in out["blockwise", "fc1"]
    assert out["blockwise", "proj"] is None
    assert all(out["mxfp8", name] is None for name in ("qkv", "fc1", "proj"))


@pytest.mark.parametrize("recipe,capability,refused", [
    ("blockwise", (8, 9), True), ("blockwise", (9, 0), False), ("blockwise", (10, 0), True),
    ("mxfp8", (9, 0), True), ("mxfp8", (10, 0), False), ("mxfp8", (12, 0), False)])
def test_a_gpu_without_the_recipes_kernels_is_refused(recipe, capability, refused):
    import megatron_cp.fp8.model as fp8_model
    fp8_model.check_block_device(recipe, None, "cpu")  # the CPU runs the exact reference
    try:
        fp8_model.check_block_device(recipe, capability, "NVIDIA X")
    except ValueError as error:
        assert refused and str(error).startswith(f"--fp8-recipe {recipe} needs a "), error
        assert "NVIDIA X is compute capability" in str(error)
        return
    assert not refused
