"""The token layout of one microbatch, and every attention plan that follows from it,
worked out once before the layers.

Each attention layer needs from the microbatch's token metadata (``token_index`` and
``document_ids`` [b, s_local], on the device):

- no CP: whether the sample is plain causal (one SDPA call) or else its block plan
  (``classify_block``: dense causal, or the segments of its documents);
- ring and all-gather CP (p2p, all_gather): every CP rank's metadata [P, b, s/P] and the
  plans of this rank's queries against each rank's keys (:class:`RingLayout`);
- Ulysses (a2a): the metadata gathered to the full sequence [b, s], the permutation into
  token order and the plan of the whole sequence; the hybrid (a2a+p2p) then runs a ring over
  the outer group of that gathered sequence.

Working these out reads the metadata on the host (a device-to-host copy: a sync on a GPU)
and gathers it over the CP group (a collective). Done in each layer, that is a sync and a
collective per layer and microbatch, with the device idle meanwhile: measured on an H200, a
fixed ~1.3 ms per packed attention call. :class:`SequenceLayout` does it once: the model builds
one per microbatch and :meth:`SequenceLayout.prepare` is called for every attention layer
before the first layer runs (``GPTModel.forward``), which also copies each plan's index
tensors to the device; the layers then only look plans up, with no host sync and no
collective for the metadata. A caller that passes no layout (a test, the one-call
``context_parallel_attention``) gets a fresh one per call, computed on first use: the same
plans, the old cost.
"""
import torch

from megatron_cp.context_parallel import comm
from megatron_cp.context_parallel.blockwise import Block
from megatron_cp.context_parallel.partition import zigzag_indices
from megatron_cp.context_parallel.segments import classify_block, is_plain_arange


class RingLayout:
    """Which tokens every ring rank holds, and the block plan between any two ranks.

    ``token_all`` / ``doc_all``: [P, b, s_local] metadata of every rank (None in the zigzag
    fast path, where the layout is implied by the ranks themselves). Plans are cached, so
    the backward reuses the forward's (host copies of the metadata are made once).
    """

    def __init__(self, size, seq_local, token_all=None, doc_all=None, zigzag=False):
        self.size, self.seq_local = size, seq_local
        self.token_all, self.doc_all, self.zigzag = token_all, doc_all, zigzag
        self._host, self._plans = None, {}

    @classmethod
    def from_metadata(cls, token_all, doc_all):
        """Build from gathered metadata [P, b, s_local]; detects the plain zigzag layout."""
        size, _, seq_local = token_all.shape
        if doc_all is None and seq_local % 2 == 0:
            expected = torch.stack([zigzag_indices(r, size, size * seq_local, token_all.device)
                                    for r in range(size)])  # [P, s_local]
            if bool((token_all == expected[:, None, :]).all()):
                return cls(size, seq_local, zigzag=True)
        return cls(size, seq_local, token_all, doc_all)

    def plan(self, i, j):
        """Blocks of query rank i against the KV of rank j: a list of :class:`Block`."""
        everything = slice(None)
        if self.zigzag:
            half = self.seq_local // 2
            if j == i:
                return [Block(everything, everything, "causal", None)]
            if j < i:
                return [Block(everything, slice(0, half), "full", None)]
            return [Block(slice(half, None), everything, "full", None)]
        if (i, j) not in self._plans:
            if self._host is None:  # one device-to-host copy of the metadata per layout
                self._host = (self.token_all.cpu(),
                              None if self.doc_all is None else self.doc_all.cpu())
            tokens, docs = self._host
            kind, segments = classify_block(tokens[i], tokens[j], None if docs is None else docs[i],
                                            None if docs is None else docs[j])
            block = Block(everything, everything, kind, segments)
            self._plans[i, j] = [] if kind == "empty" else [block]
        return self._plans[i, j]


def token_order(tokens):
    """Per-sample permutation [b, s] sorting gathered metadata ``tokens`` [b, s] into token
    order, or None when every sample already is in order (reads the host: a sync)."""
    if bool((tokens[:, 1:] >= tokens[:, :-1]).all()):
        return None
    return torch.argsort(tokens, dim=1, stable=True)


