"""The FP8 GEMMs of megatron_cp.fp8.linear (forward, dgrad, wgrad) against the exact product
of their dequantized operands, and one linear against torchao's Float8Linear.

- Bound (tests/fp8/fp8_reference.py): fp32 accumulation over k terms errs by at most
  ``k * 2**-24 * sum_j |a_ij||b_jk|`` per element, plus the rounding to the output dtype;
  the exact product is float64 of ``q.double() / scale``.
- torchao (test-only, pinned in scripts/env.sh): its default Float8LinearConfig is dynamic
  tensorwise scaling with e4m3 inputs and weights and e5m2 output gradients, the same
  formulas as ``--fp8-format hybrid --fp8-recipe tensorwise``; output, dx and dW come out
  bitwise equal, fp32 and bf16 (both end in one torch._scaled_mm per GEMM with the same
  operands and scales).
"""
import pytest
import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from fp8_reference import dequantized, fp32_bound_ratio, make_meta, run_linear, tensors
from megatron_cp.fp8.linear import GRAD_OUTPUT, INPUT, WEIGHT


@pytest.mark.parametrize("fmt,recipe", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"),
                                        ("hybrid", "delayed"), ("e4m3", "delayed")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemms_within_the_fp32_accumulation_bound(fmt, recipe, dtype):
    """y = q(x) q(W)^T, dx = q(dy) q(W), dW = q(dy)^T q(x) each within the bound of the
    exact float64 product of the dequantized operands (delayed: on its second step, the
    scales from the first step's amaxes)."""
    meta = make_meta(fmt, recipe)
    x, w, g = (t.to(dtype) for t in tensors(m=48, k=96, n=40, seed=5))
    if recipe == "delayed":  # one step to move the scales off 1
        run_linear(meta, x, w, g)
        meta.end_step()
    out, dx, dw, casts = run_linear(meta, x, w, g)
    assert out.dtype == dx.dtype == dw.dtype == dtype
    xq, wq, gq = (dequantized(casts[role]) for role in (INPUT, WEIGHT, GRAD_OUTPUT))
    assert fp32_bound_ratio(out, xq, wq.t()) <= 1
    assert fp32_bound_ratio(dx, gq, wq) <= 1
    assert fp32_bound_ratio(dw, gq.t(), xq) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_linear_equals_torchao_float8_linear(dtype):
    """--fp8-format hybrid --fp8-recipe tensorwise against torchao's Float8Linear (default
    config) on the same weights, inputs and output gradient: output, dx, dW bitwise."""
    x, w, g = (t.to(dtype) for t in tensors(m=64, k=96, n=48, seed=7, x_scale=3.0))
    peer = torch.nn.Sequential(torch.nn.Linear(96, 48, bias=False, dtype=dtype))
    with torch.no_grad():
        peer[0].weight.copy_(w)
    convert_to_float8_training(peer, config=Float8LinearConfig())
    assert type(peer[0]).__name__ == "Float8Linear"
    px = x.clone().requires_grad_()
    peer_out = peer(px)
    peer_out.backward(g)
    out, dx, dw, _ = run_linear(make_meta("hybrid", "tensorwise"), x, w, g)
    assert torch.equal(out, peer_out)
    assert torch.equal(dx, px.grad)
    assert torch.equal(dw, peer[0].weight.grad)
