"""Ring attention (--cp-comm-type p2p): KV blocks travel around the CP ring.

Forward, on CP rank i of P: the local KV (k and v, only the KV heads, one batched message)
makes P-1 hops to rank+1; at step t rank i holds the KV of rank j = (i - t) mod P.
The next hop is posted (batched isend/irecv, side stream on GPU) before step t's block
attention, so it hides behind the compute. Each block returns (out, lse) and is merged
into fp32 accumulators with the exact log-sum-exp rule. The token metadata (token index,
document ids: [b, s/P] ints) is all-gathered once per microbatch instead of travelling:
the microbatch's SequenceLayout (layout.py) holds it with the block plans, for every layer.

Block plan. When every rank holds the plain zigzag layout (chunks r and 2P-1-r, no
documents) the three cases of CP_NOTES apply: j == i is the only masked block (the
kernel's causal flag, no mask tensor); j < i is Q(all) x KV(j, early half) unmasked;
j > i is Q(late half) x KV(j) unmasked. Otherwise (packed documents, any other layout)
each block is classified from the metadata on the host (segments.classify_block): empty
blocks are skipped, causal / fully visible ones run dense, and the rest run as a segment
plan (per-document variable-length calls, see segments.py), never with an [s, s] mask.
The plans (:class:`~.layout.RingLayout`) are computed once per microbatch
and reused by every layer's forward and backward.

Backward recomputes every block from the saved local q, k, v, out, lse (flash-attention
formulas with the final out and lse, see ``block_backward``). dQ accumulates locally. dK/dV
travel the ring WITH the KV: at step t rank i adds its share to the fp32 accumulator of
block j that arrived from rank i-1 and sends it on to rank i+1; after the last step one
more hop brings every accumulator home to its owner. We chose this over all-gather +
reduce-scatter because it keeps the memory at two KV blocks (never the full-sequence KV)
and every dKV hop overlaps the next step's compute. Saved for backward: local q, k, v,
out, lse, plus (on ctx, in the general case) the layout with its O(s) integer metadata and
segment plans; never [s, s] nor the full KV.

Kernels: an explicit ``kernel`` (AttentionKernel or its name, None = "auto") is passed down
to every block. With attention dropout every block of the same plan runs the plain dropout
block of dropout.py instead (its mask follows the global positions of both sides, which the
gathered metadata gives; the merge stays the log-sum-exp one, see dropout.py's derivation).
"""
import torch

from megatron_cp.context_parallel import comm
from megatron_cp.context_parallel.blockwise import (block_backward, block_forward,
                                                    merge_partial)
from megatron_cp.context_parallel.dropout import RingDropout
from megatron_cp.context_parallel.kernels import attention_kernel
from megatron_cp.context_parallel.layout import SequenceLayout
from megatron_cp.context_parallel.reference import softmax_scale_for
from megatron_cp.distributed.ring_exchange import RingExchange

_KV_TAG, _DKV_TAG = 10, 20  # + index of the tensor in the message


class Accumulator:
    """fp32 accumulators of one rank's attention: ``out`` [b, nh, s/P, dv], ``lse``
    [b, nh, s/P] (dv: the value head dim, ``value_dim``, default q's).

    They start unset: the first block covering every query row becomes the accumulator as
    is (no zero fill, no merge); any other block is merged with the log-sum-exp rule.
    """

    def __init__(self, q, value_dim=None):
        self.q, self.out, self.lse = q, None, None
        self.shape = (*q.shape[:3], q.shape[-1] if value_dim is None else value_dim)

    def add(self, q_sl, out_blk, lse_blk):
        if self.out is None and q_sl == slice(None):
            self.out, self.lse = out_blk.float(), lse_blk
            return
        if self.out is None:
            self._start_empty()
        merge_partial(self.out[:, :, q_sl], self.lse[:, :, q_sl], out_blk, lse_blk)

    def _start_empty(self):  # (0, -inf): the neutral element of the merge
        self.out = torch.zeros(self.shape, dtype=torch.float32, device=self.q.device)
        self.lse = torch.full(self.q.shape[:3], float("-inf"), dtype=torch.float32,
                              device=self.q.device)

    def result(self):
        """(out fp32 [b, nh, s/P, dv], lse fp32 [b, nh, s/P]); rows that saw no key: (0, -inf)."""
        if self.out is None:
            self._start_empty()
        return self.out, self.lse


def forward_blocks(q, k, v, layout, rank, src, softmax_scale, acc, kernel, dropout=None):
    """Attend the local q to rank ``src``'s KV (k, v [b, nkv, s/P, d]); merge into ``acc``.
    ``dropout`` (a RingDropout, or None): each block runs the plain dropout block instead of
    the kernel (the same blocks: the plan's slices hold every visible pair)."""
    for q_sl, kv_sl, kind, segments in layout.plan(rank, src):
        qb, kb, vb = q[:, :, q_sl], k[:, :, kv_sl], v[:, :, kv_sl]
        if dropout is None:
            out_blk, lse_blk = block_forward(qb, kb, vb, softmax_scale, kind, segments, kernel)
        else:
            out_blk, lse_blk = dropout.forward(qb, kb, vb, softmax_scale, rank, q_sl, src, kv_sl)
        acc.add(q_sl, out_blk, lse_blk)


def _add_into(acc, sl, grad, shape):
    """acc[:, :, sl] += grad, creating acc (the grad itself when it covers everything)."""
    if acc is None:
        if sl == slice(None):
            return grad
        acc = torch.zeros(shape, dtype=torch.float32, device=grad.device)
    acc[:, :, sl] += grad
    return acc


