"""The top-k router: logits, routing (top-k, Sinkhorn-balanced in training, or quantile
balanced), capacity, balancing losses, expert bias and the statistics the training loop logs.

The router weight ``[E, h]`` is replicated over TP; the MoE layer gives each TP rank its
own tokens, so the weight's gradient is summed over TP (``sequence_parallel``) as well as
over DP x CP. The expert bias (aux-loss-free balancing) is a buffer, not a parameter: the
training loop moves it once per global batch (:func:`megatron_cp.moe.update_expert_bias`)
from the token counts this router accumulated. Quantile balancing's bias ``qb_beta`` (a
buffer too) moves likewise (:func:`megatron_cp.moe.update_qb_beta`) from the quantiles of the
global batch's microbatches.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar
from megatron_cp.layers.hidden_dropout import uniform_multiplier
from megatron_cp.moe import comm
from megatron_cp.moe.balancing import AttachLoss, aux_loss, sinkhorn, z_loss
from megatron_cp.moe.routing import (apply_capacity, expert_capacity, expert_quantiles,
                                     quantile_balanced_choice, scores_for_balancing,
                                     sinkhorn_routing, topk_routing)

ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


class TopKRouter(torch.nn.Module):
    """tokens [T, h] -> (probs [T, E], routing_map [T, E] bool), attaching the balancing
    losses to ``probs`` for backward."""

    def __init__(self, config, prefix, token_groups, dp_group, rng_tracker, tp_size=1,
                 device=None):
        super().__init__()
        self.config, self.rng_tracker = config, rng_tracker
        self.token_groups, self.dp_group = token_groups, dp_group
        experts = config.num_moe_experts
        self.weight = tpar.drawn_weight(
            (experts, config.hidden_size), tpar.normal_init(config.hidden_init_std),
            tpar.init_seed(config.seed, prefix + ".weight"), config.params_dtype, device)
        self.weight.sequence_parallel = tp_size > 1  # each TP rank routes its own tokens
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32,
                                                            device=device))
        else:
            self.expert_bias = None
        if config.moe_router_load_balancing_type == "quantile_balancing":
            self.register_buffer("qb_beta", torch.zeros(experts, dtype=torch.float32,
                                                        device=device))
        else:
            self.qb_beta = None
        self.aux_loss_scale = 1.0  # set per step by the training loop (balancing.py)
        self.bias_counts = None  # weighted tokens per expert since the last bias update
        self.qb_sums = None  # [E + 1]: summed microbatch quantiles, then their number
        self.reset_stats(device)

    def reset_stats(self, device=None):
        """Zero the statistics of the training microbatches seen since the last reset:
        summed aux and z-loss values and the weighted token count per expert (on ``device``,
        default the weight's: at construction the weight may still be on the meta device)."""
        device = device or self.weight.device
        self.stats = {"aux_loss": torch.zeros((), dtype=torch.float64, device=device),
                      "z_loss": torch.zeros((), dtype=torch.float64, device=device),
                      "tokens_per_expert": torch.zeros(self.config.num_moe_experts,
                                                       dtype=torch.float64, device=device)}

    def _recording(self):
        """Training microbatches only, and not again when full recomputation reruns the layer."""
        return self.training and not getattr(self.rng_tracker, "recomputing", False)

    def _record(self, aux_value, z_value, counts):
        if not self._recording():
            return
        self.stats["aux_loss"] += aux_value.double()
        self.stats["z_loss"] += z_value.double()
        self.stats["tokens_per_expert"] += counts.double()
        if self.expert_bias is not None:
            self.bias_counts = counts.double() + (0 if self.bias_counts is None else self.bias_counts)

    @torch.no_grad()
    def _quantile_balanced(self, logits, weights):
        """Quantile balancing (Megatron-LM's): each token's experts are the top-k of its
        logits minus the bias ``qb_beta``; in training each expert's quantile of the whole
        microbatch (its weighted tokens, gathered over the ranks holding it) is summed for
        the update after the global batch (:func:`megatron_cp.moe.update_qb_beta`).
        Returns the chosen experts [T, k]."""
        k = self.config.moe_router_topk
        experts, alpha = quantile_balanced_choice(logits, k, self.qb_beta)  # [T, k], [T, 1]
        if not self._recording():
            return experts
        rows = (logits.float() - alpha)[weights > 0]  # [m_local, E]
        for group in self.token_groups:  # the microbatch's counted tokens on every rank
            if group is not None and dist.get_world_size(group) > 1:
                counts = comm.all_gather_counts(torch.tensor([rows.shape[0]],
                                                             device=rows.device), group)
                rows = comm.gather_rows(rows, counts.flatten().tolist(), group)
        if rows.shape[0] == 0:  # nothing counted in this microbatch: no quantile
            return experts
        sums = torch.cat([expert_quantiles(rows, k).double(), rows.new_ones(1).double()])
        self.qb_sums = sums if self.qb_sums is None else self.qb_sums + sums
        return experts

    def forward(self, tokens, weights, seq_ids, num_seqs, jitter_states=None):
        """``tokens`` [T, h]; ``weights`` [T] (1 for tokens the losses count); ``seq_ids`` [T]
        the microbatch row of each token, of ``num_seqs`` rows; ``jitter_states`` [T] int64:
        each token's hash state for --moe-input-jitter-eps (MoELayer's), needed in training."""
        c = self.config
        dtype = ROUTER_DTYPES[c.moe_router_dtype] or tokens.dtype
        x = tokens.to(dtype)
        if self.training and c.moe_input_jitter_eps:
            assert jitter_states is not None, "MoELayer passes each token's jitter states"
            # a function of the token's global coordinates, not of an RNG stream (layer.py)
            x = x * uniform_multiplier(jitter_states, x.shape[-1], c.moe_input_jitter_eps,
                                       dtype)  # [T, h]
        logits = F.linear(x, self.weight.to(dtype))  # [T, E]
        if c.moe_router_load_balancing_type == "sinkhorn":
            indices = None  # evaluation: the plain top-k
            if self.training:
                balanced = sinkhorn(logits.detach(), weights, self.token_groups)  # [T, E]
                indices = balanced.topk(c.moe_router_topk, dim=-1).indices  # [T, k]
            probs, routing_map = sinkhorn_routing(logits, c.moe_router_topk, indices)
        elif c.moe_router_load_balancing_type == "quantile_balancing":
            probs, routing_map = topk_routing(
                logits, c.moe_router_topk, c.moe_router_score_function, c.moe_router_pre_softmax,
                c.moe_router_topk_scaling_factor,
                chosen_experts=self._quantile_balanced(logits, weights))
        else:
            probs, routing_map = topk_routing(
                logits, c.moe_router_topk, c.moe_router_score_function, c.moe_router_pre_softmax,
                c.moe_router_topk_scaling_factor, c.moe_router_num_groups,
                c.moe_router_group_topk, self.expert_bias)
        counts = (routing_map.to(torch.float32) * weights.to(torch.float32)[:, None]).sum(0)  # [E]
        local = logits.new_zeros(())
        aux_value = z_value = torch.zeros((), dtype=torch.float32, device=logits.device)
        losses = c.balancing_losses() if self.training else {}
        scores = scores_for_balancing(logits, c.moe_router_score_function) if losses else None
        for kind, coeff in losses.items():  # several types: their losses add up
            part, value = aux_loss(
                kind, scores, routing_map, weights, topk=c.moe_router_topk, coeff=coeff,
                token_groups=self.token_groups, dp_group=self.dp_group, seq_ids=seq_ids,
                num_seqs=num_seqs)
            local, aux_value = local + part, aux_value + value
        if self.training and c.moe_z_loss_coeff:
            part, z_value = z_loss(logits, weights, coeff=c.moe_z_loss_coeff,
                                   token_groups=self.token_groups)
            local = local + part
        self._record(aux_value, z_value, counts)
        if c.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], c.num_moe_experts, c.moe_router_topk,
                                       c.moe_expert_capacity_factor)
            probs, routing_map = apply_capacity(probs, routing_map, capacity,
                                                c.moe_token_drop_policy,
                                                c.moe_pad_expert_input_to_capacity)
        if local.requires_grad:
            probs = AttachLoss.apply(probs, local, self.aux_loss_scale)
        return probs.to(tokens.dtype), routing_map
