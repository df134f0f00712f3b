"""The sections of tools/gpu_check.py for the paths that landed after its first GPU run.

Every check runs the path on the device and compares it with an fp32 reference computed on
the CPU (the truth does not share the device's kernels), at the tolerance of the precision
the path computes in (tools/gpu_check_lib.py). This module: the attention kernels and the
Gated DeltaNet rule; tools/gpu_check_layers.py the layers (dropout, tiled logits and MLP,
the overlapped TP linears, activation offload); tools/gpu_check_train.py what trains
(multi-token prediction, muP, Muon, FSDP2, sinkhorn routing, offload).

- flash: the ``blocks`` and packed ``local`` checks in fp16 / bf16 with cuDNN bypassed
  (``cuda_kernels.cudnn_eligible`` answers False inside
  megatron_cp.context_parallel.kernel_routes' :func:`cudnn_bypassed`, restored after): on sm90+ cuDNN takes every dense block, so the flash kernels (dense and varlen)
  never run otherwise. A route row counts the kernel calls: flash ran, cuDNN did not.
- gdn: ``chunk_gated_delta_rule`` on the device (FLA's kernel for bf16 / fp16 values where
  CUDA and flash-linear-attention are there, else the chunked PyTorch rule: the route is in
  the row name) against the fp32 chunked rule on the CPU: out, final state and every
  gradient, plain, packed documents, and each with a state in and out (packed with a state,
  and fp32: always the PyTorch rule, what context parallelism and generation run); the Gated
  DeltaNet layer (packed) on the device against the CPU, fp32; a row that each call took the
  route it should (FLA wherever it is there and takes the call).
- mla: attention with a value head dim of its own (dv != dq = dk: on CUDA the
  memory-efficient kernel, not flash / cuDNN): causal and full blocks (out, lse, dq, dk,
  dv) and the local path (packed: the segment loop; plain) against the fp32 reference on
  the CPU; the MultiLatentAttention layer (packed) on the device against the CPU, fp32.
"""
import collections
import contextlib

import torch
import torch.nn.functional as F

from megatron_cp.distributed import device as device_mod
from megatron_cp.context_parallel import block_backward, block_forward, local_attention
from megatron_cp.context_parallel.kernel_routes import COUNTED, cudnn_bypassed
from megatron_cp.context_parallel.reference import softmax_scale_for
from megatron_cp.layers import accelerators, gated_delta_rule
from megatron_cp.model import GPTConfig
from megatron_cp.model.gated_delta_net import GatedDeltaNet
from megatron_cp.model.multi_latent_attention import MultiLatentAttention
from megatron_cp.tensor_parallel import RNGStatesTracker
from gpu_check_layers import LAYER_SECTIONS, layer_sections
from gpu_check_lib import (DTYPE_NAMES, LSE_TOLERANCE, TF32_TOLERANCE, TOLERANCE, Randn, Verdict,
                           masked_reference, microbatch, patched, self_reference)
from gpu_check_train import TRAIN_SECTIONS, train_sections

PATH_SECTIONS = ("flash", "gdn", "mla", *LAYER_SECTIONS, *TRAIN_SECTIONS)
CPU = torch.device("cpu")
FP32 = torch.float32


def _cpu_leaves(*tensors):
    """fp32 CPU copies of ``tensors`` (the values the device saw) that require grad."""
    return [t.detach().to(CPU, FP32).requires_grad_() for t in tensors]


def _grads(out, leaves, grad):
    return torch.autograd.grad(out, leaves, grad)


# ----------------------------------------------------------------------------- flash
def check_flash_route(device, calls):
    """The kernels the flash section ran: flash (dense and varlen) and never cuDNN."""
    counts = {name: calls[name] for name in COUNTED}
    if device_mod.flash_attention_supported(device):
        ok = counts["flash_forward"] > 0 and counts["flash_varlen_forward"] > 0 and \
            counts["cudnn_forward"] == 0
        return Verdict(ok, f"forward calls {counts}")
    return Verdict(counts["cudnn_forward"] == 0,
                   f"no flash kernel on {device}: the rows ran its other kernels with "
                   f"cudnn_eligible patched; forward calls {counts}")


