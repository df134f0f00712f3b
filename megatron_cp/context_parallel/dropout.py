"""Attention dropout that every parallel layout draws identically: a counter-based hash mask.

Megatron-LM drops attention probabilities after the softmax (``dropout(softmax(S)) @ V``, the
kept ones scaled by 1/(1-p)) with a mask from the tensor-parallel RNG, so which element is
dropped depends on how the work is split over ranks and blocks. Here the keep bit of the
element (sample, head, query, key) is a pure function of where it sits in the run:

    (seed, layer number, the sample's number in the run's stream of training samples,
     the GLOBAL query head, the query's and the key's index in the unpadded sample)

evaluated by the counter-based integer hash of megatron_cp/layers/counter_hash.py (murmur3's
32-bit finaliser, chained over those words; exact integer arithmetic, the same bits on CPU
and CUDA). One process, TP heads, CP ring blocks / Ulysses head groups / all-gather, packed
documents with their CP padding, DP shards, PP stages and recomputation all ask for the same
bit of the same element, so every layout reproduces the one-process run.

Blockwise softmax with dropout. For one query row with scores S_j over its visible keys j:

    lse = log sum_j exp(S_j)      (every key, NO dropout: the softmax normaliser)
    P_j = exp(S_j - lse),   M_j = keep_j / (1 - p),   out = sum_j M_j P_j v_j.

A block B of the keys returns lse_B = log sum_{j in B} exp(S_j), also without dropout, and
out_B = sum_{j in B} M_j exp(S_j - lse_B) v_j: the dropped, rescaled exp-scores in the
numerator over the undropped normaliser. The log-sum-exp merge of the ring
(out = sum_B exp(lse_B - lse) out_B) then gives sum_j M_j exp(S_j - lse) v_j, exactly
dropout(softmax(S)) V, and the merged lse is the no-dropout one. Backward from the row's
final (out, lse): dV_j = sum_i M_ij P_ij dO_i, dP_ij = M_ij (dO_i . v_j) and
dS_ij = P_ij (dP_ij - D_i) with D_i = sum_j P_ij dP_ij = dO_i . out_i, the usual row term
(out already holds the dropped sum), so each block's gradient needs only (out, lse) of its
rows, as on the flash path.

Flash kernels cannot take an external mask, so this is plain PyTorch in fp32, on query tiles
of at most ``MAX_TILE_SCORES`` scores: a blockwise path never builds a whole-sequence mask.
"""
from collections import namedtuple

import torch

from megatron_cp.context_parallel import comm
from megatron_cp.context_parallel.reference import NEG_INF, attention_mask
from megatron_cp.layers.counter_hash import absorb, absorb_64, dropout_scale, keep_threshold

MAX_TILE_SCORES = 1 << 22  # scores [b, nh, rows, sk] of one query tile (and its int64 hash)

AttentionDropout = namedtuple("AttentionDropout", "p key samples heads positions")
AttentionDropout.__doc__ = """The dropout of one attention call. ``p``: the probability;
``key``: the (seed, layer) word of :func:`dropout_key`; ``samples`` [b] int64 (>= 0): each
sample's number in the run's stream of training samples; ``heads`` [nh] int64: the global
index of each query head of q (after the TP split and any Ulysses regrouping); ``positions``
[b, s_local] int64: each token's index in its unpadded sample, or None when the token index
is that (no CP document padding)."""

Side = namedtuple("Side", "index docs positions")
Side.__doc__ = """The tokens on one side of a block, each [b, n]: ``index`` (token index in
the padded sample: causality), ``docs`` (document ids or None) and ``positions`` (the hash's
coordinate)."""


def dropout_key(seed, layer_number):
    """The (seed, layer) part of the hash, a 32-bit int: the same on every rank."""
    return absorb(layer_number, absorb_64(seed, 0x9E3779B9))


def element_hash(key, samples, heads, q_positions, k_positions):
    """int64 [b, nh, sq, sk] in [0, 2^32): the hash of every element (sample, head, query,
    key). key: :func:`dropout_key`; samples [b] int64 (>= 0); heads [nh] int64; q_positions
    [b, sq] / k_positions [b, sk] int64: the coordinates (see the module docstring)."""
    state = absorb_64(samples, key)  # [b]
    state = absorb(heads[None, :], state[:, None])  # [b, nh]
    state = absorb(q_positions[:, None, :], state[:, :, None])  # [b, nh, sq]
    return absorb(k_positions[:, None, None, :], state[..., None])  # [b, nh, sq, sk]


