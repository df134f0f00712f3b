"""The attention kernels of each device behind one explicit choice, :class:`AttentionKernel`.

A kernel choice is a name resolved once per attention layer (:func:`attention_kernel`) and
passed down to ring / Ulysses / all-gather attention and to the local (no-CP) path:

- "auto": the fused kernels of the tensors' device;
- "torch": plain PyTorch everywhere (scores materialised per block: the tests' second
  opinion, and a path that runs on any device).

At each call the choice picks the backend of the tensors' device (so a model moved between
devices keeps working). Every backend answers the same four calls:

- ``dense_forward(q, k, v, scale, causal)`` / ``dense_backward(dout, q, k, v, out, lse,
  scale, causal)``: q [b, nh, sq, d] against k/v [b, nkv, sk, d] (GQA: nkv divides nh),
  causal (top-left, only used with sq == sk) or full;
- ``varlen_forward(q, k, v, call, scale)`` / ``varlen_backward(dout, q, k, v, out, lse,
  call, scale)``: packed q [Tq, nh, d] against packed k/v [Tk, nkv, d], cut into the
  segments of a :class:`~megatron_cp.context_parallel.segments.SegmentCall`.

Forward returns (out, lse) with lse the fp32 log-sum-exp of the scaled scores of each row
([b, nh, sq] dense, [nh, Tq] packed); backward takes the FINAL out and lse of the rows.

==============  ===============================================  ==============================
backend         dense causal / full                              variable-length segments
==============  ===============================================  ==============================
TorchBackend    plain PyTorch                                    loop over segments, dense each
CpuBackend      ``_scaled_dot_product_flash_attention_for_cpu``  loop over segments, dense each
CudaBackend     flash; fp32: memory-efficient (no bias) / plain  flash varlen; fp32: the loop
==============  ===============================================  ==============================
"""
import torch

from megatron_cp.context_parallel import cuda_kernels

KERNEL_NAMES = ("auto", "torch")
_NEG_INF = float("-inf")


def _one_batch(x):
    """Packed rows x [len, heads, d] -> [1, heads, len, d] (a view)."""
    return x.transpose(0, 1)[None]