def section_flash(report, device, sizes, dtypes, blocks, local):
    """``blocks`` / ``local``: gpu_check's section functions, rerun with cuDNN bypassed."""
    low = [d for d in dtypes if d in (torch.bfloat16, torch.float16)]
    calls = collections.Counter()
    with cudnn_bypassed(calls):
        blocks(report, device, sizes, low, kernels=("auto",), prefix="flash/blocks")
        local(report, device, sizes, low, variants=((True, "auto"),), prefix="flash/local")
    report.run("flash/route", check_flash_route, device, calls)


# ----------------------------------------------------------------------------- gdn
def gdn_inputs(b, s, h, dk, dv, dtype, seed):
    """q, k (unit norm), g (log decay), beta fp32 and v in ``dtype`` [b, s, h, .] on the
    CPU: the dtypes GatedDeltaNet hands the rule (it normalises q, k in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (gated_delta_rule.l2norm(torch.randn(b, s, h, dk, generator=gen)) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(b, s, h, generator=gen)) * 0.3  # mild decay: long memory
    return q, k, v, g, torch.rand(b, s, h, generator=gen)


@contextlib.contextmanager
def torch_rule_counted(calls):
    """Counts the calls of the plain-PyTorch chunked rule (none: another kernel ran)."""
    real = gated_delta_rule.torch_chunk_gated_delta_rule

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with patched(gated_delta_rule, "torch_chunk_gated_delta_rule", counting):
        yield


def gdn_route(device, packed, state, dtype):
    """"fla" or "torch": the route ``chunk_gated_delta_rule`` takes on ``device`` for a
    (packed) sequence (with a state in and out) with values of ``dtype``, from one small
    call."""
    q, k, v, g, beta = (x.to(device) for x in gdn_inputs(1, 64, 1, 16, 16, dtype, 0))
    docs = torch.arange(64, device=device).div(40, rounding_mode="floor")[None] if packed else None
    h0 = torch.zeros(1, 1, 16, 16, device=device) if state else None
    calls = []
    with torch_rule_counted(calls), torch.no_grad():
        gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, h0, state, docs)
    return "torch" if calls else "fla"


def check_gdn_rule(shape, packed, state, dtype, route, device):
    """chunk_gated_delta_rule on ``device`` against the fp32 chunked rule on the CPU."""
    b, s, h, dk, dv = shape
    inputs = gdn_inputs(b, s, h, dk, dv, dtype, seed=s + 3 * packed + state)
    docs = microbatch(s, b, packed=True, seed=s)["document_ids"] if packed else None
    gen = torch.Generator().manual_seed(1)
    h0 = torch.randn(b, h, dk, dv, generator=gen) if state else None
    dout = torch.randn(b, s, h, dv, generator=gen).to(dtype)
    dstate = torch.randn(b, h, dk, dv, generator=gen) if state else None
    leaves = [x.to(device).requires_grad_() for x in inputs + ((h0,) if state else ())]
    calls = []
    with torch_rule_counted(calls):
        out, final = gated_delta_rule.chunk_gated_delta_rule(
            *leaves[:5], leaves[5] if state else None, state,
            None if docs is None else docs.to(device))
    if ("torch" if calls else "fla") != route:
        raise RuntimeError(f"the rule took another route than the {route} of the row name")
    outputs, upstream = [out], [dout.to(device)]
    if state:
        outputs, upstream = [out, final], [dout.to(device), dstate.to(device)]
    got = _grads(outputs, leaves, upstream)
    ref_leaves = _cpu_leaves(*leaves)
    ref, ref_final = gated_delta_rule.torch_chunk_gated_delta_rule(
        *ref_leaves[:5], ref_leaves[5] if state else None, state, docs)
    want = _grads([ref, ref_final] if state else [ref], ref_leaves,
                  [dout.float(), dstate] if state else [dout.float()])
    # FLA's Triton dots round fp32 operands to TF32
    tol = TF32_TOLERANCE if route == "fla" and dtype == FP32 else TOLERANCE[dtype]
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    quantities = {"out": (out, ref, tol)}
    if state:
        quantities["state"] = (final, ref_final, tol)
    quantities.update({n: (g, w, tol) for n, g, w in zip(names, got, want)})
    return quantities


def gdn_config(hidden, head_dim):
    return GPTConfig(num_layers=4, hidden_size=hidden, num_attention_heads=4, vocab_size=256,
                     ffn_hidden_size=2 * hidden, activation="swiglu", add_bias_linear=False,
                     normalization="RMSNorm", experimental_attention_variant="gdn",
                     linear_attention_freq="4", linear_conv_kernel_dim=4,
                     linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                     linear_num_key_heads=2, linear_num_value_heads=4, hidden_dropout=0.0,
                     attention_dropout=0.0, init_method_std=0.1)


def _perturbed(layer, seed):
    """``layer`` with every parameter moved off its init (norm weights away from 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return layer


def check_layer_pair(build, s, b, hidden, forward, route, device):
    """``build(device)`` -> a layer [s, b, h] -> [s, b, h]; the CPU one (moved off its init)
    and the device one with its weights, fp32: out, dx and every parameter's gradient.
    ``forward``: {name: CPU tensor} keyword arguments of the forward (moved to the device
    for its run); ``route``: "fla" when the layer runs FLA's kernel (TF32 dots)."""
    cpu_layer = _perturbed(build(CPU), s)
    layer = build(device)
    layer.load_state_dict(cpu_layer.state_dict())
    gen = torch.Generator().manual_seed(s + 1)
    x, grad = torch.randn(s, b, hidden, generator=gen), torch.randn(s, b, hidden, generator=gen)
    results = []
    for net, where in ((layer, device), (cpu_layer, CPU)):
        leaf = x.to(where).requires_grad_()
        params = [p for _, p in sorted(net.named_parameters())]
        out = net(leaf, **{n: None if t is None else t.to(where) for n, t in forward.items()})
        results.append((out, _grads(out, [leaf] + params, grad.to(where))))
    names = ["dx"] + ["d" + n for n, _ in sorted(layer.named_parameters())]
    tol = TF32_TOLERANCE if route == "fla" else TOLERANCE[FP32]
    (got_out, got), (want_out, want) = results
    quantities = {"out": (got_out, want_out, tol)}
    quantities.update({n: (g, w, tol) for n, g, w in zip(names, got, want)})
    return quantities


def section_gdn(report, device, quick, dtypes):
    shapes = [(2, 80, 2, 16, 16)] if quick else [(2, 1000, 8, 128, 128), (1, 4096, 4, 128, 128)]
    routes = {}
    for packed, state in ((False, False), (True, False), (False, True), (True, True)):
        kind = ("packed" if packed else "plain") + ("+state" if state else "")
        for dtype in dtypes:
            routes[packed, state, dtype] = route = gdn_route(device, packed, state, dtype)
            for b, s, h, dk, dv in shapes:
                name = f"gdn/rule/{route}/{kind}/s={s}/h{h}/d{dk}:{dv}/{DTYPE_NAMES[dtype]}"
                report.run(name, check_gdn_rule, (b, s, h, dk, dv), packed, state, dtype,
                           route, device)
    s, hidden, head_dim = (40, 32, 8) if quick else (1024, 256, 64)
    route = gdn_route(device, True, False, FP32)  # the layer below runs in fp32
    docs = microbatch(s, 2, packed=True, seed=9)["document_ids"]
    report.run(f"gdn/layer/{route}/packed/s={s}/h={hidden}/fp32/{device.type}-vs-cpu",
               check_layer_pair, lambda where: GatedDeltaNet(
                   gdn_config(hidden, head_dim), "decoder.layers.0.self_attention", None,
                   device=where), s, 2, hidden, {"document_ids": docs}, route, device)
    fla = accelerators.fla_chunk_gated_delta_rule() is not None
    expected = {key: "fla" if fla and device.type == "cuda" and key[2] in gated_delta_rule.FLA_DTYPES
                and not (key[0] and key[1]) else "torch" for key in routes}
    report.run("gdn/routes", lambda: Verdict(
        routes == expected,
        f"flash-linear-attention importable: {fla}; routes taken on {device.type} "
        f"((packed, state in/out, dtype): route): {routes}; FLA's for bf16 / fp16 values "
        f"on CUDA wherever it is there (fp32, and a packed sequence with a state: the "
        f"PyTorch rule)"))


# ----------------------------------------------------------------------------- mla
def check_mla_block(kind, n, dtype, dims, seed, device):
    """A causal (n x n) or full (n/2 later queries x n keys) block with dv != dk through
    block_forward / block_backward against masked_reference on the CPU."""
    nh, dk, dv = dims
    sq = n if kind == "causal" else n // 2
    tk = torch.arange(n).expand(2, n)
    tq = tk if kind == "causal" else torch.arange(n, n + sq).expand(2, sq)
    rand = Randn(seed, dtype, device)
    q, k, v = rand.bhsd(2, nh, sq, dk), rand.bhsd(2, nh, n, dk), rand.bhsd(2, nh, n, dv)
    dout = rand.bhsd(2, nh, sq, dv)
    scale = softmax_scale_for(q)
    out, lse = block_forward(q, k, v, scale, kind)
    grads = block_backward(dout, q, k, v, out, lse, scale, kind)
    want = masked_reference(*(t.to(CPU) for t in (q, k, v, dout)), tq, tk)
    tol = TOLERANCE[dtype]
    return {"out": (out, want[0], tol), "lse": (lse, want[1], LSE_TOLERANCE[dtype]),
            "dq": (grads[0], want[2], tol), "dk": (grads[1], want[3], tol),
            "dv": (grads[2], want[4], tol)}


def check_mla_local(n, packed, dtype, dims, seed, device):
    """local_attention ([s, b, h, d] views) with dv != dk against the CPU reference."""
    nh, dk, dv = dims
    docs = microbatch(n, 2, packed=True, seed=seed)["document_ids"] if packed else None
    rand = Randn(seed, dtype, device)
    leaves = [rand.bhsd(2, nh, n, d, view="sbhd").detach().requires_grad_()
              for d in (dk, dk, dv)]
    dout = rand.bhsd(2, nh, n, dv)
    out = local_attention(*leaves, None, None if docs is None else docs.to(device))
    got = _grads(out, leaves, dout)
    want = self_reference(*(t.detach().to(CPU) for t in leaves), dout.to(CPU), docs)
    tol = TOLERANCE[dtype]
    return {name: (g, w, tol) for name, g, w in
            zip(("out", "dq", "dk", "dv"), (out, *got), want)}


def mla_config(hidden, qk, pos, v):
    return GPTConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, vocab_size=256,
                     ffn_hidden_size=2 * hidden, multi_latent_attention=True,
                     q_lora_rank=hidden // 2, kv_lora_rank=hidden // 2, qk_head_dim=qk,
                     qk_pos_emb_head_dim=pos, v_head_dim=v, normalization="RMSNorm",
                     qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0,
                     attention_dropout=0.0)


