"""Token dispatchers: tokens to the ranks of their experts, through the experts, and back.

Both run ``experts(rows sorted by local expert, rows per local expert)`` and return the
combined output ``[T, h] = sum over chosen experts of prob x expert(token)``.

- :class:`AllToAllDispatcher` (``--moe-token-dispatcher-type alltoall``): tokens are
  permuted by expert, the token counts exchanged over the EP group, then the rows
  themselves with ``all_to_all_single`` (uneven splits); with ETP > 1 the received rows are
  all-gathered over ETP (each ETP rank holds a slice of every local expert) and the
  partial outputs reduce-scattered back.
- :class:`AllGatherDispatcher` (``allgather``): every rank of the EP x ETP group gathers all
  of the group's tokens and routing, runs its local experts on the rows routed to them and
  reduce-scatters the combined partial outputs back.

Experts are split over EP ranks in order: EP rank r holds experts [r E/EP, (r+1) E/EP).

Both also tell the experts how the rows lie (:class:`~megatron_cp.fp8.grouped.ExpertRows`):
under tensorwise FP8 the microbatch class (the sender's DP rank) of each run of rows, so an
expert's amax never mixes DP peers' microbatches, and the rows that routing padding added.

``--moe-router-padding-for-quantization`` (alltoall / flex): Megatron-LM's rule, each rank
pads its own routing map before the exchange (:func:`pad_routing_map`) so every expert gets a
multiple of 16 rows (32 under MXFP8) from it. The added entries carry probability 0: their
rows run through the experts and add nothing to the output, their gradients are 0, and they
stay out of the FP8 amaxes (so the padding, which depends on how the microbatch is split over
ranks, changes nothing any layout computes).
"""
import torch

from megatron_cp.fp8.grouped import ExpertRows, runs_of
from megatron_cp.fp8.grouped_blocks import check_source_order
from megatron_cp.moe import comm


def permute(tokens, routing_map):
    """Rows of ``tokens`` [T, h] for each expert in turn (token order inside an expert).
    Returns ``(rows [P, h], token_index [P], counts [E] list)``, P = routing_map.sum()."""
    experts, num_tokens = routing_map.shape[1], routing_map.shape[0]
    token_index = torch.arange(num_tokens, device=tokens.device).expand(experts, -1) \
        .masked_select(routing_map.t())  # [P], expert-major
    counts = routing_map.sum(dim=0).tolist()  # [E]
    return tokens.index_select(0, token_index), token_index, counts


def unpermute(rows, token_index, probs, routing_map, num_tokens):
    """Inverse of :func:`permute`, weighting each row by its probability and summing a
    token's rows: [P, h] -> [T, h]."""
    weights = probs.t().masked_select(routing_map.t())  # [P], expert-major like the rows
    weighted = rows * weights.to(rows.dtype)[:, None]  # [P, h]
    out = rows.new_zeros((num_tokens, rows.shape[1]))  # [T, h]
    return out.index_add(0, token_index, weighted)


def pad_routing_map(routing_map, multiple):
    """Megatron-LM's routing padding: ``routing_map`` [T, E] with, for each expert, its first
    tokens (in token order) not routed to it added until its count is a multiple of
    ``multiple`` (as many as there are, when too few)."""
    by_expert = routing_map.t()  # [E, T]
    missing = (-by_expert.sum(dim=1)) % multiple  # [E]
    free_rank = torch.cumsum((~by_expert).to(torch.long), dim=1)  # [E, T]: free tokens so far
    added = ~by_expert & (free_rank <= missing[:, None])  # [E, T]
    return (by_expert | added).t()  # [T, E]


def _per_source(value, groups, device):
    """Every source rank's ``value``, the sources ordered as the all-gathers over ``groups``
    in turn order them (the first group innermost)."""
    values = torch.tensor([value], dtype=torch.long, device=device)
    for group in groups:
        values = comm.all_gather_counts(values, group).flatten()  # [ranks * earlier]
    return values.tolist()


def _source_classes(dp_rank, groups, device):
    """The DP rank (microbatch class) of every source rank (:func:`_per_source`)."""
    return _per_source(dp_rank, groups, device)


def _classes_of(dispatcher, experts, groups, device, reorder=False):
    """(the sources' microbatch classes, in the order their rows are laid out; that order of
    the sources, None: as they come), gathered at the first dispatch. Block FP8 experts need
    each class's rows in one process's token order: the sources sorted by (class, piece of
    the microbatch's tokens) when ``reorder``, and checked (fp8/grouped_blocks.py)."""
    if dispatcher.source_class is None:
        classes, order = _source_classes(dispatcher.dp_rank, groups, device), None
        if getattr(experts, "wants_token_order", False):
            pieces = _per_source(dispatcher.piece, groups, device)
            if reorder:
                order = sorted(range(len(classes)), key=lambda i: (classes[i], pieces[i]))
                classes, pieces = [classes[i] for i in order], [pieces[i] for i in order]
            check_source_order(classes, pieces)
        dispatcher.source_class, dispatcher.source_order = classes, order
    return dispatcher.source_class, dispatcher.source_order


def chunk_order(counts, sources=None):
    """Row order that regroups rows laid out in chunks ``counts`` [S, E] source-major (all
    experts of source 0, then of source 1, ...) as expert-major (all sources of expert 0,
    then of expert 1, ...; the sources in the order ``sources``, default as they come): the
    index [rows] to gather with."""
    flat = counts.flatten()  # [S*E], source-major
    starts = (flat.cumsum(0) - flat).view(counts.shape)  # [S, E]
    if sources is not None:
        starts, counts = starts[sources], counts[sources]
    starts, lengths = starts.t().flatten(), counts.t().flatten()  # [E*S], expert-major
    total = int(lengths.sum())
    within = torch.arange(total) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return torch.repeat_interleave(starts, lengths) + within  # [rows]


