"""The model's mixture-of-experts part (megatron_cp.moe): Megatron-LM's MoE flags and defaults
(router, balancing, dispatcher, capacity), and their rules."""
from dataclasses import dataclass

from megatron_cp.config.layer_pattern import parse_layer_freq
from megatron_cp.config.setting import resolve, setting

AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")  # Megatron-LM's order
BALANCING_TYPES = AUX_LOSS_TYPES + ("sinkhorn", "quantile_balancing", "none")
# router scores of each expert on its own logit (normalised over the chosen experts; an
# expert bias may shift them)
ELEMENTWISE_SCORES = ("sigmoid", "sqrtsoftplus")


@dataclass(kw_only=True, frozen=True)
class MoESettings:
    """The MoE settings, part of :class:`~megatron_cp.config.model.GPTConfig`."""
    num_moe_experts: int = setting(0, flag="--num-experts", cli_default=None, shapes=True,
                                   group="moe", help="Number of MoE experts (0: a dense model).")
    moe_ffn_hidden_size: int | None = setting(
        None, shapes=True, fill_arg=True, group="moe", help="Hidden size of each routed expert (default "
        "--ffn-hidden-size).")
    moe_layer_freq: str = setting(
        "1", shapes=True, group="moe",
        help="Which layers are MoE: an integer k (every k-th layer, from layer 0) or a 0/1 "
             "pattern with one entry per layer, e.g. '([0]*2+[1]*6)' (two dense first layers).")
    moe_shared_expert_intermediate_size: int | None = setting(
        None, shapes=True, group="moe",
        help="Hidden size of the shared expert every token goes through (none by default).")
    moe_shared_expert_gate: bool = setting(
        False, shapes=True, group="moe",
        help="Scale the shared expert's output by sigmoid(x . w) of a learned gate.")
    moe_router_topk: int = setting(2, group="moe", help="Experts each token is routed to.")
    moe_router_score_function: str = setting(
        "softmax", choices=("softmax", "sigmoid", "sqrtsoftplus"), group="moe",
        help="Router scores: softmax, sigmoid or sqrtsoftplus (sqrt(softplus(logit)); "
             "sigmoid and sqrtsoftplus are normalised over the chosen experts when top-k > 1).")
    moe_router_pre_softmax: bool = setting(
        False, group="moe", help="Softmax over all experts before the top-k (default: softmax "
        "over the top-k logits).")
    moe_router_topk_scaling_factor: float | None = setting(
        None, group="moe", help="Multiply the routing probabilities by this factor.")
    moe_router_num_groups: int | None = setting(
        None, group="moe", help="Group-limited routing: experts are split into this many "
        "groups (e.g. one per node) ...")
    moe_router_group_topk: int | None = setting(
        None, group="moe", help="... and each token is routed inside its best this-many "
        "groups (scored by the sum of their top-(topk/group-topk) scores).")
    moe_router_dtype: str | None = setting(
        None, choices=(None, "fp32", "fp64"), group="moe",
        help="Compute the router (logits, scores, balancing losses) in this dtype "
             "(default: the model's).")
    moe_input_jitter_eps: float | None = setting(
        None, group="moe", help="Multiply the router input by U(1-eps, 1+eps) in training.")
    moe_router_load_balancing_type: str | tuple[str, ...] = setting(
        "aux_loss", choices=BALANCING_TYPES, nargs="+", fill_arg=True, group="moe",
        help="Load balancing: aux_loss (per microbatch), seq_aux_loss (per sequence), "
             "global_aux_loss (over the microbatches the data-parallel ranks run together), "
             "sinkhorn (S-BASE: in training each token's experts are the top-k of the "
             "Sinkhorn-balanced router scores of its microbatch; no balancing loss), "
             "quantile_balancing (each token's experts are the top-k of its logits minus a "
             "per-expert bias, which moves after each global batch to the experts' "
             "fair-share quantiles of the logits; no balancing loss), none. "
             "Several types (e.g. aux_loss seq_aux_loss) add their losses together, each "
             "with its own --moe-aux-loss-coeff, under plain top-k routing. "
             "Padding and loss-masked tokens are never counted.")
    moe_aux_loss_coeff: float | tuple[float, ...] = setting(
        0.0, nargs="+", fill_arg=True, group="moe",
        help="Weight of the load-balancing loss; with several load-balancing types, one "
             "weight per type, in their order.")
    moe_router_quantile_balancing_ema: float = setting(
        0.0, group="moe",
        help="Quantile balancing's bias update after each global batch: bias = ema x bias + "
             "(1 - ema) x the batch's mean quantiles, then centred (0: the latest quantiles).")
    moe_z_loss_coeff: float | None = setting(
        None, group="moe", help="Weight of the router z-loss (mean squared log-sum-exp of the "
        "router logits).")
    moe_router_enable_expert_bias: bool = setting(
        False, shapes=True, group="moe",
        help="Aux-loss-free balancing: a per-expert bias added to the scores for the top-k "
             "choice only, moved after each global batch towards equal token counts (with "
             "--moe-router-score-function sigmoid or sqrtsoftplus).")
    moe_router_bias_update_rate: float = setting(
        1e-3, group="moe", help="Step of the expert-bias update (sign of the count error).")
    moe_token_dispatcher_type: str = setting(
        "allgather", choices=("allgather", "alltoall", "flex"), group="moe",
        help="How tokens reach their experts over the expert-parallel group: allgather "
             "(every token to every EP rank) or alltoall (each token to its experts' ranks). "
             "Megatron-LM's flex exchanges the same tokens through the DeepEP / HybridEP / "
             "NCCL EP GPU libraries; here it runs the alltoall dispatcher.")
    moe_expert_capacity_factor: float | None = setting(
        None, group="moe", help="Drop tokens above capacity = ceil(tokens x topk / experts x "
        "factor) per expert and rank (default: dropless).")
    moe_token_drop_policy: str = setting(
        "probs", choices=("probs", "position"), group="moe",
        help="Which tokens an expert over capacity keeps: the highest probabilities or the "
             "first positions.")
    moe_pad_expert_input_to_capacity: bool = setting(
        False, group="moe", help="Every expert processes exactly its capacity of tokens "
        "(unrouted ones with weight 0): fixed shapes.")
    moe_router_padding_for_quantization: bool = setting(
        False, aliases=("--moe-router-padding-for-fp8",), group="moe",
        help="With FP8: each rank pads its routing map so every expert gets a multiple of 16 "
             "rows (32 under MXFP8) from it, the added entries with probability 0 (Megatron-LM's "
             "rule; they change no output and stay out of the FP8 amaxes).")

    def router_pad_multiple(self):
        """The rows per expert the routing padding rounds up to (Megatron-LM's
        get_align_size_for_quantization): 32 under MXFP8, 16 for the other FP8 recipes, 0
        (no padding) without the flag."""
        if not self.moe_router_padding_for_quantization:
            return 0
        return 32 if self.fp8_recipe == "mxfp8" else 16

    def _check_router_padding(self):
        """Megatron-LM's rules for the routing padding (its TransformerConfig's)."""
        if not self.moe_router_padding_for_quantization:
            return
        if not self.fp8:
            raise ValueError("moe_router_padding_for_quantization (True) pads for FP8 GEMMs and "
                             "needs fp8 (Megatron-LM's rule): give --fp8-format, or drop it")
        if self.moe_token_dispatcher_type == "allgather":
            raise ValueError("moe_router_padding_for_quantization (True) is not supported by "
                             "moe_token_dispatcher_type allgather (Megatron-LM's rule): use "
                             "alltoall")

    def _resolve_balancing_lists(self):
        """Megatron-LM's rule (its validate_args): a list of one load-balancing type or one
        coefficient is that value; longer lists stay tuples."""
        for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                resolve(self, **{name: value[0] if len(value) == 1 else tuple(value)})

    def balancing_losses(self):
        """``{type: coefficient}`` of the balancing losses the router adds, in Megatron-LM's
        order: each aux-loss type of moe_router_load_balancing_type whose coefficient is
        positive (in a list, the coefficient at the type's first entry)."""
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if not isinstance(types, tuple):
            types, coeffs = (types,), (coeffs,)
        chosen = {kind: coeffs[types.index(kind)] for kind in AUX_LOSS_TYPES if kind in types}
        return {kind: coeff for kind, coeff in chosen.items() if coeff > 0}

    def _check_balancing_lists(self):
        """A list of load-balancing types combines balancing losses, one coefficient each
        (Megatron-LM's TransformerConfig rule); the routing balancers cannot join one."""
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if not isinstance(types, tuple):
            if isinstance(coeffs, tuple):
                raise ValueError(f"moe_aux_loss_coeff ({' '.join(map(str, coeffs))}) gives "
                                 f"{len(coeffs)} coefficients for one "
                                 f"moe_router_load_balancing_type ({types}); give one "
                                 f"coefficient, or one type per coefficient")
            return
        shown = " ".join(types)
        if not isinstance(coeffs, tuple) or len(coeffs) != len(types):
            given = " ".join(map(str, coeffs)) if isinstance(coeffs, tuple) else coeffs
            raise ValueError(f"moe_router_load_balancing_type ({shown}) lists {len(types)} "
                             f"types, so moe_aux_loss_coeff needs {len(types)} coefficients, "
                             f"one per type in the same order (Megatron-LM's rule); got "
                             f"{given}")
        for kind in types:
            if kind not in AUX_LOSS_TYPES + ("none",):
                raise ValueError(
                    f"moe_router_load_balancing_type ({shown}): {kind} balances by routing, "
                    f"and a list of types combines balancing losses under plain top-k "
                    f"routing (Megatron-LM's meaning), where {kind} has no effect; give "
                    f"moe_router_load_balancing_type {kind} alone, or list only aux_loss, "
                    f"seq_aux_loss, global_aux_loss and none")

    def _check_moe(self):
        """The MoE rules that need no parallel size (see :meth:`validate_experts`)."""
        experts, topk = self.num_moe_experts, self.moe_router_topk
        if self.moe_ffn_hidden_size is None:
            resolve(self, moe_ffn_hidden_size=self.ffn_hidden_size)
        if not 1 <= topk <= experts:
            raise ValueError(f"moe_router_topk ({topk}) must be between 1 and num_moe_experts "
                             f"({experts})")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError(f"moe_router_num_groups ({groups}) and moe_router_group_topk "
                             f"({group_topk}) go together: give both or neither")
        if groups is not None:
            if experts % groups or not 1 <= group_topk <= groups or topk % group_topk:
                raise ValueError(
                    f"group-limited routing needs num_moe_experts ({experts}) divisible by "
                    f"moe_router_num_groups ({groups}), 1 <= moe_router_group_topk ({group_topk}) "
                    f"<= moe_router_num_groups, and moe_router_topk ({topk}) divisible by "
                    f"moe_router_group_topk")
            if topk // group_topk > experts // groups:
                raise ValueError(f"moe_router_topk / moe_router_group_topk ({topk // group_topk}) "
                                 f"experts per group exceeds the group size "
                                 f"({experts // groups}); raise moe_router_group_topk")
        self._check_balancing_lists()
        self._check_router_padding()
        if self.moe_router_load_balancing_type == "sinkhorn":
            self._check_sinkhorn()
        if self.moe_router_load_balancing_type == "quantile_balancing":
            self._check_quantile_balancing()
        if self.moe_router_enable_expert_bias and \
                self.moe_router_score_function not in ELEMENTWISE_SCORES:
            raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function "
                             "sigmoid or sqrtsoftplus (the bias shifts those scores for the "
                             "top-k choice; Megatron-LM's rule)")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            raise ValueError(f"moe_expert_capacity_factor ({self.moe_expert_capacity_factor}) "
                             f"must be > 0 (leave it out for dropless routing)")
        self.moe_layer_pattern()  # raises on a malformed --moe-layer-freq

    def _check_sinkhorn(self):
        """Sinkhorn routing balances by itself and scores the plain logits its own way
        (sigmoid for top-1, softmax over all experts otherwise), so the settings of the other
        routers would be silently ignored: each is refused."""
        if self.moe_aux_loss_coeff > 0:
            raise ValueError(f"moe_router_load_balancing_type 'sinkhorn' balances without a "
                             f"loss, so moe_aux_loss_coeff ({self.moe_aux_loss_coeff}) must be 0 "
                             f"(Megatron-LM refuses it too); drop moe_aux_loss_coeff")
        ignored = [name for name, value, default in (
            ("moe_router_score_function", self.moe_router_score_function, "softmax"),
            ("moe_router_pre_softmax", self.moe_router_pre_softmax, False),
            ("moe_router_topk_scaling_factor", self.moe_router_topk_scaling_factor, None),
            ("moe_router_num_groups", self.moe_router_num_groups, None),
            ("moe_router_enable_expert_bias", self.moe_router_enable_expert_bias, False))
            if value != default]
        if ignored:
            raise ValueError(f"moe_router_load_balancing_type 'sinkhorn' scores the logits with "
                             f"sigmoid (top-1) or a softmax over all experts and routes by its "
                             f"balanced scores, so {', '.join(ignored)} would have no effect; "
                             f"drop {'it' if len(ignored) == 1 else 'them'}")

    def _check_quantile_balancing(self):
        """Quantile balancing chooses the experts with its own bias (Megatron-LM's rules)."""
        name = "moe_router_load_balancing_type 'quantile_balancing'"
        if self.moe_aux_loss_coeff > 0:
            raise ValueError(f"{name} balances with its per-expert bias, so moe_aux_loss_coeff "
                             f"({self.moe_aux_loss_coeff}) must be 0 (Megatron-LM's rule); drop "
                             f"moe_aux_loss_coeff")
        if self.moe_router_topk >= self.num_moe_experts:
            raise ValueError(f"{name} ranks each token's (k+1)-th expert, so moe_router_topk "
                             f"({self.moe_router_topk}) must be below num_moe_experts "
                             f"({self.num_moe_experts})")
        refused = [(setting, why) for setting, given, why in (
            ("moe_router_num_groups", self.moe_router_num_groups is not None,
             "group-limited routing is not supported with it (Megatron-LM's rule)"),
            ("moe_expert_capacity_factor", self.moe_expert_capacity_factor is not None,
             "token dropping works with the aux-loss types or none only (Megatron-LM's rule)"),
            ("moe_router_enable_expert_bias", self.moe_router_enable_expert_bias,
             "its bias would not take part in the choice"))
            if given]
        if refused:
            setting, why = refused[0]
            raise ValueError(f"{name} chooses the experts with its own bias, and {setting}: "
                             f"{why}; drop {setting}")

    def moe_layer_pattern(self):
        """One bool per layer: is it an MoE layer (all False for a dense model)."""
        if not self.num_moe_experts:
            return [False] * self.num_layers
        return [bool(x) for x in parse_layer_freq(self.moe_layer_freq, self.num_layers)]

    def validate_experts(self, ep_size, etp_size):
        """Raise ValueError unless the experts split over ``ep_size`` expert-parallel ranks
        and their hidden size over ``etp_size`` expert-tensor-parallel ranks."""
        if not self.num_moe_experts:
            return
        if self.num_moe_experts % ep_size:
            raise ValueError(f"num_moe_experts ({self.num_moe_experts}) must be divisible by "
                             f"expert_model_parallel_size ({ep_size})")
        if self.moe_ffn_hidden_size % etp_size:
            raise ValueError(f"moe_ffn_hidden_size ({self.moe_ffn_hidden_size}) must be divisible "
                             f"by expert_tensor_parallel_size ({etp_size})")
