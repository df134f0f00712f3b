"""The CUDA-only attention calls, each in one small function (PyTorch's own kernels).

Nothing here runs on a CPU machine except on the ``meta`` device (shapes only, which the
tests use to check the argument plumbing). Each function names the aten op it calls:

- flash (``aten._flash_attention_forward`` / ``_flash_attention_backward``): fp16/bf16,
  head_dim a multiple of 8 and at most 256, sm80+; takes fewer KV heads than query heads
  (GQA) natively and returns the log-sum-exp. Dense layout [b, s, heads, d]; variable
  length layout [total, heads, d] with int32 cumulative lengths ``cu_q`` / ``cu_k``.
- memory-efficient (``aten._scaled_dot_product_efficient_attention`` and its backward):
  the fp32 fallback for causal / full blocks, WITHOUT an attention bias (a bias is s x s
  memory and gave wrong bf16 gradients); no GQA, so KV heads are repeated.

- cuDNN (``aten._scaled_dot_product_cudnn_attention`` and its backward): what SDPA itself
  picks on Hopper, and measured about 1.8x faster than flash there (benchmarks/gpu.py, one
  H200); fp16/bf16, head_dim a multiple of 8 and at most 128, sm90+, dense [b, h, s, d] of
  any strides. The same number of KV heads as query heads: GQA repeats the KV heads (O(s)
  copies against O(s^2) attention) and sums dk / dv back over them. Its lse is
  [b, nh, sq, 1].

Flash with dropout 0 ignores its RNG state, so the backward gets a zero one (what PyTorch's
``torch.nn.attention.varlen`` does too).
"""
import functools

import torch

from megatron_cp.distributed import device as device_mod

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_eligible(q, k, v):
    """True when the flash kernels accept q, k, v (device, dtype, head_dim)."""
    return (q.device.type == "cuda" and q.dtype in _FLASH_DTYPES and k.dtype == q.dtype
            and v.dtype == q.dtype and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and k.shape[-1] == q.shape[-1] and v.shape[-1] == q.shape[-1]
            and device_mod.flash_attention_supported(q.device))


def cudnn_eligible(q, k, v):
    """True when the cuDNN kernels are used for a dense causal / full block of q, k, v."""
    return (q.device.type == "cuda" and q.dtype in _FLASH_DTYPES and k.dtype == q.dtype
            and v.dtype == q.dtype and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
            and k.shape[-1] == q.shape[-1] and v.shape[-1] == q.shape[-1]
            and device_mod.cudnn_attention_supported(q.device))


def efficient_eligible(q, v):
    """True when the memory-efficient kernel is used for a dense causal / full block (it
    takes a value head dim of its own: multi-latent attention's blocks run here on CUDA)."""
    return q.device.type == "cuda" and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0


def _zero_rng(device):
    """(rng_state, unused) for a dropout-free flash backward."""
    return (torch.zeros(2, dtype=torch.uint64, device=device),
            torch.empty(0, device=device))


def flash_forward(q, k, v, scale, causal):
    """aten._flash_attention_forward (dense): q [b, nh, sq, d], k/v [b, nkv, sk, d] ->
    (out [b, nh, sq, d] in q's dtype, lse [b, nh, sq] fp32)."""
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [b, s, heads, d] views
        None, None, q.shape[2], k.shape[2], 0.0, causal, False, scale=scale)
    return out.transpose(1, 2), lse  # out: [b, nh, sq, d]


def flash_backward(dout, q, k, v, out, lse, scale, causal):
    """aten._flash_attention_backward (dense): -> (dq [b, nh, sq, d], dk, dv [b, nkv, sk, d])."""
    rng, unused = _zero_rng(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
        rng, unused, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)  # back to [b, heads, s, d]


@functools.lru_cache(maxsize=None)
def varlen_lse_is_packed():
    """True when the varlen flash kernel of this PyTorch returns lse [nh, total_q] (newer),
    False when it is [num_segments, nh, max_q] (older); read from the op's meta kernel."""
    q = torch.empty(3, 1, 8, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    _, lse, _, _, _ = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 2, 2, 0.0, False,
                                                              False, scale=1.0)
    return lse.dim() == 2


def lse_unpad(lse, cu_q, total):
    """[num_segments, nh, max_q] -> [nh, total]: the padded varlen lse layout, packed."""
    lengths = (cu_q[1:] - cu_q[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=lse.device), lengths,
                                    output_size=total)  # [total]: segment of each row
    position = torch.arange(total, device=lse.device) - cu_q[:-1].long()[owner]
    return lse[owner, :, position].transpose(0, 1)  # [nh, total]


