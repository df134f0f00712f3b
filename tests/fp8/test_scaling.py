"""FP8 scales and payloads (megatron_cp/fp8/scaling.py, Fp8Meta) against a reference written
here from the formulas alone, bit for bit:

- tensorwise: ``scale = fp8_max / max(amax, 1e-12)``, divided in float64, rounded once to fp32;
- delayed: ``scale = fp8_max / amax / 2**margin`` from the amax history's newest entry
  (most_recent) or its max, the previous scale kept where that amax is 0 or not finite
  (a NaN in the history makes its max NaN, as ``amax`` over it does);
- the cast: ``x * scale`` in fp32, saturated to +-fp8_max, rounded to the nearest float8
  value, ties to the even code. The reference rounds by searching the format's own value
  table (every uint8 code read as float8), so it shares no conversion code with torch's cast.

Every payload the linear quantizes (input, weight, output gradient) is recorded from the
autograd function itself and compared as uint8. Also: the refusals of config/fp8.py, one
line naming the flag.
"""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

import megatron_cp.fp8.linear as fp8_linear_mod
from megatron_cp.fp8 import Fp8Meta, fp8_linear
from megatron_cp.fp8.linear import GRAD_OUTPUT, INPUT, WEIGHT
from training_utils import assert_refused

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": (E4M3, E4M3), "hybrid": (E4M3, E5M2)}


# ----------------------------------------------------------------------------- reference
def fp8_max(dtype):
    return {E4M3: 448.0, E5M2: 57344.0}[dtype]


def _value_table(dtype):
    """(finite non-negative values ascending [n] float64, their uint8 codes [n])."""
    codes = torch.arange(128, dtype=torch.uint8)  # sign bit clear
    values = codes.view(dtype).to(torch.float64)
    keep = torch.isfinite(values) & (values <= fp8_max(dtype))
    values, codes = values[keep], codes[keep]
    order = torch.argsort(values)
    return values[order], codes[order]


def reference_cast(x, scale, dtype):
    """uint8 codes of float8 ``dtype`` for ``x`` under fp32 ``scale``: saturate ``x * scale``
    (an fp32 product) to +-fp8_max, round to nearest, ties to the even code."""
    y = (x.to(torch.float32) * scale.to(torch.float32)).flatten()  # [N] fp32
    limit = fp8_max(dtype)
    sign = torch.signbit(y)
    mag = y.abs().to(torch.float64).clamp(max=limit)  # NaN stays NaN
    values, codes = _value_table(dtype)
    hi = torch.searchsorted(values, mag).clamp(max=len(values) - 1)  # first value >= mag
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0) & (hi != lo))
    out = torch.where(pick_hi, codes[hi], codes[lo]).to(torch.int32)
    nan_code = torch.tensor(0x7F, dtype=torch.int32)  # e4m3fn S.1111.111, e5m2 S.11111.11
    out = torch.where(torch.isnan(mag), nan_code, out)
    out = out | (sign.to(torch.int32) << 7)
    return out.to(torch.uint8).view(x.shape)


def reference_current_scale(amax, dtype):
    """Tensorwise scale of fp32 ``amax`` (a float)."""
    return torch.tensor(fp8_max(dtype) / max(amax, 1e-12), dtype=torch.float64).float()


def reference_delayed_scale(history, previous, dtype, margin, algo):
    """Delayed scale from ``history`` (floats, newest first)."""
    amax = history[0] if algo == "most_recent" else \
        (math.nan if any(math.isnan(a) for a in history) else max(history))
    if amax <= 0 or not math.isfinite(amax):
        return previous.clone()
    return torch.tensor(fp8_max(dtype) / amax / 2.0 ** margin, dtype=torch.float64).float()


# ----------------------------------------------------------------------------- helpers
def make_meta(fmt, recipe, wgrad=True, margin=0, history=1, algo="most_recent"):
    config = SimpleNamespace(fp8=fmt, fp8_recipe=recipe, fp8_wgrad=wgrad, fp8_margin=margin,
                             fp8_amax_history_len=history, fp8_amax_compute_algo=algo)
    return Fp8Meta(config, ((), (), ())).train()


@contextlib.contextmanager
def recorded_casts():
    """Every ``quantize(x, scale, dtype)`` the linear makes, in order: (x, scale, dtype, q)."""
    calls, real = [], fp8_linear_mod.quantize

    def record(x, scale, dtype):
        q = real(x, scale, dtype)
        calls.append((x.detach().clone(), scale.detach().clone(), dtype, q))
        return q
    fp8_linear_mod.quantize = record
    try:
        yield calls
    finally:
        fp8_linear_mod.quantize = real


