"""Segment planning: one attention block as variable-length runs of single documents.

A block is a set of query tokens (token index and document id of each, ``[b, sq]``) against
a set of key tokens (``[b, sk]``). A query sees a key when both are in the same document and
the key's token index is not larger. The planner cuts the block into *segments*, each a
contiguous range of query rows against a contiguous range of key rows, of two kinds:

- "causal": the query and key rows hold the same token range of one document (a diagonal:
  query i sees keys 0..i of the segment);
- "full": every key of the segment comes before every query (no mask at all).

How: split the queries and the keys into *runs* (maximal stretches of one document whose
token indices go up by one). A query run ``[a, a+n)`` against a key run ``[c, c+m)`` of the
same document gives at most three segments: the keys before ``a`` (full, all queries), the
overlap ``[max(a, c), min(a+n, c+m))`` (causal), and the queries after the overlap against
it (full). Full segments that share a key range and touch along the query rows (or share a
query range and touch along the key rows) are merged, so a zigzag document block gives one
segment per (query chunk, key chunk) pair at most. All of it is int arithmetic on the host,
with no Python loop over segments.

Every causal segment then goes into ONE variable-length call and every full segment into
another (:class:`SegmentCall`: the packed row indices and the cumulative lengths the
varlen kernels take); the executor in blockwise.py merges their partial results per query
row with the log-sum-exp rule. Rows are flat: row ``n * sq + i`` is query ``i`` of sample
``n`` (keys likewise with ``sk``). :func:`classify_block` decides first whether a block is
simpler than that (one causal or full dense call, or empty); its results are memoised by
the content of the metadata, because every layer of a step sees the same token indices and
document ids (the first layer plans, the others look the plan up).
"""
from collections import OrderedDict

import torch

CAUSAL, FULL = 0, 1
KIND_NAMES = {CAUSAL: "causal", FULL: "full"}
_Q_START, _Q_LEN, _K_START, _K_LEN = 1, 2, 3, 4  # columns of the [n, 5] segment table


def _expand(starts, lengths):
    """Concatenated ranges ``[start, start + length)``: [sum(lengths)] int64."""
    total = int(lengths.sum())
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # [total]
    offsets = torch.cumsum(lengths, 0) - lengths
    return starts[owner] + torch.arange(total) - offsets[owner]