class UlyssesView:
    """The sequence an Ulysses rank attends after its all-to-all: ``tokens`` / ``docs``
    [b, s] gathered over the group (rank order), ``perm`` [b, s] sorting them into token
    order (None when already sorted) and its inverse, and ``inner``: the
    :class:`SequenceLayout` of the sorted sequence (what the inner attention plans on)."""

    def __init__(self, token_index, document_ids, group):
        tokens = comm.gather_sequence(token_index, group)  # [b, s]
        docs = comm.gather_sequence(document_ids, group)  # [b, s] or None
        self.perm = token_order(tokens)  # [b, s] or None (zigzag chunks get sorted)
        self.inverse = None
        if self.perm is not None:
            self.inverse = torch.argsort(self.perm, dim=1)
            tokens = tokens.gather(1, self.perm)
            docs = None if docs is None else docs.gather(1, self.perm)
        self.tokens, self.docs = tokens, docs
        self.inner = SequenceLayout(tokens, docs)


class RingView:
    """Every rank's metadata over a ring's group, ``token_all`` / ``doc_all`` [P, b, s/P]
    (``doc_all`` None without documents), and ``plans``: the :class:`RingLayout`."""

    def __init__(self, token_index, document_ids, group):
        self.token_all = comm.all_gather_stack(token_index, group)  # [P, b, s/P]
        self.doc_all = None if document_ids is None else \
            comm.all_gather_stack(document_ids, group)  # [P, b, s/P]
        self.plans = RingLayout.from_metadata(self.token_all, self.doc_all)
        rank, device = comm.group_rank(group), token_index.device
        for src in range(comm.group_size(group)):  # this rank's queries against every KV
            for block in self.plans.plan(rank, src):
                if block.segments is not None:
                    block.segments.prepare(device)


class SequenceLayout:
    """One microbatch's token metadata and the attention plans derived from it, each
    computed once (on first use, or up front by :meth:`prepare`).

    ``token_index`` [b, s_local] (None: 0..s_local-1, the no-CP unpadded case) and
    ``document_ids`` [b, s_local] (None: one document per sample), on the device.
    """

    def __init__(self, token_index, document_ids):
        self.token_index, self.document_ids = token_index, document_ids
        self._memo = {}

    def once(self, key, build):
        """``build()``, computed the first time ``key`` is asked for in this microbatch (a
        layer kind that plans something of its own keeps it here too: Gated DeltaNet's packed
        rows for FLA)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def local(self, length, device):
        """The no-CP call over ``length`` tokens: (kind, plan) with kind "sdpa" (plain causal
        samples: one fused SDPA call) or what :meth:`block_plan` gives."""
        def build():
            if self.document_ids is None and is_plain_arange(self.token_index, length):
                return "sdpa", None
            return self.block_plan(length, device)
        return self.once(("local", length), build)

    def tokens(self, length, device):
        """``token_index`` or, when None, 0..length-1 [1, length] (broadcast over samples)."""
        if self.token_index is not None:
            return self.token_index
        return self.once(("arange", length),
                          lambda: torch.arange(length, device=device).unsqueeze(0))

    def block_plan(self, length, device):
        """(kind, plan) of the sequence against itself (``classify_block``), the plan's index
        tensors already on ``device``."""
        def build():
            tokens = self.tokens(length, device)
            if self.document_ids is not None and tokens.shape[0] != self.document_ids.shape[0]:
                tokens = tokens.expand(self.document_ids.shape[0], -1)
            kind, plan = classify_block(tokens, tokens, self.document_ids, self.document_ids)
            if plan is not None:
                plan.prepare(device)
            return kind, plan
        return self.once(("block", length), build)

    def ring(self, group):
        """The :class:`RingView` of a ring (or all-gather) over ``group``."""
        return self.once(("ring", group),
                          lambda: RingView(self.token_index, self.document_ids, group))

    def ulysses(self, group):
        """The :class:`UlyssesView` of an all-to-all over ``group``."""
        return self.once(("ulysses", group),
                          lambda: UlyssesView(self.token_index, self.document_ids, group))

    def prepare(self, attention, length, device):
        """Work out now what ``attention`` (a ContextParallelAttention, or None for the no-CP
        path) will look up, for sequences of ``length`` local tokens on ``device``."""
        if attention is None:
            self.local(length, device)
        else:
            attention.prepare(self, length, device)
        return self