def lse_pad(lse, cu_q, max_q):
    """[nh, total] -> [num_segments, nh, max_q] (the inverse of :func:`lse_unpad`)."""
    nh, total = lse.shape
    lengths = (cu_q[1:] - cu_q[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=lse.device), lengths,
                                    output_size=total)
    position = torch.arange(total, device=lse.device) - cu_q[:-1].long()[owner]
    padded = torch.zeros(lengths.numel(), nh, max_q, dtype=lse.dtype, device=lse.device)
    padded[owner, :, position] = lse.transpose(0, 1)
    return padded


def flash_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """aten._flash_attention_forward (variable length): q [Tq, nh, d], k/v [Tk, nkv, d],
    cu_q / cu_k int32 on q's device -> (out [Tq, nh, d], lse [nh, Tq] fp32)."""
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    if lse.dim() == 3:  # [num_segments, nh, max_q]
        lse = lse_unpad(lse, cu_q, q.shape[0])
    return out, lse


def flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    """aten._flash_attention_backward (variable length): packed tensors as in the forward,
    lse [nh, Tq] -> (dq [Tq, nh, d], dk, dv [Tk, nkv, d])."""
    if not varlen_lse_is_packed():
        lse = lse_pad(lse, cu_q, max_q)
    rng, unused = _zero_rng(q.device)
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused,
        scale=scale)


def _repeat_kv(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)  # [b, nh, sk, d]


def _sum_repeated_kv(grad, groups):
    """[b, nkv * groups, sk, d] gradients of repeated KV heads -> [b, nkv, sk, d]."""
    if groups == 1:
        return grad
    b, heads, sk, d = grad.shape
    return grad.reshape(b, heads // groups, groups, sk, d).sum(2)


def efficient_forward(q, k, v, scale, causal):
    """aten._scaled_dot_product_efficient_attention, no bias: q [b, nh, sq, d], k/v
    [b, nkv, sk, d] -> (out [b, nh, sq, d], lse [b, nh, sq] fp32)."""
    groups = q.shape[1] // k.shape[1]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, groups), _repeat_kv(v, groups), None, True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]]  # the kernel pads lse's query axis to a multiple of 32


def efficient_backward(dout, q, k, v, out, lse, scale, causal):
    """aten._scaled_dot_product_efficient_attention_backward, no bias -> (dq, dk, dv), dk/dv
    summed back over the repeated KV heads: [b, nkv, sk, d]."""
    groups, sq = q.shape[1] // k.shape[1], q.shape[2]
    lse = torch.nn.functional.pad(lse, (0, -(-sq // 32) * 32 - sq))  # [b, nh, ceil(sq/32)*32]
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_kv(k, groups), _repeat_kv(v, groups), None, out, lse, seed, seed,
        0.0, [True, True, True, False], causal, scale=scale)
    return dq, _sum_repeated_kv(dk, groups), _sum_repeated_kv(dv, groups)  # [b, nkv, sk, d]


def _like(x, template):
    """``x`` with ``template``'s strides (a copy only when they differ): the cuDNN backward
    wants the output gradient laid out as the output."""
    if x.stride() == template.stride():
        return x
    return torch.empty_like(template).copy_(x)


@functools.lru_cache(maxsize=None)
def _zero_seed(device):
    """The philox seed / offset a dropout-free cuDNN backward reads (never written): one
    zero int64 per device, made once instead of a fill kernel per call."""
    return torch.zeros((), dtype=torch.int64, device=device)


def cudnn_forward(q, k, v, scale, causal):
    """aten._scaled_dot_product_cudnn_attention: q [b, nh, sq, d], k/v [b, nkv, sk, d] ->
    (out [b, nh, sq, d] in q's dtype and layout, lse [b, nh, sq] fp32)."""
    groups = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, _repeat_kv(k, groups), _repeat_kv(v, groups), None, True, 0.0, causal, False,
        scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])  # lse: [b, nh, sq, 1] -> [b, nh, sq]


def cudnn_backward(dout, q, k, v, out, lse, scale, causal):
    """aten._scaled_dot_product_cudnn_attention_backward with the FINAL out / lse [b, nh, sq]
    -> (dq [b, nh, sq, d], dk, dv [b, nkv, sk, d]), dk / dv summed over repeated KV heads."""
    (b, nh, sq, _), sk = q.shape, k.shape[2]
    groups = nh // k.shape[1]
    seed = _zero_seed(q.device)
    out = out.to(q.dtype)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _like(dout.to(q.dtype), out), q, _repeat_kv(k, groups), _repeat_kv(v, groups), out,
        lse.reshape(b, nh, sq, 1).contiguous(), seed, seed, None, None, None, sq, sk,
        0.0, causal, scale=scale)
    return dq, _sum_repeated_kv(dk, groups), _sum_repeated_kv(dv, groups)  # [b, nkv, sk, d]
