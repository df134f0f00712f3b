"""Blockwise attention math: one block of queries against one block of keys, and merging.

- ``Block``: what ring / all-gather attention computes per step: the query and key slices
  and how (kind "causal" / "full" dense, or "segments" with a SegmentPlan).
- ``block_forward`` / ``block_backward``: one block, returning the output *and* its
  log-sum-exp; the backward takes the FINAL (merged over every block) out and lse, which
  makes its result exactly this block's share of the gradient.
- ``segments_forward`` / ``segments_backward``: a document-masked block run as at most two
  variable-length calls of the kernel (all causal segments, all full segments), their partial
  results merged per query row with the log-sum-exp rule; the backward scatters the packed
  gradients back onto the block's rows.
- ``merge_partial``: the exact fp32 log-sum-exp merge of two partial results.
- ``planned_attention``: an autograd Function over one classified block that saves only q,
  k, v, out and lse (plus the O(s) integer segment plan); ``masked_attention`` classifies
  the block from its token metadata first.

Kernels come from an explicit :class:`~megatron_cp.context_parallel.kernels.AttentionKernel`
(``kernel=`` argument: None means "auto").
"""
from collections import namedtuple

import torch

from megatron_cp.context_parallel.kernels import attention_kernel
from megatron_cp.context_parallel.reference import NEG_INF, softmax_scale_for
from megatron_cp.context_parallel.segments import classify_block

Block = namedtuple("Block", "q_slice kv_slice kind segments")
Block.__doc__ = """One block of a ring step: queries q[:, :, q_slice] against keys
k[:, :, kv_slice]; kind "causal" | "full" (dense kernel) or "segments" (``segments``: the
SegmentPlan)."""


def _rows(x):
    """[b, h, s, d] -> [b * s, h, d]: one row per token (a view when the layout allows)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _take(rows, index, identity):
    return rows if identity else rows.index_select(0, index)


def _accumulate(acc, rows, grad, identity, num_rows, keep_dtype=False):
    """acc (fp32 [num_rows, h, d] or None) += grad scattered to ``rows`` (which may repeat);
    ``keep_dtype``: a first identity grad is kept in the kernel's dtype (no fp32 copy)."""
    if identity:
        if acc is None:
            return grad if keep_dtype else grad.float()
        return acc.add_(grad)
    if acc is None:
        acc = torch.zeros(num_rows, *grad.shape[1:], dtype=torch.float32, device=grad.device)
    return acc.index_add_(0, rows, grad.float())


def _merge_rows(out, lse, rows, out_part, lse_part):
    """Merge packed partial results (out_part [T, nh, d], lse_part [nh, T]) into the row
    accumulators out [R, nh, d] / lse [nh, R] (fp32, in place) at ``rows`` [T], which may
    repeat: lse = m + log(sum exp(lse_i - m)), out = sum exp(lse_i - lse) out_i per row."""
    nh = lse.shape[0]
    peak = lse.scatter_reduce(1, rows.expand(nh, -1), lse_part, "amax")  # [nh, R]
    peak = peak.masked_fill(torch.isinf(peak), 0.0)
    w_old = torch.exp(lse - peak)  # [nh, R]
    w_new = torch.exp(lse_part - peak[:, rows])  # [nh, T]
    denom = w_old.index_add(1, rows, w_new)  # [nh, R]; 0 where no partial saw a key
    out.mul_(w_old.t()[..., None]).index_add_(0, rows, out_part.float() * w_new.t()[..., None])
    out.div_(torch.where(denom > 0, denom, torch.ones_like(denom)).t()[..., None])
    lse.copy_(peak + torch.log(denom))


