"""FP8 training (megatron_cp/fp8/): Megatron-LM's flags, defaults and rules (its
TransformerConfig and argument checks at the census commit), on torch._scaled_mm and
scaled_mm instead of Transformer Engine. The tensorwise, delayed, blockwise and MXFP8 recipes
are built; custom quantizers are refused until they are (and so is what only they enable).
"""
from dataclasses import dataclass

from megatron_cp.config.setting import setting

FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
# the block recipes' block lengths (block scales: megatron_cp/fp8/blocks.py)
BLOCK_LENGTH = {"blockwise": 128, "mxfp8": 32}
BLOCK_RECIPES = tuple(BLOCK_LENGTH)
NOT_BUILT_RECIPES = {
    "custom": "a custom quantizer factory (Transformer Engine's) is not built; use "
              "tensorwise, delayed, blockwise or mxfp8",
}


def check_whole_blocks(recipe, what, piece, ranks_flag, ranks, fix):
    """A block recipe's dim ``what`` split over ``ranks`` ranks (``ranks_flag``) into pieces
    of ``piece`` elements must be whole blocks, or a shard would cut a block and the layout
    quantize other blocks than one process; ``fix`` (a format string of ``length`` and
    ``ranks``) ends the one-line refusal."""
    length = BLOCK_LENGTH[recipe]
    if ranks > 1 and piece % length:
        raise ValueError(f"--fp8-recipe {recipe}: {what} is split over {ranks_flag} {ranks} "
                         f"into pieces of {piece}, not a multiple of the {length}-element "
                         f"block, so a shard would cut a block; "
                         f"{fix.format(length=length, ranks=ranks)}")


