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

Value heads may be narrower or wider than query/key heads (multi-latent attention: dv !=
d); out then has v's head dim. No backend pads V: PyTorch's CPU flash kernel and the CUDA
flash and cuDNN kernels want one head dim for q, k and v, so such blocks run the plain
PyTorch path on CPU and, on CUDA, the memory-efficient kernel (which takes a separate value
head dim) or the plain path, and packed calls their segment loop (never flash varlen).

==============  ===============================================  ==============================
backend         dense causal / full                              variable-length segments
==============  ===============================================  ==============================
TorchBackend    plain PyTorch                                    loop over segments, dense each
CpuBackend      ``_scaled_dot_product_flash_attention_for_cpu``  loop over segments, dense each
CudaBackend     cuDNN (sm90+) / flash; fp32: memory-efficient    causal square segments with
                (no bias) / plain                                little padding: one padded
                                                                 dense cuDNN call; else flash
                                                                 varlen; fp32: the loop
==============  ===============================================  ==============================
"""
import torch

from megatron_cp.config.model import KERNEL_NAMES
from megatron_cp.context_parallel import cuda_kernels

# Padded dense cuDNN instead of flash varlen while the padding adds at most 25% more scores
# (cuDNN's dense kernel measured 1.3-1.8x flash's on an H200: benchmarks/gpu.py).
PADDED_COST_LIMIT = 1.25
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
        """Plain attention -> (out [b, nh, sq, dv] in q's dtype, lse [b, nh, sq] fp32)."""
        b, nh, sq, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
        _, scores = self._scores(q, k, scale, causal)
        lse = scores.logsumexp(-1)  # [b, nkv, g, sq]; every row sees a key (diagonal / full)
        probs = torch.exp(scores - lse[..., None])
        out = torch.einsum("bkgqs,bksd->bkgqd", probs, v.float())  # [b, nkv, g, sq, dv]
        return out.reshape(b, nh, sq, dv).to(q.dtype), lse.reshape(b, nh, sq)

    def dense_backward(self, dout, q, k, v, out, lse, scale, causal):
        """Flash-attention backward with the final out / lse: P = exp(S - lse), dV = P^T dO,
        dP = dO V^T, D = rowsum(dO * O), dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q.
        Returns fp32 (dq [b, nh, sq, d], dk [b, nkv, sk, d], dv [b, nkv, sk, dv])."""
        b, nh, sq, _ = q.shape
        nkv, dv_dim = k.shape[1], v.shape[-1]
        qf, scores = self._scores(q, k, scale, causal)
        lse = lse.reshape(b, nkv, nh // nkv, sq, 1)
        probs = torch.exp(scores - lse)  # [b, nkv, g, sq, sk]
        dof = dout.float().view(b, nkv, nh // nkv, sq, dv_dim)  # [b, nkv, g, sq, dv]
        dv = torch.einsum("bkgqs,bkgqd->bksd", probs, dof)  # [b, nkv, sk, d]
        dprobs = torch.einsum("bkgqd,bksd->bkgqs", dof, v.float())
        delta = (dof * out.float().view(b, nkv, nh // nkv, sq, dv_dim)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta)  # [b, nkv, g, sq, sk]
        dq = torch.einsum("bkgqs,bksd->bkgqd", dscores, k.float()).reshape(q.shape) * scale
        dk = torch.einsum("bkgqs,bkgqd->bksd", dscores, qf) * scale  # [b, nkv, sk, d]
        return dq, dk, dv

    def varlen_forward(self, q, k, v, call, scale):
        """Segment by segment through ``dense_forward`` -> (out [Tq, nh, dv], lse [nh, Tq])."""
        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
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
        """aten._scaled_dot_product_flash_attention_for_cpu, no mask (one head dim for q, k
        and v: the plain path otherwise)."""
        if v.shape[-1] != q.shape[-1]:
            return super().dense_forward(q, k, v, scale, causal)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale)
        return out, lse.float()

    def dense_backward(self, dout, q, k, v, out, lse, scale, causal):
        """aten._scaled_dot_product_flash_attention_for_cpu_backward, no mask."""
        if v.shape[-1] != q.shape[-1]:
            return super().dense_backward(dout, q, k, v, out, lse, scale, causal)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)


class CudaBackend(TorchBackend):
    """PyTorch's CUDA flash kernels (fp16/bf16), with fallbacks for what they refuse."""

    name = "cuda"

    def flash_ok(self, q, k, v):
        """Whether the flash kernels take these tensors (see cuda_kernels.flash_eligible)."""
        return cuda_kernels.flash_eligible(q, k, v)

    def dense_forward(self, q, k, v, scale, causal):
        """cuDNN (Hopper on); else flash; else memory-efficient without bias; else plain."""
        if cuda_kernels.cudnn_eligible(q, k, v):
            return cuda_kernels.cudnn_forward(q, k, v, scale, causal)
        if self.flash_ok(q, k, v):
            return cuda_kernels.flash_forward(q, k, v, scale, causal)
        if cuda_kernels.efficient_eligible(q, v):
            return cuda_kernels.efficient_forward(q, k, v, scale, causal)
        return super().dense_forward(q, k, v, scale, causal)

    def dense_backward(self, dout, q, k, v, out, lse, scale, causal):
        if cuda_kernels.cudnn_eligible(q, k, v):
            return cuda_kernels.cudnn_backward(dout, q, k, v, out, lse, scale, causal)
        if self.flash_ok(q, k, v):
            return cuda_kernels.flash_backward(dout, q, k, v, out, lse, scale, causal)
        if cuda_kernels.efficient_eligible(q, v):
            return cuda_kernels.efficient_backward(dout, q, k, v, out, lse, scale, causal)
        return super().dense_backward(dout, q, k, v, out, lse, scale, causal)

    def padded_ok(self, q, k, v, call):
        """Whether a varlen call runs as one padded dense cuDNN call (see
        :func:`padded_causal_forward`): causal square segments, at most PADDED_COST_LIMIT x
        the scores of the segments themselves. cuDNN's own variable-length mode is not used:
        on an H200 (torch 2.11, cuDNN 9.19) its dq was off by 10x and it ran at 0.1-20
        TFLOP/s."""
        return (call.causal and cuda_kernels.cudnn_eligible(q, k, v) and call.square
                and call.padded_cost() <= PADDED_COST_LIMIT)

    def varlen_forward(self, q, k, v, call, scale):
        """One padded cuDNN call, or one flash varlen call; else (fp32) the segment loop."""
        if self.padded_ok(q, k, v, call):
            return padded_causal_forward(cuda_kernels.cudnn_forward, q, k, v, call, scale)
        if not self.flash_ok(q, k, v):
            return super().varlen_forward(q, k, v, call, scale)
        _, _, cu_q, cu_k = call.on(q.device)
        return cuda_kernels.flash_varlen_forward(q, k, v, cu_q, cu_k, call.max_q, call.max_k,
                                                 scale, call.causal)

    def varlen_backward(self, dout, q, k, v, out, lse, call, scale):
        if self.padded_ok(q, k, v, call):
            return padded_causal_backward(cuda_kernels.cudnn_backward, dout, q, k, v, out, lse,
                                          call, scale)
        if not self.flash_ok(q, k, v):
            return super().varlen_backward(dout, q, k, v, out, lse, call, scale)
        _, _, cu_q, cu_k = call.on(q.device)
        return cuda_kernels.flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                  call.max_q, call.max_k, scale, call.causal)


def _padded(x, call, index):
    """Packed rows x [T, h, d] -> the segments as a zero-padded batch [n, h, L, d] (a view of
    [n, L, h, d]; n segments, L = call.max_q). Segments of one length: a view of x, no copy;
    otherwise one gather from x with a zero row appended (``index``: see
    SegmentCall.padded_index)."""
    n, length = call.num_segments, call.max_q
    if index is None:
        return x.view(n, length, *x.shape[1:]).transpose(1, 2)
    rows = torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # [T + 1, h, d]: row T is zero
    return rows.index_select(0, index[0]).view(n, length, *x.shape[1:]).transpose(1, 2)


def _unpadded(x, index):
    """[n, h, L, d] batch -> its real rows, packed [T, h, d] (a view when no row is padding)."""
    n, h, length, d = x.shape
    rows = x.transpose(1, 2).reshape(n * length, h, d)
    return rows if index is None else rows.index_select(0, index[1])


def padded_causal_forward(dense_forward, q, k, v, call, scale):
    """A causal varlen call whose segments are square (each query segment is its own key
    segment) as ONE dense causal call over the segments padded to a batch. Exact: a real
    query at offset j sees keys 0..j of its segment, all real; the padding rows after each
    segment are computed and dropped. -> (out [Tq, nh, d], lse [nh, Tq])."""
    index = call.padded_index(q.device)
    out, lse = dense_forward(_padded(q, call, index), _padded(k, call, index),
                             _padded(v, call, index), scale, True)  # [n, nh, L, d], [n, nh, L]
    n, nh, length = lse.shape
    lse = lse.transpose(0, 1).reshape(nh, n * length)  # [nh, n * L]
    return _unpadded(out, index), lse if index is None else lse.index_select(1, index[1])


def padded_causal_backward(dense_backward, dout, q, k, v, out, lse, call, scale):
    """Backward of :func:`padded_causal_forward`: padding rows get dout = out = 0 and lse 0,
    so their dS = P (dP - D) is 0 and they add nothing to dk / dv. -> (dq, dk, dv) packed."""
    index = call.padded_index(q.device)
    nh, n, length = lse.shape[0], call.num_segments, call.max_q
    if index is None:
        lse_batch = lse
    else:
        lse_batch = torch.cat([lse, lse.new_zeros(nh, 1)], dim=1).index_select(1, index[0])
    grads = dense_backward(_padded(dout, call, index), _padded(q, call, index),
                           _padded(k, call, index), _padded(v, call, index),
                           _padded(out, call, index),
                           lse_batch.view(nh, n, length).transpose(0, 1), scale, True)
    return tuple(_unpadded(g, index) for g in grads)


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
