"""Load-balancing and z-losses, defined so that no layout and no padding changes them.

Each token carries a weight (its loss-mask value: 0 for CP and pipeline padding and for
loss-masked tokens such as EOD under ``--eod-mask-loss``), and only weighted tokens count.
For one microbatch, with ``c_i`` the weighted number of tokens routed to expert ``i``,
``S_i`` the weighted sum of the balancing scores of expert ``i`` and ``N`` the weighted
number of tokens, all summed over every rank that holds tokens of this microbatch (the
TP x CP group, where TP ranks split the MoE tokens)::

    aux_loss = coeff * E / (k N^2) * sum_i S_i c_i           (Switch / GShard)
    z_loss   = z_coeff * sum_t w_t logsumexp(logits_t)^2 / N

``seq_aux_loss`` applies the formula to each sequence (row of the microbatch) and averages
over the sequences that have weighted tokens; ``global_aux_loss`` sums ``c``, ``S`` and ``N``
over the data-parallel ranks as well (the microbatches they run together). ``c`` and ``N``
are counts (no gradient), so each rank's differentiable part is its own ``S`` with the
global ``c`` and ``N``: the parts sum to the loss, and summing gradients over DP x CP (and
TP) gives its exact gradient.

Sinkhorn routing (:func:`sinkhorn`) balances without a loss, over the same weighted tokens
of the whole microbatch.

The training objective adds the mean of these per-microbatch losses over the global batch's
microbatches, so the scale does not change with TP, CP, DP or the number of microbatches:
the training loop sets each router's ``aux_loss_scale`` to ``loss_scale / microbatches of
the global batch`` (:func:`megatron_cp.moe.set_aux_loss_scale`), and
:class:`AttachLoss` adds the gradient of ``scale x loss`` in backward without changing the
forward value (Megatron's MoEAuxLossAutoScaler).
"""
import torch
import torch.distributed as dist


class AttachLoss(torch.autograd.Function):
    """Forward: ``x`` unchanged. Backward: ``x``'s gradient, and ``scale`` as the gradient
    of the scalar ``loss`` (so backward of the main loss also runs ``scale * loss``'s)."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def sum_over_groups(tensor, groups):
    """All-reduce (sum) ``tensor`` in place over each group in turn (None or size 1: skipped)."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)
    return tensor


def _group_size(group):
    return dist.get_world_size(group) if group is not None else 1


def aux_loss(kind, scores, routing_map, weights, *, topk, coeff, token_groups, dp_group=None,
             seq_ids=None, num_seqs=1):
    """The load-balancing loss of one microbatch (module docstring).

    ``scores`` [T, E] balancing scores (differentiable), ``routing_map`` [T, E] the top-k
    choice before any capacity drop, ``weights`` [T], ``seq_ids`` [T] the microbatch row of
    each token (seq_aux_loss only). ``token_groups``: the groups holding this microbatch's
    other tokens. Returns ``(local, value)``: this rank's differentiable part, and the whole
    loss (detached, the same on every rank of the groups).
    """
    experts = scores.shape[1]
    w = weights.to(scores.dtype)[:, None]  # [T, 1]
    routed = routing_map.to(scores.dtype) * w  # [T, E]
    if kind == "seq_aux_loss":
        onehot = torch.nn.functional.one_hot(seq_ids, num_seqs).to(scores.dtype).t()  # [B, T]
        s_local, counts, n = onehot @ (scores * w), onehot @ routed, onehot @ w[:, 0]  # [B, E] [B, E] [B]
    else:
        s_local, counts, n = (scores * w).sum(0, keepdim=True), routed.sum(0, keepdim=True), \
            w.sum().reshape(1)  # [1, E] [1, E] [1]
    rows = n.shape[0]
    groups = list(token_groups) + ([dp_group] if kind == "global_aux_loss" else [])
    stats = sum_over_groups(torch.cat([counts.flatten(), n, s_local.detach().flatten()]), groups)
    counts, n, s_all = stats[:rows * experts].view(rows, experts), \
        stats[rows * experts:rows * (experts + 1)], stats[rows * (experts + 1):].view(rows, experts)
    valid = (n > 0).to(scores.dtype)  # rows with weighted tokens (seq_aux_loss averages them)
    factor = coeff * experts / topk * valid / (n.clamp(min=1.0) ** 2 * valid.sum().clamp(min=1.0))
    local = (factor[:, None] * s_local * counts).sum()
    if kind == "global_aux_loss":  # the DP ranks' parts sum to one loss for their microbatches
        local = local * _group_size(dp_group)
    return local, (factor[:, None] * s_all * counts).sum().detach()


@torch.no_grad()
def sinkhorn(logits, weights, token_groups, tol=1e-4):
    """Sinkhorn-Knopp balancing of a microbatch's router logits (S-BASE), Megatron-LM's
    iteration: row scales ``d0`` [T] and expert scales ``d1`` [E] of ``C = exp(logits)`` are
    refined in turn, ``d0 = 1/N / (C d1 + eps)`` and ``d1 = 1/E / (C^T d0 + eps)``, until
    ``d1`` moves by at most ``tol`` on average; returns ``d1 * C * d0`` [T, E] (fp32), whose
    row top-k is a balanced choice of experts.

    Only the weighted tokens (``weights`` [T] > 0) enter ``C^T d0`` and ``N``, summed over
    ``token_groups`` (the ranks holding the microbatch's other tokens): padding and
    loss-masked tokens get scores but move no expert's scale, and every layout balances the
    whole microbatch as one process does (Megatron-LM balances each rank's own tokens). The
    sums are the same on every rank of the groups, so all stop at the same iteration."""
    cost = torch.exp(logits.float())  # [T, E]
    counted = (weights > 0).to(cost.dtype)[:, None]  # [T, 1]
    num_tokens = sum_over_groups(counted.sum().reshape(1), token_groups).clamp(min=1.0)
    experts, eps = cost.shape[1], 1e-8
    d1 = d1_old = torch.ones(experts, dtype=cost.dtype, device=cost.device)
    error = float("inf")
    while error > tol:
        d0 = (1 / num_tokens) * 1 / ((d1 * cost).sum(1) + eps)  # [T]
        columns = sum_over_groups((d0[:, None] * cost * counted).sum(0), token_groups)  # [E]
        d1 = (1 / experts) * 1 / (columns + eps)
        error = (d1_old - d1).abs().mean().item()
        d1_old = d1
    return d1 * cost * d0[:, None]


def z_loss(logits, weights, *, coeff, token_groups):
    """The router z-loss of one microbatch: ``coeff * sum_t w_t lse_t^2 / N`` with the sums
    over the whole microbatch. Returns ``(local, value)`` as :func:`aux_loss`."""
    lse2 = torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                           dim=-1).pow(2)  # [T]
    w = weights.to(lse2.dtype)
    z_local = (w * lse2).sum()
    stats = sum_over_groups(torch.stack([z_local.detach(), w.sum()]), token_groups)
    n = stats[1].clamp(min=1.0)
    return coeff * z_local / n, (coeff * stats[0] / n).detach()