class TorchBackend:
    """Plain PyTorch on any device; variable-length calls run segment by segment."""

    name = "torch"

    @staticmethod
    def _scores(q, k, scale, causal):
        b, nh, sq, d = q.shape
        nkv, sk = k.shape[1], k.shape[2]
        qf = q.float().view(b, nkv, nh // nkv, sq, d)  # [b, nkv, g, sq, d]
        scores = torch.einsum("bkgqd,bksd->bkgqs", qf, k.float()) * scale  # [b, nkv, g, sq, sk]
        if causal:
            keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, _NEG_INF)
        return qf, scores

    def dense_forward(self, q, k, v, scale, causal):
        """Plain attention -> (out [b, nh, sq, d] in q's dtype, lse [b, nh, sq] fp32)."""
        b, nh, sq, d = q.shape
        _, scores = self._scores(q, k, scale, causal)
        lse = scores.logsumexp(-1)  # [b, nkv, g, sq]; every row sees a key (diagonal / full)
        probs = torch.exp(scores - lse[..., None])
        out = torch.einsum("bkgqs,bksd->bkgqd", probs, v.float())  # [b, nkv, g, sq, d]
        return out.reshape(b, nh, sq, d).to(q.dtype), lse.reshape(b, nh, sq)

    def dense_backward(self, dout, q, k, v, out, lse, scale, causal):
        """Flash-attention backward with the final out / lse: P = exp(S - lse), dV = P^T dO,
        dP = dO V^T, D = rowsum(dO * O), dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q.
        Returns fp32 (dq [b, nh, sq, d], dk, dv [b, nkv, sk, d])."""
        b, nh, sq, d = q.shape
        nkv = k.shape[1]
        qf, scores = self._scores(q, k, scale, causal)
        lse = lse.reshape(b, nkv, nh // nkv, sq, 1)
        probs = torch.exp(scores - lse)  # [b, nkv, g, sq, sk]
        dof = dout.float().view(b, nkv, nh // nkv, sq, d)  # [b, nkv, g, sq, d]
        dv = torch.einsum("bkgqs,bkgqd->bksd", probs, dof)  # [b, nkv, sk, d]
        dprobs = torch.einsum("bkgqd,bksd->bkgqs", dof, v.float())
        delta = (dof * out.float().view(b, nkv, nh // nkv, sq, d)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta)  # [b, nkv, g, sq, sk]
        dq = torch.einsum("bkgqs,bksd->bkgqd", dscores, k.float()).reshape(b, nh, sq, d) * scale
        dk = torch.einsum("bkgqs,bkgqd->bksd", dscores, qf) * scale  # [b, nkv, sk, d]
        return dq, dk, dv

    def varlen_forward(self, q, k, v, call, scale):
        """Segment by segment through ``dense_forward`` -> (out [Tq, nh, d], lse [nh, Tq])."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        for (q0, q1), (k0, k1) in call.bounds():
            o, l = self.dense_forward(_one_batch(q[q0:q1]), _one_batch(k[k0:k1]),
                                      _one_batch(v[k0:k1]), scale, call.causal)
            out[q0:q1] = o[0].transpose(0, 1)  # [len, nh, d]
            lse[:, q0:q1] = l[0]
        return out, lse

    def varlen_backward(self, dout, q, k, v, out, lse, call, scale):
        """Segment by segment via ``dense_backward``: (dq [Tq, nh, d], dk, dv [Tk, nkv, d])."""
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.empty(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.empty(v.shape, dtype=torch.float32, device=q.device)
        for (q0, q1), (k0, k1) in call.bounds():
            grads = self.dense_backward(
                _one_batch(dout[q0:q1]), _one_batch(q[q0:q1]), _one_batch(k[k0:k1]),
                _one_batch(v[k0:k1]), _one_batch(out[q0:q1]), lse[None, :, q0:q1].contiguous(),
                scale, call.causal)
            for full, grad, (lo, hi) in zip((dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1))):
                full[lo:hi] = grad[0].transpose(0, 1)  # [len, heads, d]
        return dq, dk, dv


class CpuBackend(TorchBackend):
    """PyTorch's CPU flash kernel (returns the lse, takes GQA) for every dense block."""

    name = "cpu"

    def dense_forward(self, q, k, v, scale, causal):
        """aten._scaled_dot_product_flash_attention_for_cpu, no mask."""
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale)
        return out, lse.float()

    def dense_backward(self, dout, q, k, v, out, lse, scale, causal):
        """aten._scaled_dot_product_flash_attention_for_cpu_backward, no mask."""
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)


class CudaBackend(TorchBackend):
    """PyTorch's CUDA flash kernels (fp16/bf16), with fallbacks for what they refuse."""

    name = "cuda"

    def flash_ok(self, q, k, v):
        """Whether the flash kernels take these tensors (see cuda_kernels.flash_eligible)."""
        return cuda_kernels.flash_eligible(q, k, v)

    def dense_forward(self, q, k, v, scale, causal):
        """Flash; else memory-efficient without bias; else plain PyTorch."""
        if self.flash_ok(q, k, v):
            return cuda_kernels.flash_forward(q, k, v, scale, causal)
        if cuda_kernels.efficient_eligible(q):
            return cuda_kernels.efficient_forward(q, k, v, scale, causal)
        return super().dense_forward(q, k, v, scale, causal)

    def dense_backward(self, dout, q, k, v, out, lse, scale, causal):
        if self.flash_ok(q, k, v):
            return cuda_kernels.flash_backward(dout, q, k, v, out, lse, scale, causal)
        if cuda_kernels.efficient_eligible(q):
            return cuda_kernels.efficient_backward(dout, q, k, v, out, lse, scale, causal)
        return super().dense_backward(dout, q, k, v, out, lse, scale, causal)

    def varlen_forward(self, q, k, v, call, scale):
        """One flash varlen call; else (fp32) the segment loop over the dense fallbacks."""
        if not self.flash_ok(q, k, v):
            return super().varlen_forward(q, k, v, call, scale)
        _, _, cu_q, cu_k = call.on(q.device)
        return cuda_kernels.flash_varlen_forward(q, k, v, cu_q, cu_k, call.max_q, call.max_k,
                                                 scale, call.causal)

    def varlen_backward(self, dout, q, k, v, out, lse, call, scale):
        if not self.flash_ok(q, k, v):
            return super().varlen_backward(dout, q, k, v, out, lse, call, scale)
        _, _, cu_q, cu_k = call.on(q.device)
        return cuda_kernels.flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                  call.max_q, call.max_k, scale, call.causal)


_TORCH = TorchBackend()
_AUTO = {"cpu": CpuBackend(), "cuda": CudaBackend()}


class AttentionKernel:
    """An explicit kernel choice: "auto" (the device's fused kernels) or "torch" (plain)."""

    def __init__(self, name="auto"):
        if name not in KERNEL_NAMES:
            raise ValueError(f"attention kernel {name!r} is unknown; use one of "
                             f"{list(KERNEL_NAMES)}")
        self.name = name

    def backend(self, x):
        """The backend that computes on tensor ``x``'s device."""
        if self.name == "torch":
            return _TORCH
        return _AUTO.get(x.device.type, _TORCH)

    def __repr__(self):
        return f"AttentionKernel({self.name!r})"


def attention_kernel(kernel=None):
    """An :class:`AttentionKernel` from None ("auto"), a name, or an AttentionKernel."""
    if isinstance(kernel, AttentionKernel):
        return kernel
    return AttentionKernel("auto" if kernel is None else kernel)
