"""Attention on one block of queries against one block of keys, plus the references.

Everything context parallelism computes locally goes through here:

- ``reference_attention``: plain masked softmax attention in fp32 (GQA, document masks,
  empty rows give 0). The single-process truth every test compares against.
- ``local_attention``: the no-CP fast path, ``scaled_dot_product_attention`` with
  ``is_causal=True`` for a plain causal sample, else a boolean mask.
- ``block_forward`` / ``block_backward``: one block of queries against one block of keys,
  returning the output *and* its log-sum-exp, and the flash-attention backward given the
  final (merged) output and log-sum-exp. These are what ring attention runs per step.
- ``merge_partial``: the exact fp32 log-sum-exp merge of two partial results.
- ``masked_attention``: an autograd Function over one block that saves only q, k, v,
  out, lse and the token metadata (the mask is rebuilt in backward, never saved).

Kernels: the fused kernel PyTorch ships for the device (CPU:
``_scaled_dot_product_flash_attention_for_cpu``; CUDA: memory-efficient attention, which
takes a bias and returns the log-sum-exp) with a pure-PyTorch fallback; ``use_block_kernel``
forces one or the other (the CPU tests exercise both). Masks are boolean ``[b, 1, sq, sk]``
with True where a query may attend a key.
"""
import contextlib
import math

import torch
import torch.nn.functional as F

_NEG_INF = float("-inf")
_KERNEL = {"name": "auto"}  # "auto": fused where the device has one; "torch": plain PyTorch


@contextlib.contextmanager
def use_block_kernel(name):
    """Run the enclosed block attention with kernel ``name`` ("auto" or "torch")."""
    if name not in ("auto", "torch"):
        raise ValueError(f"block kernel {name!r} is unknown; use 'auto' or 'torch'")
    previous = _KERNEL["name"]
    _KERNEL["name"] = name
    try:
        yield
    finally:
        _KERNEL["name"] = previous


