"""Ulysses attention (--cp-comm-type a2a) and the head bookkeeping it needs.

An all-to-all turns [b, H, s/U, d] into [b, H/U, s, d]: each rank then runs attention on
the whole sequence for H/U heads, and the reverse all-to-all brings the output back. The
all-to-alls are autograd Functions whose backward is the reverse all-to-all. The token
metadata is all-gathered so masks use global positions; when there are no documents the
gathered sequence is sorted back into token order, so a plain zigzag sample becomes an
ordinary causal sequence (fused causal kernel, no mask) and, in the hybrid, a zigzag
over the outer ring.

Heads: the all-to-all needs the query heads and the KV heads to split evenly over U with
the GQA grouping intact on every rank. ``plan_heads`` repeats each KV head (when U does
not divide num_kv_heads, e.g. U > nkv) and, only when num_heads % U != 0, adds dummy zero
query heads (and possibly dummy KV heads) that are dropped after; gradients of repeated
KV heads are summed by autograd (index_select's backward).
"""
import math
from collections import namedtuple

import torch

from megatron_cp.context_parallel import block_attention as blocks
from megatron_cp.context_parallel import comm

HeadPlan = namedtuple("HeadPlan", "q_index kv_index out_index num_dummy_heads")


def plan_heads(num_heads, num_kv_heads, size, allow_dummy_heads=True):
    """How to lay out query/KV heads so an all-to-all over ``size`` ranks splits them evenly.

    Returns a HeadPlan: q_index / kv_index list, for every slot of the padded layout, the
    original head it holds (-1: a zero dummy head); out_index: the slot of each real query
    head. Query slot h uses KV slot h // (len(q_index) // len(kv_index)). ValueError when
    dummy heads are needed (num_heads % size != 0) and ``allow_dummy_heads`` is False.
    """
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads ({num_heads}) must be divisible by num_query_groups "
                         f"({num_kv_heads}); pick a number of KV heads that divides it")
    group = num_heads // num_kv_heads
    if num_heads % size != 0 and not allow_dummy_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) is not divisible by the all-to-all size ({size}) "
            f"and dummy heads are disabled; allow dummy heads, pick heads divisible by {size}, "
            f"or use --cp-comm-type p2p / a2a+p2p with a smaller all-to-all group")
    # (a) repeat each KV head `repeat` times; each copy serves ceil(group / repeat) query slots.
    repeat = size // math.gcd(num_kv_heads, size)
    per_copy = -(-group // repeat)
    q_a, kv_a = [], []
    for kv_head in range(num_kv_heads):
        for copy in range(repeat):
            kv_a.append(kv_head)
            for slot in range(per_copy):
                member = copy * per_copy + slot
                q_a.append(kv_head * group + member if member < group else -1)
    # (b) append dummy KV groups (all-dummy query heads) up to a multiple of size.
    num_kv_b = -(-num_kv_heads // size) * size
    q_b = list(range(num_heads)) + [-1] * ((num_kv_b - num_kv_heads) * group)
    kv_b = list(range(num_kv_heads)) + [-1] * (num_kv_b - num_kv_heads)
    q_index, kv_index = (q_a, kv_a) if (len(q_a), len(kv_a)) <= (len(q_b), len(kv_b)) else (q_b, kv_b)
    out_index = [q_index.index(head) for head in range(num_heads)]
    return HeadPlan(q_index, kv_index, out_index, len(q_index) - num_heads)


def _select_heads(x, index):
    """x [b, h, s, d] -> [b, len(index), s, d]; index -1 gives a zero head."""
    if index == list(range(x.shape[1])):
        return x
    if -1 in index:
        zero = torch.zeros_like(x[:, :1])
        x = torch.cat([x, zero], dim=1)  # [b, h + 1, s, d]; slot h is the zero head
        index = [x.shape[1] - 1 if i < 0 else i for i in index]
    return x.index_select(1, torch.tensor(index, device=x.device))


def _token_order(token_index, document_ids):
    """Permutation sorting the gathered sequence into token order (None if not applicable)."""
    if document_ids is not None or not torch.equal(token_index, token_index[:1].expand_as(token_index)):
        return None
    perm = torch.argsort(token_index[0], stable=True)
    if torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
        return None
    return perm


def _local_inner(q, k, v, token_index, document_ids, softmax_scale):
    return blocks.masked_attention(q, k, v, token_index, token_index, document_ids, document_ids,
                                   softmax_scale)


def ulysses_attention(q, k, v, token_index, document_ids, group, softmax_scale=None,
                      allow_dummy_heads=True, inner_attention=None):
    """All-to-all (Ulysses) context-parallel attention over ``group``; differentiable.

    q: [b, nh, s/U, d]; k, v: [b, nkv, s/U, d]; token_index / document_ids: [b, s/U].
    Forward: head plan, all-to-all to [b, H/U, s, d], attention over the full sequence
    (``inner_attention(q, k, v, token_index, document_ids, scale)``, default a masked
    local attention; the hybrid passes ring attention over the outer group), all-to-all
    back, drop dummy heads. Backward: autograd through the all-to-all Functions (reverse
    all-to-alls) and the inner attention's own backward. Returns [b, nh, s/U, d].
    """
    size = comm.group_size(group)
    scale = blocks.softmax_scale_for(q, softmax_scale)
    plan = plan_heads(q.shape[1], k.shape[1], size, allow_dummy_heads)  # before any communication
    inner_attention = inner_attention or _local_inner

    q = _select_heads(q, plan.q_index)  # [b, H, s/U, d]
    kv = torch.stack([_select_heads(k, plan.kv_index), _select_heads(v, plan.kv_index)])
    # kv: [2, b, K, s/U, d]
    tokens = comm.gather_sequence(token_index, group)  # [b, s]
    docs = comm.gather_sequence(document_ids, group)  # [b, s] or None
    q = comm.seq_to_heads(q, group)  # [b, H/U, s, d]
    kv = comm.seq_to_heads(kv, group)  # [2, b, K/U, s, d]
    perm = _token_order(tokens, docs)
    if perm is not None:
        q = q.index_select(-2, perm)  # [b, H/U, s, d] in token order
        kv = kv.index_select(-2, perm)
        tokens = tokens.index_select(-1, perm)
    out = inner_attention(q, kv[0], kv[1], tokens, docs, scale)  # [b, H/U, s, d]
    if perm is not None:
        out = out.index_select(-2, torch.argsort(perm))  # back to the all-to-all order
    out = comm.heads_to_seq(out, group)  # [b, H, s/U, d]
    if plan.num_dummy_heads or plan.out_index != list(range(len(plan.out_index))):
        out = out.index_select(1, torch.tensor(plan.out_index, device=out.device))  # [b, nh, s/U, d]
    return out