class SegmentCall:
    """The segments of one kind, packed for one variable-length attention call.

    ``q_rows`` [Tq] / ``k_rows`` [Tk] (int64, host): the flat block rows in packed order;
    ``cu_q`` / ``cu_k`` [num_segments + 1] (int32, host): cumulative segment lengths;
    ``max_q`` / ``max_k``: the longest segment; ``q_identity`` / ``k_identity``: the packed
    rows are exactly all rows in order (no gather needed); ``q_unique``: no query row is
    packed twice.
    """

    def __init__(self, causal, q_start, q_len, k_start, k_len, num_q_rows, num_k_rows):
        self.causal = causal
        self.q_rows, self.k_rows = _expand(q_start, q_len), _expand(k_start, k_len)
        self.cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), q_len.cumsum(0)]).to(torch.int32)
        self.cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), k_len.cumsum(0)]).to(torch.int32)
        self.max_q, self.max_k = int(q_len.max()), int(k_len.max())
        self.q_identity = _is_identity(self.q_rows, num_q_rows)
        self.k_identity = _is_identity(self.k_rows, num_k_rows)
        self.q_unique = bool((q_start[1:] >= q_start[:-1] + q_len[:-1]).all())
        self.square = torch.equal(self.cu_q, self.cu_k)  # each segment: as many keys as queries
        # scores of the segments padded to a batch [n, max_q, max_k] over their own scores
        self._padded_cost = (q_len.numel() * self.max_q * self.max_k
                             / float((q_len.double() * k_len.double()).sum()))
        self._bounds, self._on_device = None, {}

    @property
    def num_segments(self):
        return self.cu_q.numel() - 1

    def bounds(self):
        """[((q0, q1), (k0, k1)), ...]: each segment's packed query and key range (ints)."""
        if self._bounds is None:
            cq, ck = self.cu_q.tolist(), self.cu_k.tolist()
            self._bounds = [((cq[i], cq[i + 1]), (ck[i], ck[i + 1])) for i in range(len(cq) - 1)]
        return self._bounds

    def padded_cost(self):
        """Scores of the segments padded to a batch [num_segments, max_q, max_k] over the
        scores of the segments themselves (1.0: no padding waste)."""
        return self._padded_cost

    def padded_index(self, device):
        """None when every segment has ``max_q`` rows (the padded batch is a view of the
        packed rows); else (source [n * max_q], target [Tq]) int64 on ``device``: the packed
        row each batch row takes (Tq, one past the last, for padding: a zero row) and the
        batch row each packed row sits at (segment i, offset j -> i * max_q + j). Cached
        like :meth:`on`."""
        key = ("padded", str(device))
        if key not in self._on_device:
            lengths = (self.cu_q[1:] - self.cu_q[:-1]).long()
            index = None
            if not bool((lengths == self.max_q).all()):
                total = int(lengths.sum())
                target = _expand(torch.arange(lengths.numel()) * self.max_q, lengths)  # [Tq]
                source = torch.full((self.num_segments * self.max_q,), total, dtype=torch.int64)
                source[target] = torch.arange(total)
                index = (source.to(device), target.to(device))
            self._on_device[key] = index
        return self._on_device[key]

    def on(self, device):
        """(q_rows, k_rows, cu_q, cu_k) on ``device``, copied once and cached."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = tuple(t.to(device) for t in
                                         (self.q_rows, self.k_rows, self.cu_q, self.cu_k))
        return self._on_device[key]


def _is_identity(rows, num_rows):
    return rows.numel() == num_rows and bool((rows == torch.arange(num_rows)).all())


class SegmentPlan:
    """All segments of one block: ``table`` [n, 5] int64 (kind, q_start, q_len, k_start,
    k_len; flat rows), sorted by kind, then query and key start; ``calls``: one
    :class:`SegmentCall` per kind present (causal first)."""

    def __init__(self, table, num_q_rows, num_k_rows):
        self.table, self.num_q_rows, self.num_k_rows = table, num_q_rows, num_k_rows
        self.calls = []
        self.every_row_sees_itself = False  # a causal call over every query row, in order
        for kind in (CAUSAL, FULL):
            part = table[table[:, 0] == kind]
            if part.shape[0]:
                call = SegmentCall(kind == CAUSAL, part[:, _Q_START], part[:, _Q_LEN],
                                   part[:, _K_START], part[:, _K_LEN], num_q_rows, num_k_rows)
                self.calls.append(call)
                self.every_row_sees_itself |= call.causal and call.q_identity

    @property
    def num_segments(self):
        return self.table.shape[0]

    def prepare(self, device):
        """Copy every call's index tensors (and padded-batch index) to ``device`` and list
        its segment bounds now, so the attention calls that use this plan find them ready
        (no host-to-device copy, no host read inside a layer)."""
        for call in self.calls:
            call.on(device)
            call.bounds()  # the segment loop's host ints (CPU and fp32 kernels)
            if call.causal and call.square:
                call.padded_index(device)
        return self

    def as_tuples(self):
        """[(kind name, q_start, q_len, k_start, k_len), ...]: for tests and printing."""
        return [(KIND_NAMES[row[0]], *row[1:]) for row in self.table.tolist()]


def _runs(tokens, docs):
    """Maximal runs of one document with consecutive token indices, per sample.

    tokens / docs: [b, s] int64 (host). Returns (flat start, length, sample, document,
    first token) of every run, each [num_runs]; a run never crosses a sample.
    """
    b, s = tokens.shape
    flat_t, flat_d = tokens.reshape(-1), docs.reshape(-1)  # [b * s]
    breaks = torch.ones(b * s, dtype=torch.bool)
    breaks[1:] = (flat_t[1:] != flat_t[:-1] + 1) | (flat_d[1:] != flat_d[:-1])
    breaks[::s] = True  # every sample starts a run
    starts = torch.nonzero(breaks).flatten()
    lengths = torch.diff(starts, append=torch.tensor([b * s]))
    return starts, lengths, starts // s, flat_d[starts], flat_t[starts]


def _same_document_pairs(q_sample, q_doc, k_sample, k_doc):
    """(query run, key run) index pairs with the same sample and document: ([p], [p])."""
    low = int(torch.minimum(q_doc.min(), k_doc.min()))
    span = int(torch.maximum(q_doc.max(), k_doc.max())) - low + 1
    q_key, k_key = q_sample * span + (q_doc - low), k_sample * span + (k_doc - low)
    order = torch.argsort(k_key, stable=True)
    sorted_keys = k_key[order]
    first = torch.searchsorted(sorted_keys, q_key)
    counts = torch.searchsorted(sorted_keys, q_key, right=True) - first  # key runs per query run
    q_index = torch.repeat_interleave(torch.arange(q_key.numel()), counts)  # [p]
    offsets = torch.cumsum(counts, 0) - counts
    k_index = order[first[q_index] + torch.arange(q_index.numel()) - offsets[q_index]]
    return q_index, k_index


def _decompose(q_start, n, a, k_start, m, c):
    """Segments of query runs (rows from q_start, n tokens from index a) against key runs
    (rows from k_start, m tokens from index c), all [p]: the [n_seg, 5] table, unsorted."""
    before = torch.clamp(torch.minimum(c + m, a) - c, min=0)  # keys before the first query
    lo, hi = torch.maximum(a, c), torch.minimum(a + n, c + m)
    overlap = torch.clamp(hi - lo, min=0)
    after = torch.where(overlap > 0, a + n - hi, torch.zeros_like(n))  # queries past the overlap
    parts = [
        (before > 0, FULL, q_start, n, k_start, before),
        (overlap > 0, CAUSAL, q_start + (lo - a), overlap, k_start + (lo - c), overlap),
        (after > 0, FULL, q_start + (hi - a), after, k_start + (lo - c), overlap),
    ]
    rows = []
    for keep, kind, qs, ql, ks, kl in parts:
        kind_col = torch.full_like(qs, kind)
        rows.append(torch.stack([kind_col, qs, ql, ks, kl], dim=1)[keep])  # [n_keep, 5]
    return torch.cat(rows)


def _lexsort(*keys):
    """Indices sorting rows by keys[0], then keys[1], ... (stable sorts, last key first)."""
    order = torch.arange(keys[0].numel())
    for key in reversed(keys):
        order = order[torch.argsort(key[order], stable=True)]
    return order


def _merge_touching(table, start, length, other_start, other_len):
    """Merge rows of a full-segment table that share (other_start, other_len) and whose
    [start, start + length) ranges touch; columns are given by index."""
    if table.shape[0] < 2:
        return table
    table = table[_lexsort(table[:, other_start], table[:, other_len], table[:, start])]
    same = (table[1:, other_start] == table[:-1, other_start]) & \
           (table[1:, other_len] == table[:-1, other_len])
    touching = table[1:, start] == table[:-1, start] + table[:-1, length]
    joins = torch.cat([torch.zeros(1, dtype=torch.bool), same & touching])  # row joins the previous
    group = torch.cumsum(~joins, 0) - 1  # [n]
    merged = table[~joins].clone()
    merged[:, length] = torch.zeros(merged.shape[0], dtype=table.dtype).index_add_(
        0, group, table[:, length])
    return merged


def plan_segments(tq, tk, dq=None, dk=None):
    """The :class:`SegmentPlan` of queries (tq, dq [b, sq]) against keys (tk, dk [b, sk]).

    tq / tk: token indices; dq / dk: document ids or None (one document). Int tensors on any
    device; the plan is computed on the host.
    """
    tq, tk = tq.cpu().long(), tk.cpu().long()
    dq = torch.zeros_like(tq) if dq is None else dq.cpu().long()
    dk = torch.zeros_like(tk) if dk is None else dk.cpu().long()
    (b, sq), sk = tq.shape, tk.shape[1]
    q_start, q_len, q_sample, q_doc, q_first = _runs(tq, dq)
    k_start, k_len, k_sample, k_doc, k_first = _runs(tk, dk)
    qi, ki = _same_document_pairs(q_sample, q_doc, k_sample, k_doc)
    table = _decompose(q_start[qi], q_len[qi], q_first[qi], k_start[ki], k_len[ki], k_first[ki])
    causal, full = table[table[:, 0] == CAUSAL], table[table[:, 0] == FULL]
    for along_q in (True, False, True):  # queries of one key range, keys of one query range, again
        q_cols, k_cols = (_Q_START, _Q_LEN), (_K_START, _K_LEN)
        full = _merge_touching(full, *(q_cols + k_cols if along_q else k_cols + q_cols))
    table = torch.cat([causal, full])
    table = table[_lexsort(table[:, 0], table[:, _Q_START], table[:, _K_START])]
    return SegmentPlan(table, b * sq, b * sk)


def _contiguous_rows(tokens):
    steps = torch.arange(tokens.shape[1])
    return bool((tokens == tokens[:, :1] + steps).all())


def _one_document(dq, dk):
    """True when every sample's queries and keys all carry one and the same document id."""
    first = dq[:, :1]
    return bool((dq == first).all()) and bool((dk == first).all())


