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
"""
import torch

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


def chunk_order(counts):
    """Row order that regroups rows laid out in chunks ``counts`` [S, E] source-major (all
    experts of source 0, then of source 1, ...) as expert-major (all sources of expert 0,
    then of expert 1, ...): the index [rows] to gather with."""
    flat = counts.flatten()  # [S*E], source-major
    starts = (flat.cumsum(0) - flat).view(counts.shape).t().flatten()  # [E*S], expert-major
    lengths = counts.t().flatten()  # [E*S]
    total = int(lengths.sum())
    within = torch.arange(total) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return torch.repeat_interleave(starts, lengths) + within  # [rows]


class AllToAllDispatcher:
    """Dispatch over the EP group with all-to-all (module docstring)."""

    def __init__(self, num_experts, ep_group, ep_size, etp_group, etp_size):
        self.num_experts, self.num_local = num_experts, num_experts // ep_size
        self.ep_group, self.ep_size = ep_group, ep_size
        self.etp_group, self.etp_size = etp_group, etp_size

    def __call__(self, tokens, probs, routing_map, experts):
        num_tokens = tokens.shape[0]
        rows, token_index, counts = permute(tokens, routing_map)  # [P, h]
        send = torch.tensor(counts, dtype=torch.long).view(self.ep_size, self.num_local)  # [EP, E_local]
        received = comm.exchange_counts(send.to(tokens.device), self.ep_group).cpu()  # [EP, E_local]
        input_splits, output_splits = send.sum(1).tolist(), received.sum(1).tolist()
        rows = comm.all_to_all(rows, output_splits, input_splits, self.ep_group)  # [R, h]
        by_source = received  # [sources, E_local], sources = EP ranks (x ETP ranks below)
        if self.etp_size > 1:
            gathered = comm.all_gather_counts(received.flatten().to(tokens.device), self.etp_group)
            by_source = gathered.cpu().view(self.etp_size * self.ep_size, self.num_local)
            per_rank = gathered.cpu().sum(1).tolist()  # rows each ETP rank received
            rows = comm.gather_rows(rows, per_rank, self.etp_group)  # [sum(per_rank), h]
        order = chunk_order(by_source).to(tokens.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = experts(rows.index_select(0, order), by_source.sum(0).tolist())  # [rows, h]
        out = out.index_select(0, inverse)  # back to source-major
        if self.etp_size > 1:
            out = comm.reduce_scatter_rows(out, per_rank, self.etp_group)  # [R, h]
        out = comm.all_to_all(out, input_splits, output_splits, self.ep_group)  # [P, h]
        return unpermute(out, token_index, probs, routing_map, num_tokens)  # [T, h]


class AllGatherDispatcher:
    """Dispatch by all-gather over the EP x ETP group (module docstring)."""

    def __init__(self, num_experts, ep_rank, ep_size, group, group_size):
        self.num_local = num_experts // ep_size
        self.first = ep_rank * self.num_local
        self.group, self.group_size = group, group_size

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
        out = experts(rows, counts)  # [P_local, h]
        out = unpermute(out, token_index, all_probs[:, local], local_map, all_tokens.shape[0])
        return comm.reduce_scatter_rows(out, sizes, self.group)  # [T, h]
