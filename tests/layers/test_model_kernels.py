"""The model's elementwise pieces (rotary, RMSNorm, SwiGLU) against the textbook formulas,
written out here: forward and gradients, fp32 / fp64 exactly, bf16 within its rounding."""
import pytest
import torch

from megatron_cp.layers.norms import RMSNorm
from megatron_cp.layers.mlp import swiglu
from megatron_cp.layers.rotary import apply_rotary, rotary_cos_sin, rotate


def _reference_rotary(x, position_ids, rotary_dim, base):
    """RoPE pair by pair: channel i and i + rd/2 turn by position * base^(-2i/rd)."""
    out = x.double().clone()
    half = rotary_dim // 2
    for i in range(half):
        freq = base ** (-2.0 * i / rotary_dim)
        angle = position_ids.t().double() * freq  # [s, b]
        c, s = torch.cos(angle)[..., None], torch.sin(angle)[..., None]  # [s, b, 1]
        a, b = x[..., i].double(), x[..., i + half].double()  # [s, b, n]
        out[..., i] = a * c - b * s
        out[..., i + half] = b * c + a * s
    return out


def _grads(fn, *inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


@pytest.mark.parametrize("rotary_dim", [16, 8])  # all channels, and --rotary-percent 0.5
def test_rotary_matches_the_pairwise_formula(rotary_dim):
    torch.manual_seed(0)
    s, b, n, d = 12, 2, 3, 16
    x = torch.randn(s, b, n, d, dtype=torch.float64)
    positions = torch.stack([torch.randperm(4096)[:s], torch.arange(100, 100 + s)])  # [b, s] global
    ref = _reference_rotary(x, positions, rotary_dim, 10000.0)
    grad_out = torch.randn(s, b, n, d, dtype=torch.float64)
    out, (grad,) = _grads(lambda t: apply_rotary(t, positions, rotary_dim, 10000.0), x,
                          grad_out=grad_out)
    # the angles are fp32 (as before): position x frequency loses ~1e-4 rad near 4096
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # a rotation's transpose is its inverse: the input gradient is grad_out turned back
    back = _reference_rotary(grad_out, -positions, rotary_dim, 10000.0)
    torch.testing.assert_close(grad, back, rtol=1e-4, atol=1e-4)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, positions[:, :3], rotary_dim, 1e4),
                                    (x[:3, :, :1].clone().requires_grad_(),))


def test_rotary_on_views_shares_cos_sin_and_keeps_the_dtype():
    torch.manual_seed(1)
    qkv = torch.randn(10, 2, 2, 3, 8)  # [s, b, groups, q+k+v, d]: k is a strided view
    k = qkv[:, :, :, 1]
    positions = torch.arange(10).expand(2, 10) * 7
    cos, sin = rotary_cos_sin(positions, 8, 500000.0)
    assert cos.shape == (10, 2, 1, 4) and cos.dtype == torch.float32
    torch.testing.assert_close(rotate(k, cos, sin),
                               _reference_rotary(k, positions, 8, 500000.0).float(),
                               rtol=1e-5, atol=1e-5)
    bf = k.bfloat16()
    out = rotate(bf, cos, sin)
    assert out.dtype == torch.bfloat16
    exact = _reference_rotary(bf.float(), positions, 8, 500000.0)  # fp32 math, one rounding
    torch.testing.assert_close(out.float(), exact.float(), rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_fp32_formula(dtype):
    torch.manual_seed(2)
    h = 24
    norm = RMSNorm(h, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h) + 0.5)
    x = (torch.randn(5, 2, h) * 3).to(dtype)

    def formula(x, w):
        x32 = x.float()
        return (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)

    grad_out = torch.randn(5, 2, h)
    ref, ref_grads = _grads(formula, x, norm.weight.detach(), grad_out=grad_out)
    xin = x.clone().requires_grad_()
    out = norm(xin)
    assert out.dtype == dtype
    out.backward(grad_out.to(dtype))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
    torch.testing.assert_close(out.detach(), ref, **tol)
    torch.testing.assert_close(xin.grad, ref_grads[0], **tol)
    torch.testing.assert_close(norm.weight.grad, ref_grads[1], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_the_formula(dtype):
    torch.manual_seed(3)
    h = torch.randn(6, 2, 2 * 10).to(dtype)  # [s, b, 2 ffn]: [gate | up]

    def formula(h):
        gate, up = h[..., :10], h[..., 10:]
        return gate * torch.sigmoid(gate) * up

    grad_out = torch.randn(6, 2, 10)
    ref, (ref_grad,) = _grads(formula, h, grad_out=grad_out)
    out, (grad,) = _grads(swiglu, h, grad_out=grad_out)
    assert out.dtype == dtype and grad.shape == h.shape
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert torch.autograd.gradcheck(swiglu, (torch.randn(3, 2, 8, dtype=torch.float64,
                                                         requires_grad=True),))