_MEMO = OrderedDict()  # metadata content -> (metadata, classify result); least recent first
_MEMO_SIZE = 64


def classify_block(tq, tk, dq=None, dk=None):
    """How one block runs: (kind, plan) with kind "causal" | "full" | "empty" | "segments".

    "causal": queries and keys are the same contiguous token range of one document (the
    dense kernel's causal flag); "full": every query sees every key; "empty": no query sees
    any key (skip the block); "segments": the :class:`SegmentPlan` returned. Host work on
    O(sq + sk) ints (one device-to-host copy of the metadata); never an [sq, sk] tensor.
    Memoised on the metadata's content (the same plan object is returned for equal inputs).
    """
    host = {}  # one device-to-host copy per distinct tensor (the no-CP path: tq is tk)
    for t in (tq, tk, dq, dk):
        if t is not None and id(t) not in host:
            host[id(t)] = t.cpu().long().contiguous()
    meta = tuple(None if t is None else host[id(t)] for t in (tq, tk, dq, dk))
    key = tuple(None if t is None else (tuple(t.shape), hash(t.numpy().tobytes())) for t in meta)
    hit = _MEMO.get(key)
    if hit is not None and all(a is b or (a is not None and b is not None and torch.equal(a, b))
                               for a, b in zip(hit[0], meta)):
        _MEMO.move_to_end(key)
        return hit[1]
    result = _classify(*meta)
    _MEMO[key] = (meta, result)
    if len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return result


def _classify(tq, tk, dq, dk):
    """classify_block on host int64 metadata, not memoised."""
    if dq is not None:
        if _one_document(dq, dk):
            dq = dk = None
    if dq is None:
        if tq.shape == tk.shape and torch.equal(tq, tk) and _contiguous_rows(tq):
            return "causal", None
        if bool((tk.amax(1) <= tq.amin(1)).all()):
            return "full", None
    plan = plan_segments(tq, tk, dq, dk)
    if plan.num_segments == 0:
        return "empty", None
    return "segments", plan


def is_plain_arange(token_index, length):
    """True when ``token_index`` is None or every row of it [b, s] is 0, 1, ..., length-1."""
    if token_index is None:
        return True
    ref = torch.arange(length, device=token_index.device)
    return token_index.shape[-1] == length and bool((token_index == ref).all())
