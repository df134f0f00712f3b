"""The fp8 section of tools/gpu_check.py: FP8 linears (megatron_cp/fp8/) on the device.

- fp8/linear: one linear's forward and both backward GEMMs through ``torch._scaled_mm`` on
  the device (the GPU's own layout rules: the first operand row-major, the second
  column-major, sizes multiples of 16) against the same FP8 linear on the CPU, for
  --fp8-format e4m3 and hybrid, with fp32 and bf16 activations: the FP8 payloads the casts
  make (input, weight, output gradient) bit for bit, the outputs and gradients within the
  accumulation the device may do differently (fp32 sums in another order: 1e-4 of the largest
  value; a bf16 output: bf16's tolerance).
- fp8/blocks: the same for the block recipes (megatron_cp/fp8/blocks.py): blockwise on a
  Hopper GPU (scaled_mm's BlockWise1x128 / BlockWise128x128), mxfp8 on a Blackwell one
  (BlockWise1x32, E8M0 scales swizzled), each skipped on a GPU without its kernels: the
  payloads and block scales of every operand (rowwise, the weight's dgrad copy, the wgrad
  copies in token blocks) bit for bit, the three GEMMs within the accumulation tolerance;
  sizes that are not multiples of 128 (the zero padding) and the wgrad GEMM with tokens in
  a layout's order (the regrouping into whole blocks, pad tokens left out).
- fp8/train (not with --quick): pretrain_gpt.py with --fp8-format hybrid (tensorwise, and
  delayed) a few steps on the device against the CPU: an FP8 rounding that a last-bit difference flips moves a loss
  by a fraction of an FP8 ulp, so the curves are held to the bf16 curves' tolerance.
"""
import types

import torch

from megatron_cp.distributed import device as device_mod
from megatron_cp.fp8.blocks import BlockRecipe, block_matmul
from megatron_cp.fp8.linear import GRAD_OUTPUT, INPUT, WEIGHT, Fp8Meta, fp8_linear
from megatron_cp.fp8.model import check_block_device
from megatron_cp.fp8.scaling import amax_of, quantize, scale_from_amax
from gpu_check_lib import TOLERANCE, supported_dtypes

CPU = torch.device("cpu")


def _meta(fmt, recipe="tensorwise"):
    config = types.SimpleNamespace(fp8=fmt, fp8_recipe=recipe, fp8_wgrad=True, wgrad_in_fp8=True,
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


def _block_operands(recipe, meta, x, w, dy, tokens):
    """Every Blocked operand of one linear's three GEMMs, and the three products."""
    x_row, x_col = recipe.input(x, meta.fwd_dtype, True, tokens)
    w_fprop, w_dgrad = recipe.weight(w, meta.fwd_dtype)
    g_row, g_col = recipe.grad(dy, meta.bwd_dtype, True, tokens)
    operands = {"x": x_row, "x_wgrad": x_col, "w": w_fprop, "w_dgrad": w_dgrad, "dy": g_row,
                "dy_wgrad": g_col}
    products = {"out": block_matmul(x_row, w_fprop, x.dtype),
                "dx": block_matmul(g_row, w_dgrad, x.dtype),
                "dw": block_matmul(g_col, x_col, w.dtype)}
    return operands, products


def check_fp8_blocks(recipe_name, shape, fmt, dtype, device):
    """``shape`` (m, k, n): a block recipe's quantizations and GEMMs on ``device`` against
    the CPU's exact reference; the wgrad's tokens in a CP-like order with 3 pad rows."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    dy = torch.randn(m, n, generator=gen).to(dtype)
    tokens = torch.randperm(m, generator=gen)
    tokens[-3:] = -1
    dy[-3:] = 0  # a pad token's output gradient
    meta, recipe = _meta(fmt, recipe_name), BlockRecipe(recipe_name)
    got = _block_operands(recipe, meta, *(t.to(device) for t in (x, w, dy, tokens)))
    want = _block_operands(recipe, meta, x, w, dy, tokens)
    quantities = {}
    for name, q in want[0].items():
        mine = got[0][name]
        quantities[f"payload/{name}"] = (mine.data.view(torch.uint8).cpu().float(),
                                         q.data.view(torch.uint8).float(), 0.0)
        quantities[f"scale/{name}"] = (mine.scale.cpu(), q.scale, 0.0)
    for name, value in want[1].items():
        quantities[name] = (got[1][name].cpu().float(), value.float(), TOLERANCE[dtype])
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
    block_shapes = ((48, 160, 96),) if quick else ((520, 1056, 264),)  # fp8 has 10 s on CUDA
    for recipe in ("blockwise", "mxfp8"):
        try:
            check_block_device(recipe, device_mod.compute_capability(device),
                               device_mod.device_name(device))
        except ValueError as unsupported:
            report.skip(f"fp8/blocks/{recipe}", str(unsupported))
            continue
        for shape in block_shapes:
            for fmt in ("e4m3", "hybrid"):
                for dtype in dtypes:
                    name = (f"fp8/blocks/{recipe}/{fmt}/{str(dtype).split('.')[-1]}/"
                            f"{'x'.join(map(str, shape))}")
                    report.run(f"{name}/{device.type}-vs-cpu", check_fp8_blocks, recipe, shape,
                               fmt, dtype, device)
    if quick:  # the CPU test of the suite: FP8 training on the CPU is tests/fp8's and
        return  # tests/parity/test_fp8_layouts.py's (each row here is two trainer processes)
    for recipe in ("tensorwise", "delayed"):  # gpu_check_train.PATH_FLAGS
        train(f"fp8/{recipe}")
