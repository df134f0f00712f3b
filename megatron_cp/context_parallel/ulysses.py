"""Ulysses attention (--cp-comm-type a2a) and the head bookkeeping it needs.

An all-to-all turns [b, H, s/U, d] into [b, H/U, s, d]: each rank then runs attention on
the whole sequence for H/U heads, and the reverse all-to-all brings the output back. The
all-to-alls are autograd Functions whose backward is the reverse all-to-all. The token
metadata is all-gathered so masks use global positions, and the gathered sequence is
sorted back into token order (per sample): a plain zigzag sample becomes an ordinary causal
sequence (fused causal kernel, no mask) and, in the hybrid, a zigzag over the outer ring;
with packed documents every document becomes one contiguous run, i.e. one causal segment
of a variable-length call instead of 2U x 2U small pieces.

Heads: the all-to-all needs the query heads and the KV heads to split evenly over U with
the GQA grouping intact on every rank. ``plan_heads`` repeats each KV head (when U does
not divide num_kv_heads, e.g. U > nkv) and, only when num_heads % U != 0, adds dummy zero
query heads (and possibly dummy KV heads) that are dropped after; gradients of repeated
KV heads are summed by autograd (index_select's backward).

Attention dropout: the inner attention gets the global head of each slot it holds and the
tokens' positions gathered in token order, so its mask is the one-process mask.
"""
import functools
import math
from collections import namedtuple

import torch

from megatron_cp.context_parallel import comm
from megatron_cp.context_parallel.blockwise import planned_attention
from megatron_cp.context_parallel.dropout import dropout_attention
from megatron_cp.context_parallel.kernels import attention_kernel
from megatron_cp.context_parallel.layout import SequenceLayout
from megatron_cp.context_parallel.reference import softmax_scale_for

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
    return x.index_select(1, _index_tensor(tuple(index), x.device))


@functools.lru_cache(maxsize=256)
def _index_tensor(index, device):
    """A head index (a tuple of ints) as an int64 tensor on ``device``, made once per
    layer shape (no host-to-device copy per call)."""
    return torch.tensor(index, dtype=torch.int64, device=device)


def _permute(x, perm, dim):
    """x with its sequence axis ``dim`` reordered per sample by perm [b, s]; the sample axis
    is the one just before the heads (x: [b, h, s, d] or [2, b, h, s, d])."""
    shape = [1] * x.dim()
    shape[dim - 2], shape[dim] = perm.shape  # [.., b, 1, s, 1]
    return x.gather(dim, perm.view(shape).expand(*x.shape[:dim], -1, *x.shape[dim + 1:]))


def _local_inner(q, k, v, token_index, document_ids, softmax_scale, kernel=None, dropout=None,
                 layout=None):
    """The default inner attention: the gathered sequence against itself, planned once by
    ``layout`` (the UlyssesView's inner SequenceLayout)."""
    if dropout is not None:
        return dropout_attention(q, k, v, token_index, document_ids, dropout, softmax_scale)
    if layout is None:
        layout = SequenceLayout(token_index, document_ids)
    kind, plan = layout.block_plan(q.shape[2], q.device)
    return planned_attention(q, k, v, kind, plan, softmax_scale, kernel)


def prepare_head_indices(num_heads, num_kv_heads, group, allow_dummy_heads, device):
    """Make the head index tensors an all-to-all over ``group`` will select with, on
    ``device``, before the layers run (they are cached: no host-to-device copy in a layer)."""
    plan = plan_heads(num_heads, num_kv_heads, comm.group_size(group), allow_dummy_heads)
    slots = len(plan.q_index) // comm.group_size(group)
    rank = comm.group_rank(group)
    for index in (plan.q_index, plan.kv_index, plan.out_index,
                  plan.q_index[rank * slots:(rank + 1) * slots]):
        _index_tensor(tuple(index), device)


