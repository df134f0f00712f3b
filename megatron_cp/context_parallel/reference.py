"""The single-process truth: plain masked softmax attention in fp32, and the mask it uses.

``reference_attention`` is what every context-parallel test compares against; it builds the
full ``[s, s]`` mask and score matrix, so it is for tests and small checks only. The mask
rule (a query sees a key when its token index is not smaller and, with packed documents,
both carry the same document id) is the one every kernel path implements.
"""
import math

import torch

NEG_INF = float("-inf")


def softmax_scale_for(q, softmax_scale=None):
    """The softmax scale: ``softmax_scale`` or 1/sqrt(head_dim) of q [..., d]."""
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def attention_mask(tq, tk, dq=None, dk=None):
    """Boolean mask ``[b, 1, sq, sk]``: causal on token indices, and same document if given.

    tq [b, sq] / tk [b, sk]: token indices; dq / dk: document ids of the same shapes or None.
    """
    mask = tq[:, :, None] >= tk[:, None, :]  # [b, sq, sk]
    if dq is not None:
        mask = mask & (dq[:, :, None] == dk[:, None, :])
    return mask[:, None]  # [b, 1, sq, sk]


def reference_attention(q, k, v, token_index=None, document_ids=None, softmax_scale=None):
    """Plain masked softmax attention, the single-process reference (autograd does backward).

    q: [b, nh, s, d]; k, v: [b, nkv, s, d] (v may have its own head dim; GQA: query head h uses KV head h // (nh/nkv));
    token_index / document_ids: [b, s] or None (None: arange / one document). Computed in
    fp32, returned in q's dtype. Rows that see no key give 0 and no NaN.
    """
    b, nh, s, d = q.shape
    nkv = k.shape[1]
    scale = softmax_scale_for(q, softmax_scale)
    if token_index is None:
        token_index = torch.arange(s, device=q.device).expand(b, s)
    qf = q.float().view(b, nkv, nh // nkv, s, d)  # [b, nkv, g, s, d]
    scores = torch.einsum("bkgqd,bksd->bkgqs", qf, k.float()) * scale  # [b, nkv, g, s, sk]
    mask = attention_mask(token_index, token_index, document_ids, document_ids)[:, :, None]
    scores = scores.masked_fill(~mask, NEG_INF)  # mask: [b, 1, 1, s, sk]
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    expo = torch.exp(scores - row_max)
    denom = expo.sum(-1, keepdim=True)
    probs = expo / torch.where(denom > 0, denom, torch.ones_like(denom))  # empty rows -> 0
    out = torch.einsum("bkgqs,bksd->bkgqd", probs, v.float())  # [b, nkv, g, s, dv]
    return out.reshape(b, nh, s, v.shape[-1]).to(q.dtype)