def backward_blocks(dout, q, k, v, out, lse, layout, rank, src, softmax_scale, dq, kernel,
                    dropout=None):
    """Gradients of the blocks against rank ``src``'s KV, from the final out and lse.

    Adds into dq (fp32 [b, nh, s/P, d] or None) and returns (dq, [(kv slice, dk, dv), ...]):
    the KV gradients are returned per block so the caller adds them where they belong.
    ``dropout``: as in :func:`forward_blocks`.
    """
    kv_grads = []
    for q_sl, kv_sl, kind, segments in layout.plan(rank, src):
        block = (dout[:, :, q_sl], q[:, :, q_sl], k[:, :, kv_sl], v[:, :, kv_sl],
                 out[:, :, q_sl], lse[:, :, q_sl], softmax_scale)
        if dropout is None:
            dq_blk, dk_blk, dv_blk = block_backward(*block, kind, segments, kernel)
        else:
            dq_blk, dk_blk, dv_blk = dropout.backward(*block, rank, q_sl, src, kv_sl)
        dq = _add_into(dq, q_sl, dq_blk, q.shape)
        kv_grads.append((kv_sl, dk_blk, dv_blk))
    return dq, kv_grads


def add_kv_grads(dkv, kv_grads, k_shape, v_shape, device):
    """Add per-block (slice, dk, dv) into the pair dkv = [dk, dv] (fp32, created if None;
    ``k_shape`` / ``v_shape``: the full shapes, whose head dims may differ)."""
    dk, dv = (None, None) if dkv is None else dkv
    for kv_sl, dk_blk, dv_blk in kv_grads:
        dk, dv = _add_into(dk, kv_sl, dk_blk, k_shape), _add_into(dv, kv_sl, dv_blk, v_shape)
    if dk is None:
        dk = torch.zeros(k_shape, dtype=torch.float32, device=device)
        dv = torch.zeros(v_shape, dtype=torch.float32, device=device)
    return [dk, dv]


class _RingAttention(torch.autograd.Function):
    """Forward: ring attention (see module docstring). Backward: blockwise recompute with dK/dV
    riding the ring home. Inputs q [b, nh, s/P, d], k/v [b, nkv, s/P, d]."""

    @staticmethod
    def forward(ctx, q, k, v, token_index, document_ids, group, softmax_scale, kernel, dropout,
                sequence_layout):
        size, rank = comm.group_size(group), comm.group_rank(group)
        view = sequence_layout.ring(group)  # every rank's metadata [P, b, s/P] and the plans
        layout = view.plans
        if dropout is not None:
            dropout = RingDropout(dropout, view.token_all, view.doc_all, group)

        acc = Accumulator(q, v.shape[-1])
        kv = [k, v]  # [b, nkv, s/P, dk], [.., dv]: the only tensors that travel
        ring = RingExchange(group, q.device, _KV_TAG) if size > 1 else None
        for step in range(size):
            if step + 1 < size:
                ring.post(kv)  # next step's KV travels while this step computes
            forward_blocks(q, kv[0], kv[1], layout, rank, (rank - step) % size, softmax_scale, acc,
                           kernel, dropout)
            if step + 1 < size:
                kv = ring.wait()
        out_acc, lse_acc = acc.result()
        out = out_acc.to(q.dtype)
        ctx.group, ctx.softmax_scale, ctx.layout, ctx.kernel = group, softmax_scale, layout, kernel
        ctx.dropout = dropout
        ctx.save_for_backward(q, k, v, out, lse_acc)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, layout, kernel = ctx.group, ctx.softmax_scale, ctx.layout, ctx.kernel
        size, rank = comm.group_size(group), comm.group_rank(group)
        dout = dout.contiguous()

        dq, dkv, kv = None, None, [k, v]
        kv_ring = RingExchange(group, q.device, _KV_TAG) if size > 1 else None
        dkv_ring = RingExchange(group, q.device, _DKV_TAG) if size > 1 else None
        for step in range(size):
            if step + 1 < size:
                kv_ring.post(kv)
            dq, kv_grads = backward_blocks(dout, q, kv[0], kv[1], out, lse, layout, rank,
                                           (rank - step) % size, scale, dq, kernel, ctx.dropout)
            # Block src's dK/dV so far arrived from rank-1 during the compute; add ours.
            incoming = dkv_ring.wait() if step > 0 else None
            dkv = add_kv_grads(incoming, kv_grads, k.shape, v.shape, q.device)  # [dk, dv] fp32
            if size > 1:
                dkv_ring.post(dkv)  # on to rank+1; arrives home after the last hop
            if step + 1 < size:
                kv = kv_ring.wait()
        if size > 1:
            dkv = dkv_ring.wait()  # our own KV's gradient, complete
        if dq is None:
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None,
                None, None, None)


def ring_attention(q, k, v, token_index, document_ids, group, softmax_scale=None, kernel=None,
                   dropout=None, layout=None):
    """Ring (p2p) context-parallel attention over ``group``; differentiable wrt q, k, v.

    q: [b, nh, s/P, d]; k, v: [b, nkv, s/P, d] (GQA: only the KV heads travel; v may have
    a head dim of its own, as the output then has);
    token_index / document_ids: [b, s/P] int64 (document_ids may be None). Returns
    [b, nh, s/P, d] in q's dtype. All ranks must pass the same local length. ``kernel``:
    an AttentionKernel or its name (None: "auto"). ``dropout``: an AttentionDropout (every
    block then runs the plain dropout block, see dropout.py) or None. ``layout``: the
    microbatch's SequenceLayout (layout.py), whose ring view over ``group`` holds the
    gathered metadata and the block plans (None: gathered and planned here).
    """
    scale = softmax_scale_for(q, softmax_scale)
    if layout is None:
        layout = SequenceLayout(token_index, document_ids)
    return _RingAttention.apply(q, k, v, token_index, document_ids, group, scale,
                                attention_kernel(kernel), dropout, layout)