@dataclass(kw_only=True, frozen=True)
class Fp8Settings:
    """Part of :class:`~megatron_cp.config.model.GPTConfig` (see the module docstring)."""
    fp8: str | None = setting(
        None, flag="--fp8-format", choices=(None, "e4m3", "hybrid"), group="mixed precision",
        help="Run the transformer layers' linear GEMMs in FP8 on torch._scaled_mm: e4m3 for "
             "every FP8 tensor, or hybrid (e4m3 inputs and weights, e5m2 output gradients).")
    fp8_recipe: str = setting(
        "delayed", choices=FP8_RECIPES + tuple(NOT_BUILT_RECIPES), group="mixed precision",
        help="FP8 scaling: tensorwise (each tensor's scale from its own amax, current "
             "scaling), delayed (scales from an amax history of earlier steps), blockwise "
             "(power-of-2 scales per 1x128 block of inputs and gradients, per 128x128 block "
             "of weights; Hopper GPUs) or mxfp8 (E8M0 scales per 32 elements; Blackwell "
             "GPUs).")
    fp8_margin: int = setting(
        0, group="mixed precision",
        help="Delayed scaling: the scale is divided by 2^margin.")
    fp8_amax_history_len: int = setting(
        1, group="mixed precision",
        help="Delayed scaling: the amax history's length, in steps.")
    fp8_amax_compute_algo: str = setting(
        "most_recent", choices=("most_recent", "max"), group="mixed precision",
        help="Delayed scaling: the amax a scale comes from: the history's newest entry "
             "(most_recent) or its largest (max).")
    fp8_wgrad: bool = setting(
        True, flag="--no-fp8-wgrad", aliases=("--disable-fp8-wgrad",), group="mixed precision",
        help="Run the weight-gradient GEMM in the activations' precision instead of FP8.")
    fp8_output_proj: bool = setting(
        False, group="mixed precision",
        help="Run the output layer's GEMMs in FP8 too (--fp8-recipe mxfp8 only, Megatron-LM's "
             "rule).")
    first_last_layers_bf16: bool = setting(
        False, group="mixed precision",
        help="With FP8: keep the first and last decoder layers' linears in the activations' "
             "precision (not with the delayed recipe: Megatron-LM's rule).")
    num_layers_at_start_in_bf16: int = setting(
        1, group="mixed precision",
        help="--first-last-layers-bf16: how many first decoder layers stay in high precision.")
    num_layers_at_end_in_bf16: int = setting(
        1, group="mixed precision",
        help="--first-last-layers-bf16: how many last decoder layers stay in high precision.")

    def check_fp8(self, pipeline_model_parallel_size=1, context_parallel_size=1,
                  expert_tensor_parallel_size=1):
        """Megatron-LM's FP8 rules (its TransformerConfig's), and the layouts whose block-scaled
        expert GEMMs are built (:meth:`check_block_experts`)."""
        if self.fp8_recipe in NOT_BUILT_RECIPES:
            raise ValueError(f"fp8_recipe {self.fp8_recipe}: {NOT_BUILT_RECIPES[self.fp8_recipe]}")
        if self.fp8_output_proj and (not self.fp8 or self.fp8_recipe != "mxfp8"):
            raise ValueError(f"fp8_output_proj (True) needs --fp8-format with fp8_recipe "
                             f"'mxfp8' (Megatron-LM's rule), got --fp8-format {self.fp8} and "
                             f"fp8_recipe '{self.fp8_recipe}'; drop fp8_output_proj or give both")
        if not self.fp8:
            return
        if self.fp8_output_proj and self.tiled_logits_chunk_size:
            raise ValueError(f"fp8_output_proj (True) with tiled_logits_chunk_size "
                             f"({self.tiled_logits_chunk_size}): the tiled output layer is not "
                             f"built in FP8; drop one of them")
        if self.first_last_layers_bf16 and self.fp8_recipe == "delayed":
            raise ValueError("first_last_layers_bf16 (True) is not supported with fp8_recipe "
                             "'delayed' (Megatron-LM's rule): use fp8_recipe tensorwise")
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len ({self.fp8_amax_history_len}) must be >= 1")
        if self.first_last_layers_bf16:
            most = self.num_layers // pipeline_model_parallel_size
            for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
                value = getattr(self, name)
                if not 0 <= value <= most:
                    raise ValueError(f"{name} ({value}) must be between 0 and the number of "
                                     f"layers per pipeline stage ({most}) (Megatron-LM's rule)")
        if self.mlp_chunks_for_training > 1:
            raise ValueError(f"fp8 with mlp_chunks_for_training ({self.mlp_chunks_for_training})"
                             f": a chunk's FP8 input amax over its own rows is not built; drop "
                             f"mlp_chunks_for_training")
        if self.tp_comm_overlap:
            raise ValueError("fp8 with tp_comm_overlap (True): the overlapped column/row "
                             "GEMMs are not built in FP8; drop tp_comm_overlap")
        self.check_block_experts(context_parallel_size, expert_tensor_parallel_size)

    def check_block_experts(self, cp_size, etp_size):
        """Block recipes with routed experts (fp8/grouped_blocks.py): each expert's wgrad
        blocks are its rows in one process's token order, which CP's zigzag chunks do not
        keep; an ETP shard of the expert FFN dim must be whole blocks."""
        if self.fp8_recipe not in BLOCK_LENGTH or not self.num_moe_experts:
            return
        if cp_size > 1:
            raise ValueError(f"--fp8-recipe {self.fp8_recipe} with --num-experts and "
                             f"--context-parallel-size {cp_size}: the experts' wgrad token "
                             f"blocks would follow CP's zigzag chunks, not one process's token "
                             f"order; use --fp8-recipe tensorwise or delayed, or CP 1")
        ffn = self.moe_ffn_hidden_size
        check_whole_blocks(self.fp8_recipe, f"moe_ffn_hidden_size ({ffn})", ffn // etp_size,
                           "--expert-tensor-parallel-size", etp_size,
                           "use a multiple of {length} x {ranks} or ETP 1")

    def fp8_checks_and_notes(self, fp8_param_gather):
        """--fp8-param-gather's rules on the FP8 settings (Megatron-LM's: it needs FP8; here:
        not with the block recipes); returns FP8's start-up notes (:meth:`fp8_notes`) and its."""
        if not fp8_param_gather:
            return self.fp8_notes()
        if not self.fp8:
            raise ValueError("fp8_param_gather (True) keeps FP8 weights, which need fp8 "
                             "(Megatron-LM's rule): give it e4m3 or hybrid")
        if self.fp8_recipe in BLOCK_RECIPES:
            raise ValueError(f"fp8_param_gather (True) with fp8_recipe {self.fp8_recipe}: FP8 "
                             f"weights in blocks are not built; use fp8_recipe tensorwise or "
                             f"delayed, or drop fp8_param_gather")
        if not self.num_moe_experts:
            return self.fp8_notes()
        return self.fp8_notes() + [f"--fp8-param-gather with --num-experts {self.num_moe_experts}: the routed "
                f"experts' weights stay in the model's dtype between steps and are gathered "
                f"so (Megatron-LM keeps them in FP8 too); each step casts them to FP8 per "
                f"expert as it runs, the values Megatron-LM's FP8 expert weights hold"]

    @property
    def wgrad_in_fp8(self):
        """Whether the weight-gradient GEMM runs in FP8: Megatron-LM hands --no-fp8-wgrad to
        the delayed recipe only (Transformer Engine's override_linear_precision); its other
        recipes run the wgrad in FP8 whatever the flag."""
        return self.fp8_wgrad or self.fp8_recipe != "delayed"

    def fp8_notes(self):
        """Start-up notes: the delayed recipe's settings given with tensorwise or block
        scaling, which ignore them (as Megatron-LM's current scaling does). (The routed
        experts' grouped GEMMs run in FP8 under every recipe: fp8/grouped.py.)"""
        notes = []
        if self.fp8 and self.wgrad_in_fp8 != self.fp8_wgrad:
            notes.append(f"--no-fp8-wgrad with --fp8-recipe {self.fp8_recipe}: Megatron-LM "
                         f"passes it to the delayed recipe only, so the weight-gradient GEMM "
                         f"runs in FP8 here too; it changes nothing")
        if self.fp8 and self.fp8_recipe != "delayed":
            delayed_only = {"--fp8-margin": (self.fp8_margin, 0),
                            "--fp8-amax-history-len": (self.fp8_amax_history_len, 1),
                            "--fp8-amax-compute-algo": (self.fp8_amax_compute_algo,
                                                        "most_recent")}
            for flag, (value, default) in delayed_only.items():
                if value != default:
                    notes.append(f"{flag} {value}: shapes delayed scaling only; --fp8-recipe "
                                 f"{self.fp8_recipe} takes each scale from the tensor itself "
                                 f"and ignores it, as Megatron-LM's current scaling does")
        return notes
