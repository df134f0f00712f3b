"""The MoE section of tools/gpu_check.py: the expert kernels and an MoE model on one device.

- grouped: ``grouped_linear`` (one ``grouped_mm`` where the device supports the case: bf16 on
  CUDA; the per-expert loop otherwise), with empty experts and uneven rows, in every dtype the
  device has, against the fp32 per-expert loop: out, d input, d weight, d bias.
- layer: one MoE layer (SwiGLU experts with biases, a gated shared expert, aux and z-loss,
  both dispatchers, dropless and with capacity) on the device against the same layer on the
  CPU in fp32: out and every gradient. Expert parallelism itself (the all-to-all and gathers
  between ranks) is proven by the multi-process CPU tests; one GPU cannot hold two NCCL ranks.
- train: a small MoE GPT a few AdamW steps on the device against the CPU (fp32), and bf16
  against fp32 on the device.
"""
import functools

import torch

from megatron_cp.model import GPTConfig
from megatron_cp.moe.experts import grouped_linear
from megatron_cp.moe.layer import MoELayer
from gpu_check_lib import (DTYPE_NAMES, TRAIN_BF16_TOL, TRAIN_FP32_TOL, Series,
                                 supported_dtypes)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _randn(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen).to(device, dtype)


def _fp32_loop(x, weight, counts, bias, expert_ids):
    parts = x.float().split(list(counts))
    out = torch.cat([p @ w.float().t() for p, w in zip(parts, weight.unbind(0))])
    return out + bias.float()[expert_ids]


def check_grouped(experts, counts, n_in, n_out, dtype, seed, device):
    """grouped_linear on ``device`` in ``dtype`` against the fp32 per-expert loop."""
    gen, rows = torch.Generator().manual_seed(seed), sum(counts)
    x = _randn(gen, (rows, n_in), dtype, device).requires_grad_()
    weight = (_randn(gen, (experts, n_out, n_in), torch.float32, device) * n_in ** -0.5) \
        .to(dtype).requires_grad_()
    bias = _randn(gen, (experts, n_out), dtype, device).requires_grad_()
    grad = _randn(gen, (rows, n_out), dtype, device)
    expert_ids = torch.repeat_interleave(torch.arange(experts, device=device),
                                         torch.tensor(counts, device=device))
    out = grouped_linear(x, weight, counts, bias, expert_ids)
    got = torch.autograd.grad(out, (x, weight, bias), grad)
    leaves = [t.detach().float().requires_grad_() for t in (x, weight, bias)]
    ref = _fp32_loop(*leaves[:2], counts, leaves[2], expert_ids)
    want = torch.autograd.grad(ref, leaves, grad.float())
    tol = TOLERANCE[dtype]
    return {"out": (out, ref, tol), "dx": (got[0], want[0], tol), "dw": (got[1], want[1], tol),
            "db": (got[2], want[2], tol)}


def section_grouped(report, device, dtypes):
    shapes = [(8, [0, 37, 5, 200, 0, 64, 1, 13], 64, 256), (4, [128] * 4, 256, 64),
              (16, [3] * 16, 128, 128)]
    for experts, counts, n_in, n_out in shapes:
        for dtype in dtypes:
            name = f"moe/grouped/E={experts}/rows={sum(counts)}/{n_in}x{n_out}/{DTYPE_NAMES[dtype]}"
            report.run(name, check_grouped, experts, counts, n_in, n_out, dtype, experts, device)


def moe_config(dispatcher, capacity=None, params_dtype=torch.float32, num_layers=1,
               **overrides):
    """The MoE model of these checks; ``overrides``: GPTConfig settings that replace its own
    (e.g. another router)."""
    settings = dict(num_layers=num_layers, hidden_size=64, num_attention_heads=4, vocab_size=256,
                    ffn_hidden_size=128, num_moe_experts=8, moe_router_topk=2,
                    moe_ffn_hidden_size=96, moe_shared_expert_intermediate_size=64,
                    moe_shared_expert_gate=True, activation="swiglu", moe_aux_loss_coeff=0.01,
                    moe_z_loss_coeff=0.001, moe_token_dispatcher_type=dispatcher,
                    moe_expert_capacity_factor=capacity, hidden_dropout=0.0,
                    attention_dropout=0.0, params_dtype=params_dtype,
                    make_vocab_size_divisible_by=64)
    return GPTConfig(**{**settings, **overrides})


def _layer_grads(layer, x, mask, grad):
    x = x.detach().clone().requires_grad_()
    out = layer(x, mask)
    params = [p for _, p in sorted(layer.named_parameters())]
    return out, torch.autograd.grad(out, [x] + params, grad)


def check_layer(dispatcher, capacity, seq, device, overrides=None):
    """One MoE layer on ``device`` against the CPU, fp32: out and every gradient
    (``overrides``: of :func:`moe_config`)."""
    config = moe_config(dispatcher, capacity, **(overrides or {}))
    with torch.no_grad():
        for p in (cpu_layer := MoELayer(config, "decoder.layers.0.mlp", None, None)).parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    layer = MoELayer(config, "decoder.layers.0.mlp", None, None, device=device)
    layer.load_state_dict(cpu_layer.state_dict())
    gen, cpu = torch.Generator().manual_seed(7), torch.device("cpu")
    x, grad = _randn(gen, (seq, 2, 64), torch.float32, cpu), _randn(gen, (seq, 2, 64), torch.float32, cpu)
    mask = (torch.rand(2, seq, generator=torch.Generator().manual_seed(3)) > 0.1).float()
    want_out, want = _layer_grads(cpu_layer, x, mask, grad)
    got_out, got = _layer_grads(layer, x.to(device), mask.to(device), grad.to(device))
    names = ["dx"] + ["d" + n for n, _ in sorted(layer.named_parameters())]
    quantities = {"out": (got_out, want_out, TOLERANCE[torch.float32])}
    quantities.update({n: (g, w, TOLERANCE[torch.float32]) for n, g, w in zip(names, got, want)})
    return quantities


def section_layer(report, device, seq):
    for dispatcher in ("alltoall", "allgather"):
        for capacity in (None, 1.0):
            name = f"moe/layer/{dispatcher}/{'dropless' if capacity is None else 'capacity'}" \
                   f"/s={seq}/fp32/{device.type}-vs-cpu"
            report.run(name, check_layer, dispatcher, capacity, seq, device)


def section_train(report, device, steps, seq, train_losses):
    """``train_losses(device, params_dtype, steps, seq, config)``: gpu_check's training loop."""
    losses = functools.cache(lambda where, dtype: train_losses(
        where, dtype, steps, seq, moe_config("alltoall", params_dtype=dtype, num_layers=2)))
    cpu = torch.device("cpu")
    report.run(f"moe/train/fp32/{device.type}-vs-cpu/{steps}-steps/s={seq}/loss", lambda: Series(
        losses(device, torch.float32), losses(cpu, torch.float32), TRAIN_FP32_TOL))
    name = f"moe/train/bf16-vs-fp32/{device.type}/{steps}-steps/s={seq}/loss"
    if torch.bfloat16 not in supported_dtypes(device):
        report.skip(name, f"{device} has no bf16 support")
        return
    report.run(name, lambda: Series(losses(device, torch.bfloat16), losses(device, torch.float32),
                                    TRAIN_BF16_TOL))


def section_moe(report, device, steps, seq, train_losses):
    section_grouped(report, device, supported_dtypes(device))
    section_layer(report, device, seq)
    section_train(report, device, steps, seq, train_losses)