def section_mla(report, device, quick, dtypes):
    dims = (4, 24, 16) if quick else (8, 192, 128)  # heads, q/k head dim, v head dim
    sizes = (64,) if quick else (128, 1024)
    for n in sizes:
        for dtype in dtypes:
            tag = f"h{dims[0]}/d{dims[1]}:{dims[2]}/s={n}/{DTYPE_NAMES[dtype]}"
            for kind in ("causal", "full"):
                report.run(f"mla/block/{kind}/{tag}", check_mla_block, kind, n, dtype, dims,
                           n + 1, device)
            for packed in (True, False):
                report.run(f"mla/local/{'packed' if packed else 'plain'}/{tag}",
                           check_mla_local, n, packed, dtype, dims, n + 2, device)
    s, hidden, (qk, pos, v) = (32, 32, (8, 8, 8)) if quick else (512, 256, (64, 32, 64))
    batch = microbatch(s, 2, packed=True, seed=4)
    report.run(f"mla/layer/packed/s={s}/d{qk + pos}:{v}/fp32/{device.type}-vs-cpu",
               check_layer_pair, lambda where: MultiLatentAttention(
                   mla_config(hidden, qk, pos, v), "decoder.layers.0.self_attention", None,
                   None, RNGStatesTracker(where), device=where), s, 2, hidden,
               {"position_ids": batch["position_ids"], "document_ids": batch["document_ids"],
                "token_index": torch.arange(s).expand(2, s)}, None, device)


def path_sections(report, device, quick, dtypes, sizes, blocks, local):
    """{section: run} of :data:`PATH_SECTIONS`; ``sizes``, ``blocks``, ``local``: the block /
    local lengths and gpu_check's section functions (the flash section reruns them)."""
    flash_sizes = sizes[:2] if quick else sizes
    # fp32 and bf16 (what these paths train in); fp16 goes through the attention kernels above
    trained = [d for d in dtypes if d != torch.float16]
    sections = {
        "flash": lambda: section_flash(report, device, flash_sizes, dtypes, blocks, local),
        "gdn": lambda: section_gdn(report, device, quick, trained),
        "mla": lambda: section_mla(report, device, quick, trained),
    }
    training = train_sections(report, device, quick)
    sections.update(layer_sections(report, device, quick, trained, training))
    sections.update({name: run for name, run in training.items() if name not in sections})
    return sections
