"""The model's Gated DeltaNet part (Qwen3-Next hybrids; model/gated_delta_net.py): which layers
are linear attention, their sizes, and the context-parallel rule they follow."""
from dataclasses import dataclass

from megatron_cp.config.layer_pattern import parse_layer_freq
from megatron_cp.config.parallel import resolve_comm_type
from megatron_cp.config.setting import resolve, setting


@dataclass(kw_only=True, frozen=True)
class GatedDeltaNetSettings:
    """Gated DeltaNet's settings, part of :class:`~megatron_cp.config.model.GPTConfig`."""
    experimental_attention_variant: str | None = setting(
        None, choices=(None, "gdn", "gated_delta_net", "gdn2", "dsa"), shapes=True,
        help="gdn (or its older name gated_delta_net): Gated DeltaNet linear-attention layers "
             "where --linear-attention-freq puts them; the others are full attention. gdn2 "
             "and dsa are not built.")
    linear_attention_freq: str | None = setting(
        None, shapes=True,
        help="Which layers are Gated DeltaNet (1) and which full attention (0): an integer N "
             "(N-1 GDN layers, then one attention layer, repeated) or a 0/1 pattern with one "
             "entry per layer, e.g. '([1]*3+[0]*1)*2'.")
    linear_conv_kernel_dim: int = setting(4, shapes=True,
                                          help="GDN: width of the causal depthwise conv.")
    linear_key_head_dim: int = setting(128, shapes=True, help="GDN: query/key head dim.")
    linear_value_head_dim: int = setting(128, shapes=True, help="GDN: value head dim.")
    linear_num_key_heads: int = setting(16, shapes=True, help="GDN: query/key heads.")
    linear_num_value_heads: int = setting(
        32, shapes=True, help="GDN: value heads (a multiple of the key heads; each key head "
        "serves that many consecutive value heads).")

    def _check_linear_attention(self):
        """Gated DeltaNet settings (Megatron-LM's TransformerConfig checks)."""
        variant = self.experimental_attention_variant
        if variant in ("gdn2", "dsa"):
            raise ValueError(f"experimental_attention_variant ({variant!r}) is not built; use "
                             f"gdn (Gated DeltaNet) or drop it")
        if variant == "gated_delta_net":  # Megatron-LM's deprecated spelling
            variant = "gdn"
            resolve(self, experimental_attention_variant=variant)
        if variant is None:
            if self.linear_attention_freq is not None:
                raise ValueError(f"linear_attention_freq ({self.linear_attention_freq}) places "
                                 f"Gated DeltaNet layers; add experimental_attention_variant "
                                 f"gdn or drop it")
            return
        if self.linear_attention_freq is None:
            raise ValueError("experimental_attention_variant gdn needs linear_attention_freq "
                             "(e.g. 4: three GDN layers, then one attention layer)")
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                             f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.activation != "swiglu":
            raise ValueError(f"Gated DeltaNet layers run SiLU in their conv and output gate "
                             f"(Megatron-LM's GDN kernels: its activation with --swiglu), but "
                             f"the MLP has {self.activation!r}: add --swiglu")
        self.linear_attention_pattern()  # raises on a malformed --linear-attention-freq
        self._check_mtp()

    def linear_attention_pattern(self):
        """One bool per layer: is it a Gated DeltaNet layer (all False without gdn). An
        integer N makes every N-th layer (layers N-1, 2N-1, ...) full attention."""
        if self.experimental_attention_variant is None:
            return [False] * self.num_layers
        return [bool(x) for x in parse_layer_freq(
            self.linear_attention_freq, self.num_layers, "linear_attention_freq",
            every_kth=lambda k, i: 0 if (i + 1) % k == 0 else 1)]

    def gdn_cp_comm_type(self, tp_size, cp_size, layer_number):
        """The CP communication of Gated DeltaNet layer ``layer_number``
        (context_parallel/gated_delta.py): the layer's ``cp_comm_type`` entry, "auto" resolved
        as attention resolves it. Its all-to-all (a2a: over CP; a2a+p2p: over the inner U
        ranks) hands every rank whole key heads with their value heads, so both head counts
        must split over TP x U."""
        method, sizes = resolve_comm_type(self.layer_cp_comm_type(layer_number),
                                          self.num_query_groups // tp_size, cp_size,
                                          self.hierarchical_context_parallel_sizes)
        inner = {"a2a": cp_size, "a2a+p2p": sizes[0] if sizes else 1}.get(method, 1)
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(self, name) % (tp_size * inner):
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be divisible by tensor_model_parallel_"
                    f"size x the all-to-all size of cp_comm_type {method} ({tp_size} x {inner}): "
                    f"the Gated DeltaNet all-to-all splits whole heads; use cp_comm_type p2p "
                    f"(state passing) or a head count divisible by {tp_size * inner}")
        return method