def run_linear(meta, x, w, g):
    """Forward and backward of one FP8 linear; (out, dx, dW, the three casts by role)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with recorded_casts() as calls:
        out = fp8_linear(x, w, None, meta)
        out.backward(g)
    assert [c[2] for c in calls] == [meta.fwd_dtype, meta.fwd_dtype, meta.bwd_dtype]
    return out, x.grad, w.grad, dict(zip((INPUT, WEIGHT, GRAD_OUTPUT), calls))


def assert_cast_exact(call):
    x, scale, dtype, q = call
    assert q.dtype == dtype
    assert torch.equal(q.view(torch.uint8), reference_cast(x, scale, dtype))


def tensors(m=24, k=40, n=16, seed=0, x_scale=1.0, g_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * x_scale
    w = torch.randn(n, k, generator=gen) * 0.05
    g = torch.randn(m, n, generator=gen) * g_scale
    return x, w, g


# ----------------------------------------------------------------------------- tests
def test_reference_cast_matches_the_value_table_on_every_code():
    """The reference itself: every finite float8 value casts to its own code, and values
    halfway between neighbours go to the even code."""
    for dtype in (E4M3, E5M2):
        values, codes = _value_table(dtype)
        one = torch.ones(())
        assert torch.equal(reference_cast(values.float(), one, dtype), codes)
        assert torch.equal(reference_cast(-values.float(), one, dtype), codes | 0x80)
        mids = ((values[1:] + values[:-1]) / 2).float()  # exact in fp32 for these formats
        expect = torch.where(codes[1:] % 2 == 0, codes[1:], codes[:-1])
        assert torch.equal(reference_cast(mids, one, dtype), expect)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_tensorwise_scales_and_payloads_are_exact(fmt):
    """Each tensor's scale from its own amax, every cast bitwise the reference's, with
    saturation-free scaling (amax maps to fp8_max), subnormals and an all-zero gradient."""
    meta = make_meta(fmt, "tensorwise")
    for seed, x_scale, g_scale in ((0, 1.0, 1.0), (1, 1e3, 1e-6), (2, 1e-30, 0.0)):
        x, w, g = tensors(seed=seed, x_scale=x_scale, g_scale=g_scale)
        _, _, _, casts = run_linear(meta, x, w, g)
        for role, tensor in ((INPUT, x), (WEIGHT, w), (GRAD_OUTPUT, g)):
            src, scale, dtype, _ = casts[role]
            assert torch.equal(src, tensor)
            amax = tensor.abs().max().item()
            assert torch.equal(scale, reference_current_scale(amax, dtype)), (role, amax)
            assert_cast_exact(casts[role])
        if g_scale == 0.0:  # an all-zero tensor: scale fp8_max / 1e-12, payload all (signed) zeros
            assert casts[GRAD_OUTPUT][3].float().eq(0).all()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_cast_saturates_and_rounds_to_nearest_even(fmt):
    """Under a fixed scale: values beyond fp8_max (and inf) saturate, NaN stays NaN, -0 and
    underflows keep their sign, ties go to even; compared over a sweep of magnitudes."""
    from megatron_cp.fp8 import quantize
    for dtype in FORMATS[fmt]:
        big = fp8_max(dtype)
        x = torch.cat([torch.logspace(-12, 7, 4001), torch.tensor([big, big * 1.01, 1e30,
                       math.inf, 0.0, -0.0, 1e-45])])
        x = torch.cat([x, -x])
        for scale in (1.0, 0.37, 3.0e5):
            s = torch.tensor(scale, dtype=torch.float32)
            q = quantize(x, s, dtype)
            assert torch.equal(q.view(torch.uint8), reference_cast(x, s, dtype))
        sat = quantize(torch.tensor([math.inf, -math.inf, 1e30]), torch.ones(()), dtype).float()
        assert sat.tolist() == [big, -big, big]
        assert torch.isnan(quantize(torch.tensor([math.nan]), torch.ones(()), dtype).float()).all()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_delayed_history_over_steps(fmt, algo):
    """Delayed scaling with a 3-step history and margin 1 over several steps: each step's
    casts use the scale the previous update() left (1 at the start), the history holds the
    step's amaxes newest first, and a step whose amax is 0, inf or NaN keeps the old scale."""
    meta = make_meta(fmt, "delayed", margin=1, history=3, algo=algo)
    history = {role: [0.0, 0.0, 0.0] for role in (INPUT, WEIGHT, GRAD_OUTPUT)}
    scales = {role: torch.ones((), dtype=torch.float32) for role in history}
    steps = [(0, 1.0, 1.0), (1, 4.0, 1e-3), (2, 0.25, 1e2), (3, 0.0, 1.0), (4, 2.0, 0.0),
             (5, 1.0, math.inf), (6, 0.5, math.nan), (7, 3.0, 1.0)]
    for seed, x_scale, g_scale in steps:
        x, w, g = tensors(seed=seed, x_scale=x_scale, g_scale=1.0)
        if not math.isfinite(g_scale):
            g[0, 0] = g_scale  # one inf / NaN element: the step's amax is not finite
        else:
            g = g * g_scale
        _, _, _, casts = run_linear(meta, x, w, g)
        for role, tensor in ((INPUT, x), (WEIGHT, w), (GRAD_OUTPUT, g)):
            assert torch.equal(casts[role][1], scales[role]), (seed, role)
            if torch.isfinite(tensor).all():
                assert_cast_exact(casts[role])
            amax = tensor.abs().max().item()
            history[role] = [amax] + history[role][:-1]
            scales[role] = reference_delayed_scale(history[role], scales[role],
                                                   meta.dtype(role), 1, algo)
        meta.end_step()
        for role in history:
            got = meta.amax_history[role]
            want = torch.tensor(history[role], dtype=torch.float32)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got[~got.isnan()], want[~want.isnan()]), (seed, role)
            assert torch.equal(meta.scale[role], scales[role]), (seed, role, algo)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_delayed_update_keeps_the_scale_where_amax_is_not_usable(fmt):
    """update() alone: a fresh amax sets fp8_max / amax / 2**margin (margin 2), then 0, inf
    and NaN each keep the previous scale (most_recent, history 1)."""
    meta = make_meta(fmt, "delayed", margin=2)
    for amax in (3.5, 0.0, math.inf, math.nan, 1e-20, 7e4):
        previous = meta.scale.clone()
        meta.step_amax.fill_(amax)
        amax = meta.step_amax[0].item()  # as the fp32 buffer holds it
        meta.update()
        for role in (INPUT, WEIGHT, GRAD_OUTPUT):
            want = reference_delayed_scale([amax], previous[role], meta.dtype(role), 2,
                                           "most_recent")
            assert torch.equal(meta.scale[role], want), (amax, role)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_no_fp8_wgrad_keeps_the_weight_gradient_in_high_precision(recipe):
    """--no-fp8-wgrad: dW = dy^T x in the input's precision (bitwise the plain matmul), the
    output and dx unchanged from the FP8-wgrad run."""
    x, w, g = tensors(seed=3)
    out8, dx8, dw8, _ = run_linear(make_meta("hybrid", recipe), x, w, g)
    out, dx, dw, _ = run_linear(make_meta("hybrid", recipe, wgrad=False), x, w, g)
    assert torch.equal(dw, g.t() @ x) and not torch.equal(dw, dw8)
    assert torch.equal(out, out8) and torch.equal(dx, dx8)


BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --mock-data --vocab-size 200 "
        "--train-iters 2 --fp8-format hybrid ")


@pytest.mark.parametrize("extra,line,world", [
    ("--fp8-recipe mxfp8", "--fp8-recipe mxfp8: MXFP8", 1),
    ("--fp8-recipe blockwise", "--fp8-recipe blockwise: blockwise scaling", 1),
    ("--fp8-recipe custom", "--fp8-recipe custom: a custom quantizer", 1),
    ("--first-last-layers-bf16", "--first-last-layers-bf16 (True) is not supported with "
                                 "--fp8-recipe 'delayed'", 1),
    ("--fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-start-in-bf16 3 "
     "--pipeline-model-parallel-size 2", "--num-layers-at-start-in-bf16 (3) must be between 0 "
                                         "and the number of layers per pipeline stage (2)", 2),
    ("--fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-end-in-bf16 -1",
     "--num-layers-at-end-in-bf16 (-1) must be between 0", 1),
    ("--fp8-amax-history-len 0", "--fp8-amax-history-len (0) must be >= 1", 1),
    ("--fp8-recipe tensorwise --tp-comm-overlap --tensor-model-parallel-size 2 "
     "--sequence-parallel", "fp8 with --tp-comm-overlap (True)", 2),
])
def test_refusals_are_one_line_naming_the_flag(extra, line, world):
    assert_refused(BASE + extra, line, world_size=world)