class AllToAllDispatcher:
    """Dispatch over the EP group with all-to-all (module docstring)."""

    def __init__(self, num_experts, ep_group, ep_size, etp_group, etp_size, dp_rank=0,
                 pad_multiple=0, piece=0):
        self.num_experts, self.num_local = num_experts, num_experts // ep_size
        self.ep_group, self.ep_size = ep_group, ep_size
        self.etp_group, self.etp_size = etp_group, etp_size
        self.dp_rank, self.pad_multiple = dp_rank, pad_multiple
        self.piece = piece  # which piece of its microbatch's tokens this rank holds (TP rank)
        self.source_class = None  # [ETP x EP] the sources' DP ranks, gathered at first use
        self.source_order = None  # the order the sources' rows are laid out in (None: as they come)

    def _move(self, rows, output_splits, input_splits, per_rank):
        """Rows to the experts' ranks: [P, ...] -> [R, ...] (and gathered over ETP)."""
        rows = comm.all_to_all(rows, output_splits, input_splits, self.ep_group)  # [R, ...]
        if self.etp_size > 1:
            rows = comm.gather_rows(rows, per_rank, self.etp_group)  # [sum(per_rank), ...]
        return rows

    def __call__(self, tokens, probs, routing_map, experts):
        num_tokens = tokens.shape[0]
        pad = None
        if self.pad_multiple:
            padded = pad_routing_map(routing_map, self.pad_multiple)
            pad, routing_map = padded & ~routing_map, padded  # [T, E] each
            probs = probs.masked_fill(pad, 0)  # the added entries weigh (and learn) nothing
        rows, token_index, counts = permute(tokens, routing_map)  # [P, h]
        send = torch.tensor(counts, dtype=torch.long).view(self.ep_size, self.num_local)  # [EP, E_local]
        received = comm.exchange_counts(send.to(tokens.device), self.ep_group).cpu()  # [EP, E_local]
        input_splits, output_splits = send.sum(1).tolist(), received.sum(1).tolist()
        by_source, per_rank = received, None  # [sources, E_local], sources = EP (x ETP) ranks
        if self.etp_size > 1:
            gathered = comm.all_gather_counts(received.flatten().to(tokens.device), self.etp_group)
            by_source = gathered.cpu().view(self.etp_size * self.ep_size, self.num_local)
            per_rank = gathered.cpu().sum(1).tolist()  # rows each ETP rank received
        rows = self._move(rows, output_splits, input_splits, per_rank)  # [rows, h]
        layout, sources = ExpertRows(by_source.sum(0).tolist()), None
        if getattr(experts, "wants_classes", False):
            classes, sources = _classes_of(self, experts, (self.ep_group, self.etp_group),
                                           tokens.device, reorder=True)
            layout.runs = runs_of(by_source if sources is None else by_source[sources], classes)
        order = chunk_order(by_source, sources).to(tokens.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        if pad is not None:  # which received rows the padding added, in the experts' order
            flags = pad.t().masked_select(routing_map.t()).to(torch.uint8)  # [P], as the rows
            flags = self._move(flags, output_splits, input_splits, per_rank)  # [rows]
            layout.real = flags.index_select(0, order) == 0
        out = experts(rows.index_select(0, order), layout.counts, layout)  # [rows, h]
        out = out.index_select(0, inverse)  # back to source-major
        if self.etp_size > 1:
            out = comm.reduce_scatter_rows(out, per_rank, self.etp_group)  # [R, h]
        out = comm.all_to_all(out, input_splits, output_splits, self.ep_group)  # [P, h]
        return unpermute(out, token_index, probs, routing_map, num_tokens)  # [T, h]


class AllGatherDispatcher:
    """Dispatch by all-gather over the EP x ETP group (module docstring)."""

    def __init__(self, num_experts, ep_rank, ep_size, group, group_size, dp_rank=0, piece=0):
        self.num_local = num_experts // ep_size
        self.first = ep_rank * self.num_local
        self.group, self.group_size = group, group_size
        self.dp_rank, self.piece = dp_rank, piece  # as AllToAllDispatcher's
        self.source_class = self.source_order = None

    def __call__(self, tokens, probs, routing_map, experts):
        sizes = [tokens.shape[0]] * self.group_size
        if self.group_size > 1:
            sizes = comm.all_gather_counts(
                torch.tensor([tokens.shape[0]], device=tokens.device), self.group).flatten().tolist()
        all_tokens = comm.gather_rows(tokens, sizes, self.group)  # [T_all, h]
        all_probs = comm.gather_rows(probs, sizes, self.group)  # [T_all, E]
        all_map = comm.gather_rows(routing_map.to(torch.uint8), sizes, self.group).bool()
        local = slice(self.first, self.first + self.num_local)
        local_map = all_map[:, local]  # [T_all, E_local]
        rows, token_index, counts = permute(all_tokens, local_map)
        layout = ExpertRows(counts)
        if getattr(experts, "wants_classes", False):  # each expert's rows in source order
            classes, _ = _classes_of(self, experts, (self.group,), tokens.device)
            by_source = torch.stack([part.sum(0) for part in local_map.split(sizes)]).cpu()
            layout.runs = runs_of(by_source, classes)  # by_source [S, E_local]
        out = experts(rows, counts, layout)  # [P_local, h]
        out = unpermute(out, token_index, all_probs[:, local], local_map, all_tokens.shape[0])
        return comm.reduce_scatter_rows(out, sizes, self.group)  # [T, h]