def softmax_scale_for(q, softmax_scale=None):
    """The softmax scale: ``softmax_scale`` or 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def attention_mask(tq, tk, dq=None, dk=None):
    """Boolean mask ``[b, 1, sq, sk]``: causal on token indices, and same document if given."""
    mask = tq[:, :, None] >= tk[:, None, :]  # [b, sq, sk]
    if dq is not None:
        mask = mask & (dq[:, :, None] == dk[:, None, :])
    return mask[:, None]  # [b, 1, sq, sk]


def is_plain_arange(token_index, length):
    """True when every row of ``token_index`` [b, s] is 0, 1, ..., length-1."""
    if token_index is None:
        return True
    ref = torch.arange(length, device=token_index.device)
    return token_index.shape[-1] == length and bool((token_index == ref).all())


def classify_block(tq, tk, dq=None, dk=None):
    """Decide how a block must be computed: ("causal"|"full"|"empty"|"masked", mask or None).

    "causal": queries and keys are the same contiguous run of tokens, no documents (the fused
    kernel's own causal flag, no mask tensor); "full": every query sees every key; "empty":
    no query sees any key (skip the block); "masked": needs the boolean mask returned.
    """
    if dq is None and tq.shape == tk.shape and torch.equal(tq, tk):
        first = tq[:, :1]
        steps = torch.arange(tq.shape[1], device=tq.device)
        if bool((tq == first + steps).all()):
            return "causal", None
    mask = attention_mask(tq, tk, dq, dk)  # [b, 1, sq, sk]
    if bool(mask.all()):
        return "full", None
    if not bool(mask.any()):
        return "empty", None
    return "masked", mask


# ----------------------------------------------------------------------------- references
def reference_attention(q, k, v, token_index=None, document_ids=None, softmax_scale=None):
    """Plain masked softmax attention, the single-process reference (autograd does backward).

    q: [b, nh, s, d]; k, v: [b, nkv, s, d] (GQA: query head h uses KV head h // (nh/nkv));
    token_index / document_ids: [b, s] or None (None: arange / one document). Computed in
    fp32, returned in q's dtype. Rows that see no key give 0 and no NaN.
    """
    b, nh, s, d = q.shape
    nkv, sk = k.shape[1], k.shape[2]
    scale = softmax_scale_for(q, softmax_scale)
    if token_index is None:
        token_index = torch.arange(s, device=q.device).expand(b, s)
    qf = q.float().view(b, nkv, nh // nkv, s, d)  # [b, nkv, g, s, d]
    scores = torch.einsum("bkgqd,bksd->bkgqs", qf, k.float()) * scale  # [b, nkv, g, s, sk]
    mask = attention_mask(token_index, token_index, document_ids, document_ids)[:, :, None]
    scores = scores.masked_fill(~mask, _NEG_INF)  # mask: [b, 1, 1, s, sk]
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    expo = torch.exp(scores - row_max)
    denom = expo.sum(-1, keepdim=True)
    probs = expo / torch.where(denom > 0, denom, torch.ones_like(denom))  # empty rows -> 0
    out = torch.einsum("bkgqs,bksd->bkgqd", probs, v.float())  # [b, nkv, g, s, d]
    return out.reshape(b, nh, s, d).to(q.dtype)


def local_attention(q, k, v, token_index=None, document_ids=None, softmax_scale=None,
                    dropout_p=0.0):
    """Attention of a whole (unsplit) sample with SDPA: the no-CP fast path.

    ``is_causal=True`` when there are no documents and token_index is a plain arange, else a
    boolean causal/document mask. GQA through SDPA's ``enable_gqa``. Backward is SDPA's.
    ``dropout_p`` drops attention probabilities from the current RNG state (the caller forks
    the tensor-parallel RNG around it).
    """
    s = q.shape[2]
    scale = softmax_scale_for(q, softmax_scale)
    gqa = k.shape[1] != q.shape[1]
    if document_ids is None and is_plain_arange(token_index, s):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              scale=scale, enable_gqa=gqa)
    if token_index is None:
        token_index = torch.arange(s, device=q.device).expand(q.shape[0], s)
    mask = attention_mask(token_index, token_index, document_ids, document_ids)  # [b, 1, s, s]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=gqa)
    has_key = mask.any(-1, keepdim=True)  # [b, 1, s, 1]
    return out if bool(has_key.all()) else out.masked_fill(~has_key, 0.0)


# ----------------------------------------------------------------------------- kernels
def _float_bias(mask, dtype, pad_to=1):
    """Additive bias (0 / -inf) of ``dtype`` from a boolean mask; last dim stored padded."""
    sk = mask.shape[-1]
    padded = -(-sk // pad_to) * pad_to
    bias = torch.zeros(*mask.shape[:-1], padded, dtype=dtype, device=mask.device)
    bias = bias[..., :sk]  # [b, 1, sq, sk] view over an aligned buffer
    return bias.masked_fill_(~mask, _NEG_INF)


def _repeat_kv(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)  # [b, nh, sk, d]


def _sum_groups(grad, nkv):
    b, nh, sk, d = grad.shape
    return grad.view(b, nkv, nh // nkv, sk, d).sum(2)  # [b, nkv, sk, d]


def _fused_forward(q, k, v, scale, causal, mask):
    if q.device.type == "cpu":
        bias = None if mask is None else _float_bias(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse.float()
    # CUDA: memory-efficient attention takes a bias and returns the lse (padded on the
    # query axis to a multiple of 32); it has no GQA, so KV heads are repeated here.
    groups = q.shape[1] // k.shape[1]
    bias = None
    if mask is not None:
        bias = _float_bias(mask, q.dtype, pad_to=16).expand(-1, q.shape[1], -1, -1)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, groups), _repeat_kv(v, groups), bias, True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]].float()


def _fused_backward(dout, q, k, v, out, lse, scale, causal, mask):
    if q.device.type == "cpu":
        bias = None if mask is None else _float_bias(mask, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
        return dq, dk, dv
    nkv, groups = k.shape[1], q.shape[1] // k.shape[1]
    bias = None
    if mask is not None:
        bias = _float_bias(mask, q.dtype, pad_to=16).expand(-1, q.shape[1], -1, -1)
    sq = q.shape[2]
    lse_padded = F.pad(lse, (0, -(-sq // 32) * 32 - sq))  # [b, nh, ceil(sq/32)*32]
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_kv(k, groups), _repeat_kv(v, groups), bias, out, lse_padded, seed, seed,
        0.0, [True, True, True, False], causal, scale=scale)
    return dq, _sum_groups(dk, nkv), _sum_groups(dv, nkv)


def _use_fused(q):
    return _KERNEL["name"] == "auto" and q.device.type in ("cpu", "cuda")


def _plain_scores(q, k, scale, causal, mask):
    b, nh, sq, d = q.shape
    nkv, sk = k.shape[1], k.shape[2]
    qf = q.float().view(b, nkv, nh // nkv, sq, d)  # [b, nkv, g, sq, d]
    scores = torch.einsum("bkgqd,bksd->bkgqs", qf, k.float()) * scale  # [b, nkv, g, sq, sk]
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, _NEG_INF)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], _NEG_INF)  # mask: [b, 1, 1, sq, sk]
    return qf, scores


def block_forward(q, k, v, softmax_scale, causal=False, mask=None):
    """Attention of q [b, nh, sq, d] over k, v [b, nkv, sk, d]; returns (out, lse).

    out: [b, nh, sq, d] in q's dtype; lse: [b, nh, sq] fp32 log-sum-exp of the scaled,
    masked scores (-inf, with out = 0, for rows that see no key). ``causal``: the kernel's
    top-left causal flag (only used for sq == sk diagonal blocks); ``mask``: boolean
    [b, 1, sq, sk]. No autograd: the callers are autograd Functions.
    """
    if _use_fused(q):
        out, lse = _fused_forward(q, k, v, softmax_scale, causal, mask)
    else:
        b, nh, sq, d = q.shape
        _, scores = _plain_scores(q, k, softmax_scale, causal, mask)
        lse = scores.logsumexp(-1)  # [b, nkv, g, sq]
        probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
        out = torch.einsum("bkgqs,bksd->bkgqd", probs, v.float())  # [b, nkv, g, sq, d]
        out = out.reshape(b, nh, sq, d).to(q.dtype)
        lse = lse.reshape(b, nh, sq)
    if mask is not None:
        empty = ~mask.any(-1)  # [b, 1, sq]; fused kernels report lse 0 for such rows
        lse = lse.masked_fill(empty, _NEG_INF)
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def block_backward(dout, q, k, v, out, lse, softmax_scale, causal=False, mask=None):
    """Gradients (dq, dk, dv) of one block, in fp32, given the FINAL out and lse of the rows.

    Flash-attention backward: P = exp(S - lse), dV = P^T dO, dP = dO V^T,
    D = rowsum(dO * O), dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q; with the
    merged out/lse of all blocks these are exactly this block's share of the gradient.
    dk, dv: [b, nkv, sk, d], summed over the query heads of each KV group.
    """
    lse = lse.masked_fill(torch.isinf(lse), 0.0)  # rows with no key: every P is 0 anyway
    if _use_fused(q):
        dq, dk, dv = _fused_backward(dout, q, k, v, out, lse, softmax_scale, causal, mask)
        return dq.float(), dk.float(), dv.float()
    b, nh, sq, d = q.shape
    nkv = k.shape[1]
    qf, scores = _plain_scores(q, k, softmax_scale, causal, mask)
    probs = torch.exp(scores - lse.view(b, nkv, nh // nkv, sq)[..., None])  # [b, nkv, g, sq, sk]
    dof = dout.float().view(b, nkv, nh // nkv, sq, d)  # [b, nkv, g, sq, d]
    dv = torch.einsum("bkgqs,bkgqd->bksd", probs, dof)  # [b, nkv, sk, d]
    dprobs = torch.einsum("bkgqd,bksd->bkgqs", dof, v.float())
    delta = (dof * out.float().view(b, nkv, nh // nkv, sq, d)).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta)  # [b, nkv, g, sq, sk]
    dq = torch.einsum("bkgqs,bksd->bkgqd", dscores, k.float()).reshape(b, nh, sq, d) * softmax_scale
    dk = torch.einsum("bkgqs,bkgqd->bksd", dscores, qf) * softmax_scale  # [b, nkv, sk, d]
    return dq, dk, dv


def merge_partial(out_acc, lse_acc, out_blk, lse_blk):
    """Merge a block result into fp32 accumulators in place (exact log-sum-exp rule).

    lse = m + log(exp(lse1 - m) + exp(lse2 - m)), out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2
    with m = max(lse1, lse2); rows that are -inf on both sides stay (0, -inf), no NaN.
    out_acc: [b, nh, sq, d] fp32; lse_acc: [b, nh, sq] fp32 (views may be written).
    """
    new = torch.logaddexp(lse_acc, lse_blk)  # [b, nh, sq]
    safe = new.masked_fill(torch.isinf(new), 0.0)
    w_old = torch.exp(lse_acc - safe)[..., None]
    w_new = torch.exp(lse_blk - safe)[..., None]
    out_acc.mul_(w_old).add_(out_blk.float() * w_new)
    lse_acc.copy_(new)


# ----------------------------------------------------------------------------- one-block autograd
class _MaskedAttention(torch.autograd.Function):
    """Forward: attention of q over k, v with the mask built from token metadata.

    Backward: rebuilds the mask from the saved metadata and runs ``block_backward``. Saves
    q, k, v, out, lse and the metadata only (no [sq, sk] tensor).
    """

    @staticmethod
    def forward(ctx, q, k, v, tq, tk, dq_ids, dk_ids, softmax_scale):
        kind, mask = classify_block(tq, tk, dq_ids, dk_ids)
        if kind == "empty":
            out = torch.zeros_like(q)
            lse = torch.full(q.shape[:3], _NEG_INF, dtype=torch.float32, device=q.device)
        else:
            out, lse = block_forward(q, k, v, softmax_scale, kind == "causal", mask)
        ctx.softmax_scale = softmax_scale
        ctx.save_for_backward(q, k, v, out, lse, tq, tk, dq_ids, dk_ids)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, tq, tk, dq_ids, dk_ids = ctx.saved_tensors
        kind, mask = classify_block(tq, tk, dq_ids, dk_ids)
        if kind == "empty":
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), *([None] * 5)
        dq, dk, dv = block_backward(dout.contiguous(), q, k, v, out, lse, ctx.softmax_scale,
                                    kind == "causal", mask)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def masked_attention(q, k, v, tq, tk, dq_ids=None, dk_ids=None, softmax_scale=None):
    """Differentiable attention of q [b, nh, sq, d] over k, v [b, nkv, sk, d].

    tq [b, sq] / tk [b, sk]: token indices (causality tq >= tk); dq_ids / dk_ids: document
    ids or None. Forward via ``block_forward`` (fused kernel); backward recomputes the mask.
    """
    scale = softmax_scale_for(q, softmax_scale)
    return _MaskedAttention.apply(q, k, v, tq, tk, dq_ids, dk_ids, scale)
