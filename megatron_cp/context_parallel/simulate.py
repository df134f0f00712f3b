"""Replays the distributed context-parallel algorithms in ONE process, for checks.

NCCL refuses two ranks on one GPU, so ``tools/gpu_check.py`` proves ring, Ulysses and hybrid
attention on a single GPU by computing every CP rank's share here, one rank after the other,
with the code the ranks themselves run:

- ring (p2p): ring.py's ``RingLayout`` (built from the stacked metadata, as the all-gather
  gives it), ``forward_blocks`` into an ``Accumulator`` per rank, ``backward_blocks`` and
  ``add_kv_grads``, visited in the ring's step order. A rank uses its own KV as passed at
  step 0 and a contiguous copy afterwards (what ``RingExchange`` delivers), and the dK/dV of
  block j is summed in the order it travels (rank j, j+1, ...), so the arithmetic is the
  distributed one, not merely an equivalent one.
- Ulysses (a2a): ulysses.py's head plan (dummy heads, repeated KV heads), token ordering
  and default inner attention; the all-to-all itself is replayed as the permutation it is
  (rank u receives head group u of every rank's tokens, in rank order, and back).
- hybrid (a2a+p2p): CP rank c = outer * U + inner (ParallelState's ``hcp_inner`` groups are
  U consecutive CP ranks); Ulysses over each inner group, and the inner attention of inner
  rank u is the simulated ring over the outer group of every u-th rank.

Inputs and outputs are lists indexed by CP rank (each rank's tensors as
``prepare_microbatch`` gives them: q [b, nh, s/P, d], k/v [b, nkv, s/P, d], token_index /
document_ids [b, s/P]); the results are differentiable with respect to every rank's q, k, v.
"""
from collections import namedtuple

import torch

from megatron_cp.context_parallel.kernels import attention_kernel
from megatron_cp.context_parallel.reference import softmax_scale_for
from megatron_cp.context_parallel.layout import RingLayout
from megatron_cp.context_parallel.ring import (Accumulator, add_kv_grads, backward_blocks,
                                               forward_blocks)
from megatron_cp.context_parallel.layout import token_order
from megatron_cp.context_parallel.ulysses import _local_inner, _permute, _select_heads, plan_heads

SIMULATED_COMM_TYPES = ("p2p", "a2a", "a2a+p2p")

InnerProblem = namedtuple("InnerProblem", "q k v token_index document_ids perm")
InnerProblem.__doc__ = """One Ulysses rank's inputs to its inner attention: q [b, H/U, s, d],
k/v [b, K/U, s, d] and the metadata [b, s] of the gathered sequence in token order; perm
[b, s] (or None) is the sort that put it in token order."""


# ----------------------------------------------------------------------------- ring (p2p)
def _as_received(x, step):
    """KV as a rank holds it at ring step ``step``: its own tensor (any layout) at step 0,
    a contiguous copy after (RingExchange sends contiguous tensors)."""
    return x if step == 0 else x.contiguous()


def ring_forward(qs, ks, vs, layout, softmax_scale, kernel):
    """Every rank's ring forward: (outs in q's dtype, lses fp32 [b, nh, s/P]), rank order."""
    size = layout.size
    outs, lses = [], []
    for rank, q in enumerate(qs):
        acc = Accumulator(q, vs[rank].shape[-1])
        for step in range(size):
            src = (rank - step) % size
            forward_blocks(q, _as_received(ks[src], step), _as_received(vs[src], step), layout,
                           rank, src, softmax_scale, acc, kernel)
        out, lse = acc.result()
        outs.append(out.to(q.dtype))
        lses.append(lse)
    return outs, lses


def ring_backward(douts, qs, ks, vs, outs, lses, layout, softmax_scale, kernel):
    """Every rank's ring backward, step by step: (dqs, dks, dvs) in the inputs' dtypes.

    At step t rank i recomputes its blocks against the KV of rank (i - t) mod P and adds its
    dK/dV share to that block's accumulator, which then moves on to rank i + 1 (a contiguous
    copy, as posted); after P steps every accumulator holds its owner's full gradient.
    """
    size = layout.size
    douts = [d.contiguous() for d in douts]
    dqs, dkvs = [None] * size, [None] * size
    for step in range(size):
        for rank in range(size):
            src = (rank - step) % size
            dqs[rank], kv_grads = backward_blocks(
                douts[rank], qs[rank], _as_received(ks[src], step), _as_received(vs[src], step),
                outs[rank], lses[rank], layout, rank, src, softmax_scale, dqs[rank], kernel)
            dkv = add_kv_grads(dkvs[src], kv_grads, ks[src].shape, vs[src].shape,
                               qs[rank].device)
            dkvs[src] = [t.contiguous() for t in dkv]  # [dk, dv] fp32, on to rank + 1
    dqs = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) if dq is None else dq
           for q, dq in zip(qs, dqs)]
    return ([dq.to(q.dtype) for dq, q in zip(dqs, qs)],
            [dkv[0].to(k.dtype) for dkv, k in zip(dkvs, ks)],
            [dkv[1].to(v.dtype) for dkv, v in zip(dkvs, vs)])