def segments_forward(q, k, v, plan, scale, backend):
    """Attention of a segment plan: q [b, nh, sq, d], k/v [b, nkv, sk, d] -> (out fp32
    [b, nh, sq, d], lse [b, nh, sq]); rows that see no key give (0, -inf). A plan of one
    call over every query row in order returns the kernel's out as it is (q's dtype)."""
    b, nh, sq, d = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]  # d: the value head dim
    q_rows, k_rows, v_rows = _rows(q), _rows(k), _rows(v)  # [b*sq, nh, dk], [b*sk, nkv, d*]
    if len(plan.calls) == 1 and plan.calls[0].q_identity:  # every row once, in order (the
        call = plan.calls[0]  # no-CP packed path): the kernel's out (its dtype) and lse
        _, cols, _, _ = call.on(q.device)
        out, lse = backend.varlen_forward(q_rows, _take(k_rows, cols, call.k_identity),
                                          _take(v_rows, cols, call.k_identity), call, scale)
        return (out.view(b, sq, nh, d).transpose(1, 2),  # [b, nh, sq, d]
                lse.float().view(nh, b, sq).transpose(0, 1))  # [b, nh, sq]
    out = torch.zeros(b * sq, nh, d, dtype=torch.float32, device=q.device)
    lse = torch.full((nh, b * sq), NEG_INF, dtype=torch.float32, device=q.device)
    fresh = True
    for call in plan.calls:
        rows, cols, _, _ = call.on(q.device)
        out_part, lse_part = backend.varlen_forward(
            _take(q_rows, rows, call.q_identity), _take(k_rows, cols, call.k_identity),
            _take(v_rows, cols, call.k_identity), call, scale)  # [Tq, nh, d], [nh, Tq]
        if fresh and call.q_unique:  # nothing to merge with yet: place the rows
            out.index_copy_(0, rows, out_part.float())
            lse.index_copy_(1, rows, lse_part.float())
        else:
            _merge_rows(out, lse, rows, out_part, lse_part.float())
        fresh = False
    out = out.view(b, sq, nh, d).transpose(1, 2)  # [b, nh, sq, d]
    return out, lse.view(nh, b, sq).transpose(0, 1)  # lse: [b, nh, sq]


def segments_backward(dout, q, k, v, out, lse, plan, scale, backend, keep_dtype=False):
    """Gradients of a segment plan given the final out / lse [b, nh, sq] of the rows:
    fp32 (dq [b, nh, sq, d], dk, dv [b, nkv, sk, d]); with ``keep_dtype`` a plan of one call
    over every row in order returns the kernel's gradients as they are."""
    keep_dtype = keep_dtype and len(plan.calls) == 1
    b, nh, sq, d = q.shape
    nkv, sk = k.shape[1], k.shape[2]
    q_rows, k_rows, v_rows = _rows(q), _rows(k), _rows(v)  # v may have its own head dim
    dout_rows, out_rows = _rows(dout), _rows(out.to(q.dtype))
    lse_rows = lse.transpose(0, 1).reshape(nh, b * sq)  # [nh, b*sq]
    dq = dk = dv = None  # fp32 [b*sq, nh, d], [b*sk, nkv, d]
    for call in plan.calls:
        rows, cols, _, _ = call.on(q.device)
        packed_lse = lse_rows if call.q_identity else lse_rows.index_select(1, rows)
        gq, gk, gv = backend.varlen_backward(
            _take(dout_rows, rows, call.q_identity), _take(q_rows, rows, call.q_identity),
            _take(k_rows, cols, call.k_identity), _take(v_rows, cols, call.k_identity),
            _take(out_rows, rows, call.q_identity), packed_lse, call, scale)
        dq = _accumulate(dq, rows, gq, call.q_identity, b * sq, keep_dtype)
        dk = _accumulate(dk, cols, gk, call.k_identity, b * sk, keep_dtype)
        dv = _accumulate(dv, cols, gv, call.k_identity, b * sk, keep_dtype)
    return (dq.view(b, sq, nh, d).transpose(1, 2), dk.view(b, sk, nkv, d).transpose(1, 2),
            dv.view(b, sk, nkv, v.shape[-1]).transpose(1, 2))


def block_forward(q, k, v, softmax_scale, kind="full", segments=None, kernel=None):
    """Attention of q [b, nh, sq, d] over k, v [b, nkv, sk, d]; returns (out, lse). v may
    have a head dim of its own (out then has it).

    kind: "causal" (the kernel's top-left causal flag; sq == sk diagonal blocks), "full"
    (no mask), "segments" (``segments``: a SegmentPlan) or "empty". out: [b, nh, sq, d]
    in q's dtype (dense, one-call segments) or fp32 (other segments, empty); lse:
    [b, nh, sq] fp32, -inf with out 0 for rows that see no key. No autograd: the callers are autograd Functions.
    """
    backend = attention_kernel(kernel).backend(q)
    if kind in ("causal", "full"):
        out, lse = backend.dense_forward(q, k, v, softmax_scale, kind == "causal")
        return out, lse.float()
    if kind == "segments":
        return segments_forward(q, k, v, segments, softmax_scale, backend)
    if kind == "empty":
        return (torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device),
                torch.full(q.shape[:3], NEG_INF, dtype=torch.float32, device=q.device))
    raise ValueError(f"block kind {kind!r} is unknown; use causal, full, segments or empty")


