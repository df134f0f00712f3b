"""All-gather attention (--cp-comm-type all_gather): the simple baseline, no overlap.

Forward: all-gather the KV (k and v side by side on the last axis, so their head dims may
differ: multi-latent attention; KV heads only) and the token metadata of every
CP rank at once, then attend the local queries to each rank's KV block with the ring's
block plan (zigzag: one causal diagonal block and half-size unmasked blocks; otherwise a
per-block classification, empty blocks skipped, document-masked ones as segment plans)
and merge with the log-sum-exp rule. The full KV is NOT saved: backward all-gathers it
again, recomputes the blocks (with the forward's plans), and reduce-scatters dK/dV so each
rank gets the gradient of its own KV summed over every rank's queries.
"""
import torch

from megatron_cp.context_parallel import comm
from megatron_cp.context_parallel.dropout import RingDropout
from megatron_cp.context_parallel.kernels import attention_kernel
from megatron_cp.context_parallel.reference import softmax_scale_for
from megatron_cp.context_parallel.layout import SequenceLayout
from megatron_cp.context_parallel.ring import (Accumulator, add_kv_grads, backward_blocks,
                                               forward_blocks)


class _AllGatherAttention(torch.autograd.Function):
    """Forward: gather KV, attend block by block. Backward: re-gather, recompute,
    reduce-scatter dK/dV. Inputs q [b, nh, s/P, d], k/v [b, nkv, s/P, d]."""

    @staticmethod
    def forward(ctx, q, k, v, token_index, document_ids, group, softmax_scale, kernel, dropout,
                sequence_layout):
        size, rank = comm.group_size(group), comm.group_rank(group)
        view = sequence_layout.ring(group)  # every rank's metadata [P, b, s/P] and the plans
        layout = view.plans
        if dropout is not None:
            dropout = RingDropout(dropout, view.token_all, view.doc_all, group)
        kv_all = comm.all_gather_stack(torch.cat([k, v], dim=-1), group)  # [P, b, nkv, s/P, dk+dv]
        k_all, v_all = kv_all.split([k.shape[-1], v.shape[-1]], dim=-1)
        acc = Accumulator(q, v.shape[-1])
        for src in range(size):
            forward_blocks(q, k_all[src], v_all[src], layout, rank, src, softmax_scale,
                           acc, kernel, dropout)
        out_acc, lse_acc = acc.result()
        out = out_acc.to(q.dtype)
        ctx.group, ctx.softmax_scale, ctx.layout, ctx.kernel = group, softmax_scale, layout, kernel
        ctx.dropout = dropout
        ctx.save_for_backward(q, k, v, out, lse_acc)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        size, rank = comm.group_size(ctx.group), comm.group_rank(ctx.group)
        layout = ctx.layout
        kv_all = comm.all_gather_stack(torch.cat([k, v], dim=-1), ctx.group)
        k_all, v_all = kv_all.split([k.shape[-1], v.shape[-1]], dim=-1)  # [P, b, nkv, s/P, d*]
        dout = dout.contiguous()
        dq, dkv_all = None, []
        for src in range(size):
            dq, kv_grads = backward_blocks(dout, q, k_all[src], v_all[src], out, lse,
                                           layout, rank, src, ctx.softmax_scale, dq, ctx.kernel,
                                           ctx.dropout)
            dkv_all.append(torch.cat(add_kv_grads(None, kv_grads, k.shape, v.shape, q.device),
                                     dim=-1))
        if dq is None:
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_all = torch.stack(dkv_all)  # [P, b, nkv, s/P, dk+dv]: every rank's KV gradient
        dkv = comm.reduce_scatter_stack(dkv_all, ctx.group)  # [b, nkv, s/P, dk+dv]
        dk, dv = dkv.split([k.shape[-1], v.shape[-1]], dim=-1)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None,
                None, None, None)


def all_gather_attention(q, k, v, token_index, document_ids, group, softmax_scale=None,
                         kernel=None, dropout=None, layout=None):
    """All-gather context-parallel attention over ``group``; differentiable wrt q, k, v.

    q: [b, nh, s/P, d]; k, v: [b, nkv, s/P, d] (v may have its own head dim);
    token_index / document_ids: [b, s/P]. Returns [b, nh, s/P, dv] in q's dtype. ``kernel``: AttentionKernel or name (None: "auto").
    ``dropout``: an AttentionDropout (plain dropout blocks, see dropout.py) or None.
    ``layout``: the microbatch's SequenceLayout (None: gathered and planned here).
    """
    scale = softmax_scale_for(q, softmax_scale)
    if layout is None:
        layout = SequenceLayout(token_index, document_ids)
    return _AllGatherAttention.apply(q, k, v, token_index, document_ids, group, scale,
                                     attention_kernel(kernel), dropout, layout)
