"""Megatron-LM's loss weighting: what one step's gradient is the gradient of.

Megatron-LM's schedule (megatron/core/pipeline_parallel/schedules.py,
``forward_step_calc_loss``) receives from pretrain_gpt.py's loss function each microbatch's
masked loss sum and its number of loss tokens, and weights them in one of two ways. Written
for ONE process running the global batch's ``G`` microbatches (with DP ranks, each runs G/DP
of them and the DP average makes it the same function):

- default (no ``--calculate-per-token-loss``): each microbatch's mean over its own loss
  tokens, a microbatch without any counting 0 (its count is clamped to 1), averaged over the
  microbatches::

      L = 1/G sum_m  sum_{t in m} loss_t / max(n_m, 1)

- ``--calculate-per-token-loss``: the token-weighted mean over the global batch,
  ``L = sum_t loss_t / N`` (``N`` the loss tokens of the whole global batch).

Megatron-LM divides by each CP rank's own token count, so its CP runs differ from its
one-process run when the loss masks of a microbatch's CP parts differ; here ``n_m`` is the
count over the whole microbatch (summed over the CP group), so every layout computes the
one-process function.

The auxiliary losses are weighted as the schedule and the router weight them (census commit
d98e8a64 of Megatron-LM; ``f`` is ``--mtp-loss-scaling-factor``, ``D`` the MTP depths,
``k_{m,d}`` the loss tokens left at depth d, ``T`` the tokens of one microbatch)::

                       default                      --calculate-per-token-loss
    MTP depth d:   f/D * sum_d / max(k,1) / G      f/D * sum_d * n_m / max(k,1) / N
    MoE aux, z:    loss_m / G                      loss_m * T / N

(megatron-core 0.16.1 differs only in the MTP loss under --calculate-per-token-loss:
``f/D * sum_d / N``, and it does not clamp ``k`` in the default.)

The logged ``lm loss`` is in both cases what Megatron-LM logs: the token-weighted mean over
the global batch; only the gradient follows the weighting.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StepWeights:
    """The weights of one step on one rank. ``lm[m]`` multiplies this rank's masked LM loss
    sum of its microbatch m; ``mtp[m][d]`` its masked MTP loss sum of depth d (f/D included);
    ``aux`` each MoE balancing / z-loss of a microbatch; ``num_tokens`` is N (the logged
    loss's divisor). All include the optimizer's loss scale."""
    lm: list
    mtp: list
    aux: float
    num_tokens: float


def step_weights(counts, totals, num_microbatches, tokens_per_microbatch, per_token_loss,
                 mtp_factor=0.0, loss_scale=1.0):
    """:class:`StepWeights` from ``counts`` [M, 1 + D] (this rank's microbatches: the LM's
    loss tokens, then each MTP depth's, each summed over its whole microbatch, i.e. over the
    CP group), ``totals`` [1 + D] (the same over the global batch), ``num_microbatches`` G
    (of the global batch, over all DP ranks) and ``tokens_per_microbatch`` T (micro batch
    size x sequence length: the tokens one process routes per microbatch)."""
    counts = counts.double().cpu()  # [M, 1 + D]; a few numbers: the host is fine
    total = max(float(totals[0]), 1.0)  # N; no loss token at all: nothing to divide
    depths = counts.shape[1] - 1
    kept = counts[:, 1:].clamp(min=1.0)  # [M, D]
    if per_token_loss:
        lm = [loss_scale / total] * counts.shape[0]
        mtp = (loss_scale * mtp_factor / max(depths, 1) * counts[:, :1] / kept / total)
        aux = loss_scale * tokens_per_microbatch / total
    else:
        lm = (loss_scale / (counts[:, 0].clamp(min=1.0) * num_microbatches)).tolist()
        mtp = loss_scale * mtp_factor / max(depths, 1) / (kept * num_microbatches)
        aux = loss_scale / num_microbatches
    return StepWeights(lm=lm, mtp=mtp.tolist(), aux=aux, num_tokens=total)


def microbatch_counts(microbatches, keys, dp_rank, dp_size, dp_cp_group, device):
    """(counts [M, K], totals [K]) of the masks ``keys`` of this rank's microbatches: counts
    summed over each microbatch's CP parts, totals over the whole global batch, with one
    all-reduce over DP x CP (each DP rank writes its row of a [DP, M, K] table)."""
    local = torch.stack([torch.stack([b[key].sum() for key in keys]) for b in microbatches])
    # float64: token counts stay exact far beyond fp32's 2^24
    table = torch.zeros((dp_size,) + tuple(local.shape), dtype=torch.float64, device=device)
    table[dp_rank] = local.double()  # [DP, M, K]
    dist.all_reduce(table, group=dp_cp_group)
    return table[dp_rank], table.sum(dim=(0, 1))


def bin_counts(bins, keys, dp_cp_group, device):
    """Dynamic CP's (counts [M, K], totals [K]): this rank's own share of each of its bins
    (their CP parts are not summed: under per-token loss only the totals weigh), and the
    totals over the global batch, summed over DP x CP (each token is held by one rank of
    its bin's group)."""
    local = torch.zeros((len(bins), len(keys)), dtype=torch.float64, device=device)  # [M, K]
    for m, b in enumerate(bins):
        local[m] = torch.stack([b[key].sum() for key in keys]).double()
    totals = local.sum(dim=0)  # [K]
    dist.all_reduce(totals, group=dp_cp_group)
    return local, totals