def _inner_dropout(dropout, plan, group, perm):
    """The AttentionDropout of this rank's inner attention: the global heads of the head
    slots it receives (dummy slots: -1, their output is dropped) and the gathered positions
    in token order."""
    size, rank = comm.group_size(group), comm.group_rank(group)
    slots = len(plan.q_index) // size
    mine = _index_tensor(tuple(plan.q_index[rank * slots:(rank + 1) * slots]),
                         dropout.heads.device)
    heads = torch.where(mine >= 0, dropout.heads[mine.clamp(min=0)], -1)  # [H/U]
    positions = comm.gather_sequence(dropout.positions, group)  # [b, s] or None
    if positions is not None and perm is not None:
        positions = positions.gather(1, perm)
    return dropout._replace(heads=heads, positions=positions)


def ulysses_attention(q, k, v, token_index, document_ids, group, softmax_scale=None,
                      allow_dummy_heads=True, inner_attention=None, kernel=None, dropout=None,
                      layout=None):
    """All-to-all (Ulysses) context-parallel attention over ``group``; differentiable.

    q: [b, nh, s/U, d]; k, v: [b, nkv, s/U, d]; token_index / document_ids: [b, s/U].
    Forward: head plan, all-to-all to [b, H/U, s, d], attention over the full sequence
    (``inner_attention(q, k, v, token_index, document_ids, scale, dropout, layout)``, default
    a masked local attention; the hybrid passes ring attention over the outer group; layout:
    the gathered sequence's SequenceLayout),
    all-to-all back, drop dummy heads. Backward: autograd through the all-to-all Functions
    (reverse all-to-alls) and the inner attention's own backward. Returns [b, nh, s/U, d].
    ``kernel`` (AttentionKernel or name, None: "auto") runs the default inner attention.
    ``dropout``: an AttentionDropout for q's heads, or None; the inner attention gets it
    for the heads and the tokens it holds (the mask follows global heads and positions).
    ``layout``: the microbatch's SequenceLayout (layout.py), whose Ulysses view over
    ``group`` holds the gathered metadata, its token order and the inner plans (None:
    gathered and planned here).
    """
    size = comm.group_size(group)
    scale = softmax_scale_for(q, softmax_scale)
    plan = plan_heads(q.shape[1], k.shape[1], size, allow_dummy_heads)  # before any communication
    kernel = attention_kernel(kernel)
    if inner_attention is None:
        def inner_attention(q, k, v, tokens, docs, scale, dropout, layout):
            return _local_inner(q, k, v, tokens, docs, scale, kernel, dropout, layout)
    if layout is None:
        layout = SequenceLayout(token_index, document_ids)
    view = layout.ulysses(group)  # the gathered sequence, in token order, and its plans

    q = _select_heads(q, plan.q_index)  # [b, H, s/U, d]
    # k and v side by side on the last axis (their head dims may differ: MLA)
    kv = torch.cat([_select_heads(k, plan.kv_index), _select_heads(v, plan.kv_index)], dim=-1)
    # kv: [b, K, s/U, dk + dv]
    q = comm.seq_to_heads(q, group)  # [b, H/U, s, d]
    kv = comm.seq_to_heads(kv, group)  # [b, K/U, s, dk + dv]
    perm = view.perm
    if perm is not None:
        q = _permute(q, perm, 2)  # [b, H/U, s, d] in token order
        kv = _permute(kv, perm, 2)  # [b, K/U, s, dk + dv]
    if dropout is not None:
        dropout = _inner_dropout(dropout, plan, group, perm)
    k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)  # [b, K/U, s, dk], [.., dv]
    out = inner_attention(q, k, v, view.tokens, view.docs, scale, dropout,
                          view.inner)  # [b, H/U, s, dv]
    if perm is not None:
        out = _permute(out, view.inverse, 2)  # back to the all-to-all order
    out = comm.heads_to_seq(out, group)  # [b, H, s/U, d]
    if plan.num_dummy_heads or plan.out_index != list(range(len(plan.out_index))):
        out = out.index_select(1, _index_tensor(tuple(plan.out_index), out.device))  # [b, nh, s/U, d]
    return out
