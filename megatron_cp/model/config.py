"""The GPT model's configuration: one dataclass, validated against the parallel sizes."""
import math
from dataclasses import dataclass, field

import torch


def pad_vocab_size(vocab_size, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1):
    """Megatron's padding: round the vocab up to a multiple of divisible_by x TP."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass
class GPTConfig:
    """Everything that shapes the GPT model. Sizes follow Megatron-LM's argument names."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None  # None: multi-head attention (= num_attention_heads)
    kv_channels: int | None = None  # per-head dim; None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    position_embedding_type: str = "rope"  # rope | learned_absolute
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5
    activation: str = "gelu"  # gelu | swiglu
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    seed: int = 1234
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    recompute_granularity: str | None = None  # None | full | selective
    recompute_method: str | None = None  # uniform | block (for full)
    recompute_num_layers: int | None = None
    cp_comm_type: str = "p2p"  # p2p | a2a | a2a+p2p | all_gather | auto
    hierarchical_context_parallel_sizes: tuple | None = None
    allow_dummy_heads: bool = True
    # MoE (built by the moe package; 0 experts = dense MLP everywhere)
    num_moe_experts: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                                 f"num_attention_heads ({self.num_attention_heads}), or set kv_channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        choices = {"position_embedding_type": ("rope", "learned_absolute"),
                   "normalization": ("LayerNorm", "RMSNorm"), "activation": ("gelu", "swiglu"),
                   "recompute_granularity": (None, "full", "selective"),
                   "cp_comm_type": ("p2p", "a2a", "a2a+p2p", "all_gather", "auto")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} ({getattr(self, name)!r}) must be one of {allowed}")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_query_groups ({self.num_query_groups})")
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_granularity 'full' needs recompute_method uniform or block "
                             f"(got {self.recompute_method!r})")

    def validate_parallel(self, tp_size):
        """Raise ValueError unless heads and query groups split over ``tp_size`` ranks."""
        for name in ("num_attention_heads", "num_query_groups"):
            if getattr(self, name) % tp_size != 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be divisible by "
                                 f"tensor_model_parallel_size ({tp_size})")
        if self.ffn_hidden_size % tp_size != 0:
            raise ValueError(f"ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                             f"tensor_model_parallel_size ({tp_size})")

    def padded_vocab_size(self, tp_size):
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp_size)