def block_backward(dout, q, k, v, out, lse, softmax_scale, kind="full", segments=None,
                   kernel=None, keep_dtype=False):
    """Gradients (dq, dk, dv) of one block in fp32, given the FINAL out and lse of its rows.

    dout / out: [b, nh, sq, d]; lse: [b, nh, sq]; dk, dv: [b, nkv, sk, d], summed over the
    query heads of each KV group. kind / segments / kernel as in :func:`block_forward`.
    A row's final lse is finite when it sees any key: always in a dense block (causal: its own
    key; full: every key), and in a plan whose causal call holds every row; other plans may
    have rows that see no key (lse -inf), taken as 0 here.
    ``keep_dtype`` (a caller that casts to q's dtype anyway, with nothing to accumulate):
    dense and one-call segment gradients come back in the kernel's dtype, not copied to fp32.
    """
    if kind == "empty":
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.zeros(k.shape, dtype=torch.float32, device=q.device),
                torch.zeros(v.shape, dtype=torch.float32, device=q.device))
    backend = attention_kernel(kernel).backend(q)
    if kind == "segments" and not segments.every_row_sees_itself:
        lse = lse.masked_fill(torch.isinf(lse), 0.0)  # rows with no key: every P is 0 anyway
    dout = dout.to(q.dtype)  # the kernels want dout, q and out of one dtype
    if kind == "segments":
        return segments_backward(dout, q, k, v, out, lse, segments, softmax_scale, backend,
                                 keep_dtype)
    grads = backend.dense_backward(dout, q, k, v, out.to(q.dtype), lse, softmax_scale,
                                   kind == "causal")
    return grads if keep_dtype else tuple(g.float() for g in grads)


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


class _PlannedAttention(torch.autograd.Function):
    """Forward: one block run as planned (dense causal / full call, segments, or empty).

    Backward: ``block_backward`` with the same plan (kept on ctx: O(s) ints, never an
    [sq, sk] tensor). Saves q, k, v, out, lse.
    """

    @staticmethod
    def forward(ctx, q, k, v, kind, plan, softmax_scale, kernel):
        out, lse = block_forward(q, k, v, softmax_scale, kind, plan, kernel)
        out = out.to(q.dtype)
        ctx.softmax_scale, ctx.kind, ctx.plan, ctx.kernel = softmax_scale, kind, plan, kernel
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # dout as it comes (the model's [s, b, h] activations seen as [b, nh, s, d]: the
        # layout of q and of the kernel's out, so the cuDNN backward takes it without a copy)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, ctx.softmax_scale,
                                    ctx.kind, ctx.plan, ctx.kernel, keep_dtype=True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def planned_attention(q, k, v, kind, plan, softmax_scale, kernel=None):
    """Differentiable attention of q [b, nh, sq, d] over k, v [b, nkv, sk, d] for a block
    already classified: (kind, plan) as ``classify_block`` returns them."""
    return _PlannedAttention.apply(q, k, v, kind, plan, softmax_scale, attention_kernel(kernel))


def masked_attention(q, k, v, tq, tk, dq_ids=None, dk_ids=None, softmax_scale=None, kernel=None):
    """Differentiable attention of q [b, nh, sq, d] over k, v [b, nkv, sk, d].

    tq [b, sq] / tk [b, sk]: token indices (causality tq >= tk); dq_ids / dk_ids: document
    ids or None. The block is classified here, from the metadata on the host (causal / full
    dense call, segments, empty); a caller holding a SequenceLayout plans once instead.
    """
    scale = softmax_scale_for(q, softmax_scale)
    kind, plan = classify_block(tq, tk, dq_ids, dk_ids)
    return planned_attention(q, k, v, kind, plan, scale, kernel)
