"""Gated DeltaNet (a recurrent token mixer) under context parallelism, chosen by --cp-comm-type.

A GDN token depends on the conv inputs of the w-1 tokens before it and on the recurrent
state of everything before it in its document, so a CP rank cannot run its shard alone.
Two ways, both exact against one process:

- **a2a** (Megatron-LM's way): an all-to-all turns the in_proj rows [s/CP, all key heads]
  into [s, key heads/CP] (whole key heads with their value heads, the conv channels
  included), the gathered sequence is sorted into token order (zigzag undone), the layer
  runs conv + recurrence over the whole sequence with the global document ids, and the
  gated output goes back with the reverse all-to-all.
- **state passing** (p2p and all_gather over the CP group; a2a+p2p: a2a over the inner
  group, then state passing over the outer ring): with the per-document zigzag split every
  rank holds, of every document, its early chunk p and its late chunk 2P-1-p (in token
  order: the first and second half of the document's local tokens). Each chunk of every
  document becomes one row of a batch and runs with a zero state; the gated delta rule is
  linear in its initial state (S_end = A S_in + S_zero, o_t += S_in^T P_t), so one kernel
  call with v widened by dk zero columns and initial state [0 | I] also yields A and P.
  The (S_zero, A) of every chunk and the last w-1 conv inputs of every chunk are
  all-gathered (one named autograd Function each: backward reduce-scatters the gradients
  home) and chained in fp32 in GLOBAL chunk order 0, 1, ..., 2P-1 of each document; the
  chain starts from zero at each document's chunk 0, so nothing crosses a document
  boundary and every shard boundary inside a document carries state and conv tail.
"""
import torch

from megatron_cp.context_parallel import comm
from megatron_cp.context_parallel.layout import SequenceLayout
from megatron_cp.context_parallel.ulysses import _permute
from megatron_cp.layers.gated_delta_rule import chunk_gated_delta_rule, fla_packed_rows