def keep_mask(key, p, samples, heads, q_positions, k_positions):
    """bool [b, nh, sq, sk]: whether element (sample, head, query, key) is kept (arguments
    as in :func:`element_hash`)."""
    return element_hash(key, samples, heads, q_positions, k_positions) >= keep_threshold(p)


def _keep_multiplier(dropout, q_side, k_side, num_kv):
    """M = keep / (1 - p) as fp32 [b, nkv, g, sq, sk] (query head h = kv group x g + j)."""
    keep = keep_mask(dropout.key, dropout.p, dropout.samples, dropout.heads, q_side.positions,
                     k_side.positions)  # [b, nh, sq, sk]
    b, nh, sq, sk = keep.shape
    return keep.view(b, num_kv, nh // num_kv, sq, sk).float() * dropout_scale(dropout.p)


def _tiles(q, k):
    """(lo, hi) query-row ranges of at most MAX_TILE_SCORES scores each."""
    b, nh, sq, _ = q.shape
    rows = max(1, MAX_TILE_SCORES // max(1, b * nh * k.shape[2]))
    return [(lo, min(lo + rows, sq)) for lo in range(0, sq, rows)]


def _cut(side, lo, hi):
    """The rows lo..hi of one side."""
    return Side(side.index[:, lo:hi], None if side.docs is None else side.docs[:, lo:hi],
                side.positions[:, lo:hi])


def _scores(q, k, scale, q_side, k_side):
    """q [b, nh, t, d] -> (q fp32 [b, nkv, g, t, d], masked scores fp32 [b, nkv, g, t, sk])."""
    b, nh, t, d = q.shape
    num_kv = k.shape[1]
    qf = q.float().reshape(b, num_kv, nh // num_kv, t, d)
    scores = torch.einsum("bkgqd,bksd->bkgqs", qf, k.float()) * scale
    visible = attention_mask(q_side.index, k_side.index, q_side.docs, k_side.docs)  # [b, 1, t, sk]
    return qf, scores.masked_fill(~visible[:, :, None], NEG_INF)


def _finite(lse):
    """lse with -inf (rows that see no key) replaced by 0: their exp(S - lse) stays 0."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def dropout_block_forward(q, k, v, scale, dropout, q_side, k_side):
    """One block with dropout: q [b, nh, sq, d] against k/v [b, nkv, sk, d] -> (out fp32
    [b, nh, sq, d], lse fp32 [b, nh, sq]); out holds the dropped numerator over the
    undropped normaliser (module docstring), lse is the no-dropout one; rows that see no
    key give (0, -inf)."""
    b, nh, sq, d = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]  # d: the value head dim
    num_kv = k.shape[1]
    out = torch.empty(b, nh, sq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, nh, sq, dtype=torch.float32, device=q.device)
    vf = v.float()
    for lo, hi in _tiles(q, k):
        rows = _cut(q_side, lo, hi)
        _, scores = _scores(q[:, :, lo:hi], k, scale, rows, k_side)  # [b, nkv, g, t, sk]
        tile_lse = scores.logsumexp(-1)  # [b, nkv, g, t]
        probs = torch.exp(scores - _finite(tile_lse)[..., None])
        probs = probs * _keep_multiplier(dropout, rows, k_side, num_kv)
        out[:, :, lo:hi] = torch.einsum("bkgqs,bksd->bkgqd", probs, vf).reshape(b, nh, hi - lo, d)
        lse[:, :, lo:hi] = tile_lse.reshape(b, nh, hi - lo)
    return out, lse


def dropout_block_backward(dout, q, k, v, out, lse, scale, dropout, q_side, k_side):
    """Gradients (dq [b, nh, sq, d], dk, dv [b, nkv, sk, d], fp32) of one dropout block given
    the FINAL out and lse of its rows (the whole row's, merged over every block)."""
    b, nh, sq, d = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]  # d: the value head dim
    num_kv, group = k.shape[1], nh // k.shape[1]
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    for lo, hi in _tiles(q, k):
        rows, t = _cut(q_side, lo, hi), hi - lo
        qf, scores = _scores(q[:, :, lo:hi], k, scale, rows, k_side)  # [b, nkv, g, t, sk]
        probs = torch.exp(scores - _finite(lse[:, :, lo:hi]).reshape(b, num_kv, group, t, 1))
        multiplier = _keep_multiplier(dropout, rows, k_side, num_kv)
        dof = dout[:, :, lo:hi].float().reshape(b, num_kv, group, t, d)
        dv += torch.einsum("bkgqs,bkgqd->bksd", probs * multiplier, dof)
        dprobs = torch.einsum("bkgqd,bksd->bkgqs", dof, vf) * multiplier
        outf = out[:, :, lo:hi].float().reshape(b, num_kv, group, t, d)
        delta = (dof * outf).sum(-1, keepdim=True)  # D = dO . out (out holds the dropout)
        dscores = probs * (dprobs - delta)
        dq_tile = torch.einsum("bkgqs,bksd->bkgqd", dscores, kf)  # [b, nkv, g, t, d]
        dq[:, :, lo:hi] = dq_tile.reshape(b, nh, t, q.shape[-1]) * scale
        dk += torch.einsum("bkgqs,bkgqd->bksd", dscores, qf) * scale
    return dq, dk, dv


class _DropoutAttention(torch.autograd.Function):
    """Forward: :func:`dropout_block_forward` over the whole sequence, tile by tile. Backward:
    :func:`dropout_block_backward` (recomputes the scores and the mask). Saves q, k, v, out,
    lse."""

    @staticmethod
    def forward(ctx, q, k, v, side, dropout, scale):
        out, lse = dropout_block_forward(q, k, v, scale, dropout, side, side)
        out = out.to(q.dtype)
        ctx.side, ctx.dropout, ctx.scale = side, dropout, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = dropout_block_backward(dout, q, k, v, out, lse, ctx.scale, ctx.dropout,
                                            ctx.side, ctx.side)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def dropout_attention(q, k, v, token_index, document_ids, dropout, softmax_scale):
    """Differentiable self-attention of a whole sequence with ``dropout`` (an
    :class:`AttentionDropout`): q [b, nh, s, d], k/v [b, nkv, s, d]; token_index [b, s]
    (None: 0..s-1), document_ids [b, s] or None -> [b, nh, s, d] in q's dtype."""
    b, s = q.shape[0], q.shape[2]
    if token_index is None:
        token_index = torch.arange(s, device=q.device).expand(b, s)
    positions = token_index if dropout.positions is None else dropout.positions
    return _DropoutAttention.apply(q, k, v, Side(token_index, document_ids, positions), dropout,
                                   softmax_scale)


class RingDropout:
    """An AttentionDropout over the ranks of a ring: every rank's token index, document ids
    and positions stacked [P, b, s/P], so both sides of any block can be cut out."""

    def __init__(self, dropout, token_all, doc_all, group):
        self.dropout, self.token_all, self.doc_all = dropout, token_all, doc_all
        self.positions_all = token_all if dropout.positions is None else \
            comm.all_gather_stack(dropout.positions, group)  # [P, b, s/P]

    def side(self, rank, rows):
        """Rank ``rank``'s tokens at ``rows`` (a slice of its local sequence)."""
        docs = None if self.doc_all is None else self.doc_all[rank][:, rows]
        return Side(self.token_all[rank][:, rows], docs, self.positions_all[rank][:, rows])

    def forward(self, q, k, v, scale, rank, q_rows, src, kv_rows):
        """:func:`dropout_block_forward` of rank ``rank``'s queries at ``q_rows`` (q already
        cut) against rank ``src``'s keys at ``kv_rows``."""
        return dropout_block_forward(q, k, v, scale, self.dropout, self.side(rank, q_rows),
                                     self.side(src, kv_rows))

    def backward(self, dout, q, k, v, out, lse, scale, rank, q_rows, src, kv_rows):
        """:func:`dropout_block_backward` of the same block as :meth:`forward`."""
        return dropout_block_backward(dout, q, k, v, out, lse, scale, self.dropout,
                                      self.side(rank, q_rows), self.side(src, kv_rows))