class _SimulatedRing(torch.autograd.Function):
    """Forward: ``ring_forward`` of all ranks (inputs q_0..q_{P-1}, k_0.., v_0..; outputs
    out_0..). Backward: ``ring_backward`` from every rank's output gradient. Saves each
    rank's q, k, v, out, lse, as each distributed rank does."""

    @staticmethod
    def forward(ctx, layout, softmax_scale, kernel, *qkv):
        size = layout.size
        qs, ks, vs = qkv[:size], qkv[size:2 * size], qkv[2 * size:]
        outs, lses = ring_forward(qs, ks, vs, layout, softmax_scale, kernel)
        ctx.layout, ctx.softmax_scale, ctx.kernel = layout, softmax_scale, kernel
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        size = ctx.layout.size
        saved = ctx.saved_tensors
        qs, ks, vs = saved[:size], saved[size:2 * size], saved[2 * size:3 * size]
        outs, lses = saved[3 * size:4 * size], saved[4 * size:]
        douts = [torch.zeros_like(o) if d is None else d for d, o in zip(douts, outs)]
        dqs, dks, dvs = ring_backward(douts, qs, ks, vs, outs, lses, ctx.layout,
                                      ctx.softmax_scale, ctx.kernel)
        return (None, None, None, *dqs, *dks, *dvs)


def simulated_ring_attention(qs, ks, vs, token_index, document_ids=None, softmax_scale=None,
                             kernel=None):
    """Ring (p2p) attention of P simulated ranks: lists of per-rank q [b, nh, s/P, d],
    k/v [b, nkv, s/P, d], token_index [b, s/P] and document_ids [b, s/P] (or None) ->
    list of per-rank outputs [b, nh, s/P, d] (differentiable)."""
    scale = softmax_scale_for(qs[0], softmax_scale)
    token_all = torch.stack(list(token_index))  # [P, b, s/P]: what the all-gather gives
    doc_all = None if document_ids is None else torch.stack(list(document_ids))
    layout = RingLayout.from_metadata(token_all, doc_all)
    return list(_SimulatedRing.apply(layout, scale, attention_kernel(kernel), *qs, *ks, *vs))


# ----------------------------------------------------------------------------- Ulysses (a2a)
def seq_to_heads(xs):
    """The all-to-all over U ranks: per rank [*, H, s, d] -> [*, H/U, U*s, d]; rank u gets
    head group u of every rank's tokens, the sequences concatenated in rank order."""
    size = len(xs)
    heads = xs[0].shape[-3] // size
    return [torch.cat([x.narrow(-3, u * heads, heads) for x in xs], dim=-2) for u in range(size)]


def heads_to_seq(ys):
    """The reverse all-to-all: per rank [*, H/U, U*s, d] -> [*, H, s, d]; rank u gets its
    own tokens (sequence slice u) of every head group, the heads in rank order."""
    size = len(ys)
    seq = ys[0].shape[-2] // size
    return [torch.cat([y.narrow(-2, u * seq, seq) for y in ys], dim=-3) for u in range(size)]


def ulysses_scatter(qs, ks, vs, token_index, document_ids, plan):
    """Each rank's side of ulysses_attention up to its inner attention (head plan, the
    all-to-all, the sort into token order): one :class:`InnerProblem` per rank."""
    q_all = seq_to_heads([_select_heads(q, plan.q_index) for q in qs])  # U x [b, H/U, s, d]
    kv_all = seq_to_heads([torch.stack([_select_heads(k, plan.kv_index),
                                        _select_heads(v, plan.kv_index)])
                           for k, v in zip(ks, vs)])  # U x [2, b, K/U, s, d]
    tokens = torch.cat(list(token_index), dim=1)  # [b, s]: gather_sequence
    docs = None if document_ids is None else torch.cat(list(document_ids), dim=1)
    perm = token_order(tokens)
    if perm is not None:
        tokens = tokens.gather(1, perm)
        docs = None if docs is None else docs.gather(1, perm)
    problems = []
    for q, kv in zip(q_all, kv_all):
        if perm is not None:
            q, kv = _permute(q, perm, 2), _permute(kv, perm, 3)  # token order
        problems.append(InnerProblem(q, kv[0], kv[1], tokens, docs, perm))
    return problems