class _GatherStack(torch.autograd.Function):
    """Forward: all-gather x from every rank of the group -> [size, *x.shape].
    Backward: reduce-scatter the gradient, so each rank gets the sum over all ranks of the
    gradient of its own slot."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather_stack(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter_stack(grad, ctx.group), None


def _chunk_rows(document_ids, b, s, device):
    """Rows of the local chunks: (index [2K, c_max] into the flattened [b * s] tokens, valid
    [2K, c_max] bool, length [K]); rows 0..K-1 are the early chunks of the K documents (all
    samples, in order), rows K..2K-1 their late chunks. Without document ids each sample is
    one document."""
    starts, lengths = [], []
    for n in range(b):
        counts = [s] if document_ids is None else \
            torch.unique_consecutive(document_ids[n], return_counts=True)[1].tolist()
        start = n * s
        for count in counts:
            assert count % 2 == 0, "each document holds two equal zigzag chunks per rank"
            starts.append(start)
            lengths.append(count // 2)
            start += count
    starts = torch.tensor(starts, device=device)
    length = torch.tensor(lengths, device=device)  # [K]
    offsets = torch.arange(max(lengths), device=device)  # [c_max]
    valid = (offsets < length[:, None]).repeat(2, 1)  # [2K, c_max]
    first = torch.cat([starts, starts + length])  # [2K]
    index = torch.where(valid, first[:, None] + offsets, 0)  # [2K, c_max]
    return index, valid, length


def chunk_layout(document_ids, b, s, device):
    """What state passing reads of the documents, worked out once per microbatch (it reads
    the document lengths on the host): (index, valid, length) of :func:`_chunk_rows` and
    ``slot`` [b * s], the row slot of every token (the gather back to token order)."""
    index, valid, length = _chunk_rows(document_ids, b, s, device)
    slot = torch.empty(b * s, dtype=torch.long, device=device)
    slot[index[valid]] = torch.nonzero(valid.flatten()).flatten()
    return index, valid, length, slot


def _chunks(layout, document_ids, b, s, device):
    """:func:`chunk_layout` of the sequence ``layout`` describes, computed once in it."""
    return layout.once(("gdn_chunks", b, s), lambda: chunk_layout(document_ids, b, s, device))


def _owner(chunk, size):
    """(group rank, row half) holding global chunk ``chunk`` of 2*size: early or late."""
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)


def _chain(gathered, size, rank, step):
    """Run a chain over the global chunks 0..2P-1 of every document: gathered [P, 2K, ...]
    (each rank's per-chunk data, early rows then late rows); ``step(carry, data)`` gives
    the next chunk's incoming carry (None: chunk 0's, zero). Returns this rank's incoming
    carries [2K, ...] (early chunk p, late chunk 2P-1-p)."""
    num_docs = gathered.shape[1] // 2
    carries, carry = [], None
    for chunk in range(2 * size):
        carries.append(carry)
        owner, half = _owner(chunk, size)
        carry = step(carry, gathered[owner, half * num_docs:(half + 1) * num_docs])
    carries[0] = torch.zeros_like(carries[1])  # every document starts from zero
    return torch.cat([carries[rank], carries[2 * size - 1 - rank]])  # [2K, ...]


def _last_inputs(mixed, length, width):
    """The last ``width`` real inputs of each chunk row, zeros before a short chunk's start:
    mixed [2K, c_max, C] -> [2K, width, C]."""
    length = length.repeat(2)  # [2K]
    pos = length[:, None] - width + torch.arange(width, device=mixed.device)  # [2K, width]
    window = mixed.gather(1, pos.clamp(min=0)[..., None].expand(-1, -1, mixed.shape[-1]))
    return window * (pos >= 0)[..., None]


def _next_tail(width, shift):
    """Chain step of the conv tail: the last ``width`` inputs before the next chunk are the
    last ``width`` of (incoming tail, this chunk's m = min(c, width) inputs)."""
    def step(tail, window):  # [K, width, C] each; window zero-padded on the left
        if tail is None:
            return window
        src = torch.arange(width, device=window.device) + shift[:, None]  # [K, width]
        shifted = tail.gather(1, src.clamp(max=width - 1)[..., None].expand_as(tail))
        return torch.where((src < width)[..., None], shifted, window)
    return step


def _next_state(dv):
    """Chain step of the fp32 state: S_out = A S_in + S_zero (data [K, h, dk, dv + dk])."""
    def step(state, data):
        s_zero, transition = data[..., :dv], data[..., dv:]
        return s_zero if state is None else transition @ state + s_zero
    return step


def state_passing(layer, proj, document_ids, group, first_key_head=0, chunks=None):
    """Gated DeltaNet over a sequence held in per-document zigzag shards by ``group``:
    proj [b, s_local, n_k, rows] in token order (per document: chunk p, then chunk 2P-1-p)
    -> gated output [b, s_local, r n_k, dv]. See the module docstring. ``chunks``: the
    :func:`chunk_layout` of ``document_ids`` (None: worked out here)."""
    size, rank = comm.group_size(group), comm.group_rank(group)
    b, s = proj.shape[:2]
    if chunks is None:
        chunks = chunk_layout(document_ids, b, s, proj.device)
    index, valid, length, slot = chunks
    rows = proj.reshape(b * s, *proj.shape[2:])[index]  # [2K, c_max, n_k, rows]
    mixed, z, gate_b, gate_a = layer.split(rows)
    width = layer.conv1d.weight.shape[-1] - 1
    tail = None
    if width:
        windows = _GatherStack.apply(_last_inputs(mixed, length, width), group)  # [P, 2K, w-1, C]
        shift = length.clamp(max=width)  # [K]
        tail = _chain(windows, size, rank, _next_tail(width, shift)).transpose(1, 2)  # [2K, C, w-1]
    mixed, _ = layer.conv(mixed, first_key_head, initial_tail=tail)  # [2K, c_max, C]
    q, k, v = layer.kernel_inputs(mixed)  # [2K, c_max, h, dk|dv]
    g, beta = layer.gates(gate_b, gate_a, first_key_head)  # [2K, c_max, h]
    keep = valid[..., None].float()  # pad tokens: no decay, no write
    g, beta = g * keep, beta * keep
    dk, dv = k.shape[-1], v.shape[-1]
    # widened by dk columns with v = 0 and S_in = I: those columns give P and A
    v_wide = torch.cat([v.float(), v.new_zeros(*v.shape[:-1], dk, dtype=torch.float32)], -1)
    eye = torch.eye(dk, device=v.device).expand(*k.shape[:1], k.shape[2], dk, dk)
    init = torch.cat([eye.new_zeros(*eye.shape[:-1], dv), eye], dim=-1)  # [2K, h, dk, dv + dk]
    o_wide, end = chunk_gated_delta_rule(q, k, v_wide, g, beta, initial_state=init,
                                         output_final_state=True)
    ends = _GatherStack.apply(end, group)  # [P, 2K, h, dk, dv + dk]
    state_in = _chain(ends, size, rank, _next_state(dv))  # [2K, h, dk, dv]
    o = o_wide[..., :dv] + torch.einsum("rhkv,rchk->rchv", state_in, o_wide[..., dv:])
    y = layer.gate_output(o.to(v.dtype), z)  # [2K, c_max, r n_k, dv]
    # every token sits in exactly one valid row slot: gather the slots back in token order
    y = y.reshape(-1, *y.shape[2:])[slot]  # [b * s, r n_k, dv]
    return y.reshape(b, s, *y.shape[1:])


def heads_all_to_all(layer, proj, token_index, document_ids, group, inner=None, layout=None):
    """Megatron-LM's way over ``group`` (U ranks): proj [b, s/U, n_k, rows] -> all-to-all to
    [b, s, n_k/U, rows] in token order -> ``inner(layer, proj, document_ids,
    first_key_head, layout)`` (default: the layer's own whole-sequence path; the hybrid
    passes state passing over the outer ring; layout: the gathered sequence's) -> all-to-all
    back -> [b, s/U, r n_k, dv]. ``layout``: the microbatch's SequenceLayout, whose Ulysses
    view over ``group`` holds the gathered metadata and its token order (None: gathered here)."""
    size, rank = comm.group_size(group), comm.group_rank(group)
    heads = proj.shape[2] // size
    if layout is None:
        layout = SequenceLayout(token_index, document_ids)
    view = layout.ulysses(group)
    x = comm.seq_to_heads(proj.transpose(1, 2), group)  # [b, n_k/U, s, rows]
    if view.perm is not None:
        x = _permute(x, view.perm, 2)  # token order
    if inner is None:
        y = layer.mix(x.transpose(1, 2), view.docs, rank * heads,
                      packed_rows=fla_packed_rows(view.inner, view.docs,
                                                  proj.dtype))  # [b, s, r n_k/U, dv]
    else:
        y = inner(layer, x.transpose(1, 2), view.docs, rank * heads, view.inner)
    y = y.transpose(1, 2)  # [b, r n_k/U, s, dv]
    if view.perm is not None:
        y = _permute(y, view.inverse, 2)  # back to the all-to-all order
    return comm.heads_to_seq(y, group).transpose(1, 2)  # [b, s/U, r n_k, dv]


class GatedDeltaContextParallel:
    """The CP path of one Gated DeltaNet layer, resolved when it is built: ``method`` is
    "a2a", "state" (p2p and all_gather) or "a2a+state" (a2a+p2p: all-to-all over the inner
    group, state passing over the outer one). Called as ``(layer, proj, token_index,
    document_ids)`` -> gated output [b, s_local, nv/tp, dv]."""

    def __init__(self, cp_group, comm_type, hierarchical_groups=None):
        self.cp_group = cp_group
        self.method = {"a2a": "a2a", "p2p": "state", "all_gather": "state",
                       "a2a+p2p": "a2a+state"}[comm_type]
        self.inner_group = self.outer_group = None
        if self.method == "a2a+state":
            self.inner_group, self.outer_group = hierarchical_groups

    def _state_over_outer(self, layer, proj, document_ids, first_key_head, layout):
        chunks = _chunks(layout, document_ids, *proj.shape[:2], proj.device)
        return state_passing(layer, proj, document_ids, self.outer_group, first_key_head,
                             chunks)

    def prepare(self, layout, batch, length, device, dtype):
        """Work out in ``layout`` (the microbatch's SequenceLayout) what this layer will look
        up for ``batch`` samples of ``length`` local tokens: state passing's chunk rows, or
        the all-to-all's gathered sequence (and, under the hybrid, its chunk rows; else, where
        FLA runs for values of ``dtype``, its packed rows). Collective over the CP group, like
        the attention's."""
        if self.method == "state":
            _chunks(layout, layout.document_ids, batch, length, device)
            return
        group = self.cp_group if self.method == "a2a" else self.inner_group
        view = layout.ulysses(group)
        whole = length * comm.group_size(group)
        if self.method == "a2a":
            fla_packed_rows(view.inner, view.docs, dtype)
        else:
            _chunks(view.inner, view.docs, batch, whole, device)

    def __call__(self, layer, proj, token_index, document_ids, layout=None):
        if self.method == "state":
            chunks = None if layout is None else \
                _chunks(layout, document_ids, *proj.shape[:2], proj.device)
            return state_passing(layer, proj, document_ids, self.cp_group, chunks=chunks)
        if self.method == "a2a":
            return heads_all_to_all(layer, proj, token_index, document_ids, self.cp_group,
                                    layout=layout)
        return heads_all_to_all(layer, proj, token_index, document_ids, self.inner_group,
                                inner=self._state_over_outer, layout=layout)
