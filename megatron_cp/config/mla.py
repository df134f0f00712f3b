"""The model's multi-head latent attention part (DeepSeek-V2/V3; model/multi_latent_attention.py):
Megatron-LM's flags and defaults, and their rules."""
from dataclasses import dataclass

from megatron_cp.config.setting import resolve, setting


@dataclass(kw_only=True, frozen=True)
class MLASettings:
    """Multi-head latent attention's settings, part of :class:`~megatron_cp.config.model.GPTConfig`."""
    multi_latent_attention: bool = setting(
        False, shapes=True,
        help="Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one "
             "compressed latent per token (--kv-lora-rank) plus one shared rotary key "
             "(--qk-pos-emb-head-dim); queries from a compressed latent (--q-lora-rank) or "
             "straight from the hidden states.")
    q_lora_rank: int | None = setting(
        None, shapes=True, help="MLA: rank of the query latent (linear_q_down_proj, then "
        "linear_q_up_proj); none: one linear_q_proj from the hidden states.")
    kv_lora_rank: int = setting(32, shapes=True, help="MLA: rank of the key/value latent.")
    qk_head_dim: int = setting(
        128, shapes=True, help="MLA: per-head query/key channels without position; the "
        "attention head dim of q and k is qk_head_dim + qk_pos_emb_head_dim.")
    qk_pos_emb_head_dim: int = setting(
        64, shapes=True, help="MLA: per-head rotary channels of q, and of the one rotary key "
        "every head shares.")
    v_head_dim: int = setting(128, shapes=True, help="MLA: per-head value channels.")
    rope_type: str | None = setting(
        None, choices=(None, "rope", "yarn"),
        help="MLA's rotary embedding: rope, or yarn (the default with "
             "--multi-latent-attention, using --rotary-scaling-factor, --mscale and "
             "--mscale-all-dim). Other attention takes rope only (choose YaRN there with "
             "--position-embedding-type yarn).")

    def _check_mla(self):
        """Multi-latent attention's rules (Megatron-LM's MLATransformerConfig and argument
        checks); fills rope_type's MLA default, yarn."""
        if not self.multi_latent_attention:
            given = [f"{name} ({getattr(self, name)})" for name in ("q_lora_rank",)
                     if getattr(self, name) is not None]
            if self.rope_type == "yarn":
                given.append("rope_type ('yarn')")
            if given:
                raise ValueError(f"{', '.join(given)} applies to multi_latent_attention only; "
                                 f"add multi_latent_attention or drop it (for YaRN in standard "
                                 f"attention use position_embedding_type yarn)")
            return
        if self.rope_type is None:
            resolve(self, rope_type="yarn")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank ({self.q_lora_rank}) must be positive, or left out "
                             f"for no query compression")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must be even: "
                             f"rotary turns channel pairs")
        refused = [
            (self.num_query_groups not in (None, self.num_attention_heads),
             f"num_query_groups ({self.num_query_groups}): every MLA head has its own key and "
             f"value (Megatron-LM refuses --group-query-attention with MLA); drop it"),
            (self.attention_output_gate, "attention_output_gate (True) is not built for MLA "
             "(nor in Megatron-LM); drop it"),
            (self.experimental_attention_variant is not None,
             f"experimental_attention_variant ({self.experimental_attention_variant!r}) layers "
             f"are not built beside MLA; drop one"),
            (self.position_embedding_type == "yarn",
             "position_embedding_type ('yarn') would rotate the hidden states a second time: "
             "MLA rotates its own rotary channels; use position_embedding_type rope with "
             "rope_type yarn"),
            (self.rotary_interleaved, "rotary_interleaved (True): MLA already pairs the "
             "rotary channels (2i, 2i+1) as DeepSeek does; drop it"),
        ]
        for bad, why in refused:
            if bad:
                raise ValueError(why)
        if self.rope_type == "yarn" and self.rotary_percent != 1.0:
            raise ValueError(f"rotary_percent ({self.rotary_percent}): MLA's YaRN rotates every "
                             f"rotary channel; drop it or use rope_type rope")