def ulysses_gather(outs, perm, plan):
    """Each rank's side of ulysses_attention after its inner attention: back to the
    all-to-all order, the reverse all-to-all, real heads only -> per rank [b, nh, s/U, d]."""
    if perm is not None:
        back = torch.argsort(perm, dim=1)
        outs = [_permute(out, back, 2) for out in outs]
    outs = heads_to_seq(outs)  # U x [b, H, s/U, d]
    if plan.num_dummy_heads or plan.out_index != list(range(len(plan.out_index))):
        index = torch.tensor(plan.out_index, device=outs[0].device)
        outs = [out.index_select(1, index) for out in outs]
    return outs


def simulated_ulysses_attention(qs, ks, vs, token_index, document_ids=None, softmax_scale=None,
                                kernel=None, allow_dummy_heads=True):
    """Ulysses (a2a) attention of U simulated ranks (lists as in
    :func:`simulated_ring_attention`); the inner attention is ulysses.py's default one."""
    scale = softmax_scale_for(qs[0], softmax_scale)
    kernel = attention_kernel(kernel)
    plan = plan_heads(qs[0].shape[1], ks[0].shape[1], len(qs), allow_dummy_heads)
    problems = ulysses_scatter(qs, ks, vs, token_index, document_ids, plan)
    outs = [_local_inner(p.q, p.k, p.v, p.token_index, p.document_ids, scale, kernel=kernel)
            for p in problems]  # U x [b, H/U, s, d]
    return ulysses_gather(outs, problems[0].perm, plan)


# ----------------------------------------------------------------------------- hybrid
def simulated_hybrid_attention(qs, ks, vs, token_index, document_ids=None, inner_size=2,
                               softmax_scale=None, kernel=None, allow_dummy_heads=True):
    """a2a+p2p attention of P = U x R simulated ranks (U = ``inner_size``): Ulysses inside
    each group of U consecutive ranks, the simulated ring across the R groups."""
    size = len(qs)
    if inner_size < 1 or size % inner_size != 0:
        raise ValueError(f"inner_size ({inner_size}) must divide the number of ranks ({size})")
    outer_size = size // inner_size
    scale = softmax_scale_for(qs[0], softmax_scale)
    plan = plan_heads(qs[0].shape[1], ks[0].shape[1], inner_size, allow_dummy_heads)
    groups = [range(o * inner_size, (o + 1) * inner_size) for o in range(outer_size)]
    problems = [ulysses_scatter([qs[c] for c in g], [ks[c] for c in g], [vs[c] for c in g],
                                [token_index[c] for c in g],
                                None if document_ids is None else [document_ids[c] for c in g],
                                plan)
                for g in groups]  # [R][U]
    outs = [[None] * inner_size for _ in range(outer_size)]
    for u in range(inner_size):  # the outer (ring) group of every u-th rank
        ring = [problems[o][u] for o in range(outer_size)]
        docs = None if document_ids is None else [p.document_ids for p in ring]
        ring_outs = simulated_ring_attention([p.q for p in ring], [p.k for p in ring],
                                             [p.v for p in ring], [p.token_index for p in ring],
                                             docs, scale, kernel)
        for o in range(outer_size):
            outs[o][u] = ring_outs[o]
    result = []
    for o in range(outer_size):
        result += ulysses_gather(outs[o], problems[o][0].perm, plan)
    return result


def simulated_attention(comm_type, qs, ks, vs, token_index, document_ids=None,
                        hierarchical_sizes=None, softmax_scale=None, kernel=None,
                        allow_dummy_heads=True):
    """Dispatch to the simulation of ``comm_type`` ("p2p", "a2a", "a2a+p2p"; the hybrid takes
    ``hierarchical_sizes`` (U, R)). Lists of per-rank tensors in, per-rank outputs out."""
    if comm_type == "p2p":
        return simulated_ring_attention(qs, ks, vs, token_index, document_ids, softmax_scale,
                                        kernel)
    if comm_type == "a2a":
        return simulated_ulysses_attention(qs, ks, vs, token_index, document_ids, softmax_scale,
                                           kernel, allow_dummy_heads)
    if comm_type == "a2a+p2p":
        if hierarchical_sizes is None or hierarchical_sizes[0] * hierarchical_sizes[1] != len(qs):
            raise ValueError(f"a2a+p2p needs hierarchical_sizes (U, R) with U x R = {len(qs)} "
                             f"ranks; got {hierarchical_sizes}")
        return simulated_hybrid_attention(qs, ks, vs, token_index, document_ids,
                                          hierarchical_sizes[0], softmax_scale, kernel,
                                          allow_dummy_heads)
    raise ValueError(f"cp comm type {comm_type!r} cannot be simulated; use one of "
                     f"{list(SIMULATED_COMM_TYPES)}")
