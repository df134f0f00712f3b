"""Mixture of experts on its own expert-parallel mesh (Megatron-LM's flags).

router.py (top-k routing, capacity, balancing losses, expert bias), routing.py and
balancing.py (their math), dispatcher.py (all-to-all / all-gather over the EP group),
experts.py (grouped experts, split over EP and ETP), comm.py (autograd collectives of
rows), layer.py (the layer), and below what the training loop calls once per step.
"""
import torch

from megatron_cp.moe.balancing import sum_over_groups
from megatron_cp.moe.layer import MoELayer  # noqa: F401


def moe_layers(model_chunks):
    """``(global layer number, MoELayer)`` of every MoE layer in this rank's chunks."""
    for chunk in model_chunks:
        for module in chunk.modules():
            if getattr(module, "is_moe", False):
                yield module.layer_number, module.mlp


def set_aux_loss_scale(model_chunks, scale):
    """The weight of every router's balancing and z-losses in backward (the training loop
    passes ``loss_scale / microbatches of the global batch``: balancing.py)."""
    for _, layer in moe_layers(model_chunks):
        layer.router.aux_loss_scale = scale


def _copy(tensor):
    return None if tensor is None else tensor.clone()


def router_counters(model_chunks):
    """A copy of what every router accumulates over a step's microbatches (statistics for
    the log, token counts for the expert bias, quantiles for quantile balancing): a rerun
    of the step starts from it again."""
    return [({k: v.clone() for k, v in layer.router.stats.items()},
             _copy(layer.router.bias_counts), _copy(layer.router.qb_sums))
            for _, layer in moe_layers(model_chunks)]


def restore_router_counters(model_chunks, saved):
    """Put back what :func:`router_counters` copied."""
    for (_, layer), (stats, bias_counts, qb_sums) in zip(moe_layers(model_chunks), saved):
        layer.router.stats = {k: v.clone() for k, v in stats.items()}
        layer.router.bias_counts, layer.router.qb_sums = _copy(bias_counts), _copy(qb_sums)


def _sum_over(tensor, state, names):
    return sum_over_groups(tensor, [state.group(name) for name in names if state.size(name) > 1])


@torch.no_grad()
def update_expert_bias(model_chunks, state):
    """Aux-loss-free balancing, once per global batch: each expert bias moves by
    ``--moe-router-bias-update-rate`` towards equal loads, ``bias += rate * sign(mean count -
    count)``, the counts summed over every token of the global batch (all ranks of the
    stage: TP x CP x DP)."""
    routers = [layer.router for _, layer in moe_layers(model_chunks)
               if layer.router.expert_bias is not None]
    if not routers:
        return
    device = routers[0].expert_bias.device
    counts = torch.stack([r.bias_counts if r.bias_counts is not None else
                          torch.zeros(r.expert_bias.numel(), dtype=torch.float64, device=device)
                          for r in routers])  # [routers, E]
    _sum_over(counts, state, ("tp", "dp_cp"))
    offset = torch.sign(counts.mean(dim=1, keepdim=True) - counts)  # [routers, E]
    for router, step in zip(routers, offset):
        router.expert_bias += router.config.moe_router_bias_update_rate * step.float()
        router.bias_counts = None


@torch.no_grad()
def update_qb_beta(model_chunks, state):
    """Quantile balancing, once per global batch (Megatron-LM's): each router's bias moves
    to ``ema * qb_beta + (1 - ema) * q`` (``--moe-router-quantile-balancing-ema``), ``q`` the
    mean of the expert quantiles of the global batch's microbatches (every data-parallel
    rank's), then is centred (mean 0 over the experts)."""
    routers = [layer.router for _, layer in moe_layers(model_chunks)
               if layer.router.qb_beta is not None]
    if not routers:
        return
    sums = torch.stack([r.qb_sums if r.qb_sums is not None else
                        torch.zeros(r.qb_beta.numel() + 1, dtype=torch.float64,
                                    device=r.qb_beta.device) for r in routers])  # [routers, E+1]
    _sum_over(sums, state, ("dp",))  # the TP x CP ranks of a microbatch hold the same sums
    for router, row in zip(routers, sums):
        router.qb_sums = None
        if row[-1] == 0:  # no counted token in the whole global batch: nothing to move to
            continue
        ema = router.config.moe_router_quantile_balancing_ema
        beta = ema * router.qb_beta.double() + (1.0 - ema) * row[:-1] / row[-1]
        router.qb_beta.copy_(beta - beta.mean())


@torch.no_grad()
def take_stats(model_chunks, state, num_layers, num_experts):
    """Sum, over the whole job, of what the routers recorded since the last call, and reset
    them. Returns ``(aux [L], z [L], tokens [L, E])`` indexed by global layer number (zero
    for dense layers): the balancing and z-loss values summed over the training microbatches
    of every data-parallel rank, and the weighted tokens each expert was chosen for. Every
    rank must call it (it reduces over TP, DP x CP and PP)."""
    device = state.device
    losses = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)  # [L, aux|z]
    tokens = torch.zeros(num_layers, max(num_experts, 1), dtype=torch.float64, device=device)
    for number, layer in moe_layers(model_chunks):
        stats = layer.router.stats
        losses[number, 0], losses[number, 1] = stats["aux_loss"], stats["z_loss"]
        tokens[number] = stats["tokens_per_expert"]
        layer.router.reset_stats()
    _sum_over(losses, state, ("dp", "pp"))  # a value is whole per microbatch on TP x CP
    _sum_over(tokens, state, ("tp", "dp_cp", "pp"))
    return losses[:, 0], losses[:, 1], tokens
