"""The FP8 reference that tests/fp8/ and benchmarks/fp8.py check megatron_cp.fp8 against,
written from the formulas alone:

- tensorwise: ``scale = fp8_max / max(amax, 1e-12)``, divided in float64, rounded once to fp32;
- delayed: ``scale = fp8_max / amax / 2**margin`` from the amax history's newest entry
  (most_recent) or its max, the previous scale kept where that amax is 0 or not finite
  (a NaN in the history makes its max NaN, as ``amax`` over it does);
- the cast: ``x * scale`` in fp32, saturated to +-fp8_max, rounded to the nearest float8
  value, ties to the even code. The reference rounds by searching the format's own value
  table (every uint8 code read as float8), so it shares no conversion code with torch's cast;
- a GEMM: within fp32 accumulation's bound of the exact float64 product of the dequantized
  operands, ``k * 2**-24 * sum_j |a_ij||b_jk|`` per element (the classical dot-product bound,
  first order), plus the rounding of the result to its dtype (half an ulp: ``2**-24 |y|``
  for fp32, ``2**-8 |y|`` for bf16). ``q.double() / scale`` is exact (a float8 value over
  an fp32 scale has few enough bits).

The helpers run one FP8 linear (forward and backward) and record every cast it makes.
"""
import contextlib
import math
from types import SimpleNamespace

import torch

import megatron_cp.fp8.linear as fp8_linear_mod
from megatron_cp.fp8 import Fp8Meta, fp8_linear
from megatron_cp.fp8.linear import GRAD_OUTPUT, INPUT, WEIGHT

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = {"e4m3": (E4M3, E4M3), "hybrid": (E4M3, E5M2)}
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def fp8_max(dtype):
    return {E4M3: 448.0, E5M2: 57344.0}[dtype]


def value_table(dtype):
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
    values, codes = value_table(dtype)
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
    scale = torch.tensor(fp8_max(dtype) / amax / 2.0 ** margin, dtype=torch.float64).float()
    return scale if math.isfinite(scale) else previous.clone()  # overflowed fp32: keep


def make_meta(fmt, recipe, wgrad=True, margin=0, history=1, algo="most_recent"):
    config = SimpleNamespace(fp8=fmt, fp8_recipe=recipe, fp8_wgrad=wgrad, wgrad_in_fp8=wgrad, fp8_margin=margin,
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




def dequantized(call):
    """The float64 values a recorded cast stands for: ``q / scale``."""
    _, scale, _, q = call
    return q.to(torch.float64) / scale.to(torch.float64)


def fp32_bound_ratio(got, a, b):
    """max over elements of |got - a @ b| / bound (float64 ``a``, ``b``; ``got`` fp32 or
    bf16): <= 1 when ``got`` is within fp32 accumulation's bound (module docstring)."""
    exact = a @ b
    bound = a.shape[1] * 2.0 ** -24 * (a.abs() @ b.abs()) + \
        UNIT_ROUNDOFF[got.dtype] * got.to(torch.float64).abs()
    err = (got.to(torch.float64) - exact).abs()
    return (err / bound.clamp(min=1e-300)).max().item()


def linear_checks(fmt, recipe, shape, dtype=torch.float32, seed=0):
    """One FP8 linear of ``shape`` (m, k, n): (every cast bitwise the reference's and every
    scale the formula's, the worst GEMM error over its bound, forward and both backward),
    delayed on its second step (scales from the first step's amaxes)."""
    m, k, n = shape
    meta = make_meta(fmt, recipe)
    x, w, g = (t.to(dtype) for t in tensors(m, k, n, seed=seed))
    scales = {role: torch.ones(()) for role in (INPUT, WEIGHT, GRAD_OUTPUT)}
    if recipe == "delayed":
        run_linear(meta, x, w, g)
        meta.end_step()
        scales = {role: reference_delayed_scale([t.abs().max().float().item()], scales[role],
                                                meta.dtype(role), 0, "most_recent")
                  for role, t in ((INPUT, x), (WEIGHT, w), (GRAD_OUTPUT, g))}
    out, dx, dw, casts = run_linear(meta, x, w, g)
    exact = True
    for role, t in ((INPUT, x), (WEIGHT, w), (GRAD_OUTPUT, g)):
        want = scales[role] if recipe == "delayed" else \
            reference_current_scale(t.abs().max().float().item(), meta.dtype(role))
        src, scale, dtype8, q = casts[role]
        exact &= torch.equal(scale, want) and torch.equal(src, t) and \
            torch.equal(q.view(torch.uint8), reference_cast(src, scale, dtype8))
    xq, wq, gq = (dequantized(casts[role]) for role in (INPUT, WEIGHT, GRAD_OUTPUT))
    ratio = max(fp32_bound_ratio(out, xq, wq.t()), fp32_bound_ratio(dx, gq, wq),
                fp32_bound_ratio(dw, gq.t(), xq))
    return exact, ratio
