"""The router's math, as plain functions of tensors (no process groups, no modules).

Shapes: ``T`` tokens, ``E`` experts, ``k`` = top-k. A routing is two dense ``[T, E]``
tensors: ``routing_map`` (bool, the token goes to the expert) and ``probs`` (its weight,
0 where the map is False).
"""
import math

import torch

from megatron_cp.config.moe import ELEMENTWISE_SCORES


def _at_least_fp32(tensor):
    """The dtype scores are computed in: fp32, or fp64 under --moe-router-dtype fp64."""
    return torch.promote_types(tensor.dtype, torch.float32)


def expert_scores(logits, score_function):
    """The per-expert scores of ``logits`` [T, E] (at least fp32) of an element-wise score
    function: ``sigmoid(x)``, or ``sqrtsoftplus``: ``sqrt(softplus(x)) = sqrt(log(1 + e^x))``
    (Megatron-LM's)."""
    x = logits.to(_at_least_fp32(logits))
    if score_function == "sigmoid":
        return torch.sigmoid(x)
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(x).sqrt()
    raise ValueError(f"score_function {score_function!r}: use sigmoid or sqrtsoftplus")


def group_limited_topk(scores, topk, num_groups, group_topk):
    """DeepSeek's node-limited top-k: each group of E/num_groups experts is scored by the sum
    of its top (topk / group_topk) scores, the best ``group_topk`` groups are kept and the
    top-k taken inside them. Returns (values [T, k], indices [T, k])."""
    tokens, experts = scores.shape
    per_group = scores.view(tokens, num_groups, experts // num_groups)  # [T, G, E/G]
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    best = group_scores.topk(group_topk, dim=-1).indices  # [T, group_topk]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    keep = keep.unsqueeze(-1).expand(-1, -1, experts // num_groups).reshape(tokens, experts)
    return scores.masked_fill(~keep, float("-inf")).topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if num_groups:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=-1)


def topk_routing(logits, topk, score_function="softmax", pre_softmax=False, scaling_factor=None,
                 num_groups=None, group_topk=None, expert_bias=None, chosen_experts=None):
    """Megatron-LM's top-k router on ``logits`` [T, E].

    softmax: the top-k logits are softmaxed among themselves, or (``pre_softmax``) the top-k
    of the softmax over all experts are taken as they are. sigmoid and sqrtsoftplus: the
    top-k of the per-expert scores (:func:`expert_scores`), normalised to sum to 1 when
    k > 1; ``expert_bias`` [E] is added for the choice only. ``chosen_experts`` [T, k]: the
    experts a balancer chose (quantile balancing), whose scores are taken as the top-k's.
    Returns ``(probs [T, E], routing_map [T, E] bool)``.
    """
    def choose(scores):  # (the chosen scores [T, k], their experts [T, k])
        if chosen_experts is not None:
            return scores.gather(1, chosen_experts), chosen_experts
        return _topk(scores, topk, num_groups, group_topk)

    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=_at_least_fp32(logits)).type_as(logits)
            chosen, indices = choose(scores)
        else:
            top_logits, indices = choose(logits)
            chosen = torch.softmax(top_logits, dim=-1, dtype=_at_least_fp32(logits)).type_as(logits)
    elif score_function in ELEMENTWISE_SCORES:
        scores = expert_scores(logits, score_function).type_as(logits)
        if expert_bias is not None and chosen_experts is None:
            _, indices = _topk(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk)
            chosen = scores.gather(1, indices)
        else:
            chosen, indices = choose(scores)
        if topk > 1:
            chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function {score_function!r}: use softmax, sigmoid or "
                         f"sqrtsoftplus")
    if scaling_factor:
        chosen = chosen * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, chosen)  # [T, E]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)  # [T, E]
    return probs, routing_map


def quantile_balanced_choice(logits, topk, beta):
    """Quantile balancing's choice of experts (Megatron-LM's ``qb_dual_update``): each
    token's top-k of ``logits - beta`` (fp32; ``beta`` [E] the per-expert bias), and its dual
    value ``alpha``, the (k+1)-th largest of that row. Returns ``(experts [T, k], alpha
    [T, 1])``."""
    top = (logits.float() - beta).topk(topk + 1, dim=-1)
    return top.indices[:, :topk], top.values[:, topk:]


def expert_quantiles(shifted, topk):
    """The quantile-balancing target of each expert from one microbatch's rows ``shifted`` =
    ``logits - alpha`` [m, E] of its m counted tokens: per expert, the ``(m k // E + 1)``-th
    largest entry of its column -- the bias that would leave it ``m k / E`` tokens, its fair
    share (Megatron-LM's; it requires ``m k / E`` whole). Returns [E]."""
    share = shifted.shape[0] * topk // shifted.shape[1]
    return shifted.topk(share + 1, dim=0).values[-1]


def sinkhorn_routing(logits, topk, indices=None):
    """Megatron-LM's Sinkhorn router on ``logits`` [T, E]: the probabilities are the plain
    logits' sigmoid (top-1) or softmax over all experts (top-k > 1), kept at ``indices``
    [T, k] -- in training the top-k of the Sinkhorn-balanced scores
    (:func:`megatron_cp.moe.balancing.sinkhorn`) -- or, when None (evaluation), at their own
    top-k. Returns ``(probs [T, E], routing_map [T, E] bool)``."""
    if topk == 1:  # a softmax over one chosen logit would be constant 1, with no gradient
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=_at_least_fp32(logits)).type_as(logits)
    if indices is None:
        indices = scores.topk(topk, dim=-1).indices  # [T, k]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)  # [T, E]
    return scores * routing_map, routing_map


def scores_for_balancing(logits, score_function):
    """The per-expert scores the balancing loss averages, [T, E]: the softmax over all
    experts, or the sigmoid / sqrtsoftplus scores normalised over all experts."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=_at_least_fp32(logits))
    scores = expert_scores(logits, score_function)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def expert_capacity(num_tokens, num_experts, topk, capacity_factor):
    """Megatron's per-expert capacity: ceil(tokens x topk / experts x factor)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_capacity(probs, routing_map, capacity, drop_policy="probs", pad_to_capacity=False):
    """Keep at most ``capacity`` tokens per expert: those with the highest probability
    (``probs``) or the first ones (``position``). With ``pad_to_capacity`` every expert gets
    exactly ``capacity`` tokens (unrouted ones with probability 0, so the function is the
    same). Returns the new ``(probs, routing_map)``."""
    tokens = probs.shape[0]
    k = min(capacity, tokens)
    if drop_policy == "probs":
        keep_rows = probs.topk(k, dim=0, sorted=False).indices  # [k, E]
        keep = torch.zeros_like(routing_map).scatter(0, keep_rows, True)  # [T, E]
    elif drop_policy == "position":
        keep = routing_map.long().cumsum(dim=0) <= capacity  # the first `capacity` routed
    else:
        raise ValueError(f"drop_policy {drop_policy!r}: use probs or position")
    if pad_to_capacity:
        # exactly k rows per expert: the kept routed tokens, then the first unrouted ones
        kept = routing_map & keep
        room = k - kept.long().sum(dim=0, keepdim=True)  # [1, E]
        filler = (~routing_map).long().cumsum(dim=0) <= room  # [T, E]
        new_map = kept | (~routing_map & filler)
        return probs * kept, new_map
    new_map = routing_map & keep
    return probs * new_map, new_map
