"""The fp8 section of tools/gpu_check.py: FP8 linears (megatron_cp/fp8/) on the device.

- fp8/linear: one linear's forward and both backward GEMMs through ``torch._scaled_mm`` on
  the device (the GPU's own layout rules: the first operand row-major, the second
  column-major, sizes multiples of 16) against the same FP8 linear on the CPU, for
  --fp8-format e4m3 and hybrid, with fp32 and bf16 activations: the FP8 payloads the casts
  make (input, weight, output gradient) bit for bit, the outputs and gradients within the
  accumulation the device may do differently (fp32 sums in another order: 1e-4 of the largest
  value; a bf16 output: bf16's tolerance).
- fp8/train (not with --quick): pretrain_gpt.py with --fp8-format hybrid (tensorwise, and
  delayed) a few steps on the device against the CPU: an FP8 rounding that a last-bit difference flips moves a loss
  by a fraction of an FP8 ulp, so the curves are held to the bf16 curves' tolerance.
"""
import types

import torch

from megatron_cp.fp8.linear import GRAD_OUTPUT, INPUT, WEIGHT, Fp8Meta, fp8_linear
from megatron_cp.fp8.scaling import amax_of, quantize, scale_from_amax
from gpu_check_lib import TOLERANCE, supported_dtypes

CPU = torch.device("cpu")


def _meta(fmt):
    config = types.SimpleNamespace(fp8=fmt, fp8_recipe="tensorwise", fp8_wgrad=True,
                                   fp8_margin=0, fp8_amax_compute_algo="most_recent",
                                   fp8_amax_history_len=1)
    return Fp8Meta(config, ((), (), ()))


def _payloads(meta, tensors, device):
    """uint8 views of the FP8 casts of ``tensors`` {role: tensor} made on ``device``."""
    out = {}
    for role, t in tensors.items():
        t = t.to(device)
        q = quantize(t, scale_from_amax(amax_of(t), meta.dtype(role)), meta.dtype(role))
        out[role] = q.view(torch.uint8).cpu()
    return out


def check_fp8_linear(shape, fmt, dtype, device):
    """``shape`` (m, k, n): the FP8 linear on ``device`` against the CPU's."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    dy = torch.randn(m, n, generator=gen).to(dtype)
    results = {}
    for where in (device, CPU):
        xl, wl = x.to(where).requires_grad_(), w.to(where).requires_grad_()
        y = fp8_linear(xl, wl, None, _meta(fmt))
        y.backward(dy.to(where))
        results[where] = (y.detach().cpu().float(), xl.grad.cpu().float(), wl.grad.cpu().float())
    meta = _meta(fmt)
    got = _payloads(meta, {INPUT: x, WEIGHT: w, GRAD_OUTPUT: dy}, device)
    want = _payloads(meta, {INPUT: x, WEIGHT: w, GRAD_OUTPUT: dy}, CPU)
    tol = TOLERANCE[dtype]
    quantities = {f"payload/{name}": (got[role].float(), want[role].float(), 0.0)
                  for role, name in ((INPUT, "x"), (WEIGHT, "w"), (GRAD_OUTPUT, "dy"))}
    for i, name in enumerate(("out", "dx", "dw")):
        quantities[name] = (results[device][i], results[CPU][i], tol)
    return quantities


def section_fp8(report, device, quick, train):
    """The fp8 section (see the module docstring); ``train(path)``: gpu_check_train's
    loss-curve rows of a PATH_FLAGS entry."""
    dtypes = [d for d in supported_dtypes(device) if d != torch.float16]
    shapes = ((32, 48, 64),) if quick else ((256, 512, 384), (4096, 1024, 2048))
    for shape in shapes:
        for fmt in ("e4m3", "hybrid"):
            for dtype in dtypes:
                name = f"fp8/linear/{fmt}/{str(dtype).split('.')[-1]}/{'x'.join(map(str, shape))}"
                report.run(f"{name}/{device.type}-vs-cpu", check_fp8_linear, shape, fmt, dtype,
                           device)
    if quick:  # the CPU test of the suite: FP8 training on the CPU is tests/fp8's and
        return  # tests/parity/test_fp8_layouts.py's (each row here is two trainer processes)
    for recipe in ("tensorwise", "delayed"):  # gpu_check_train.PATH_FLAGS
        train(f"fp8/{recipe}")
