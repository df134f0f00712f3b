"""The GPT model's configuration: one dataclass, the one place each model setting lives.

Every field carries its help, its Megatron-LM flag (name and default) and whether it shapes
saved weights (:func:`megatron_cp.config_flags.setting`); its rules live in ``__post_init__``,
:meth:`GPTConfig.validate_parallel` and :meth:`GPTConfig.check_positions`. The command line,
the config built from it and the checkpoint resume check are derived from the fields, so a
new hyper-parameter is one new field.
"""
import math
from dataclasses import dataclass

import torch

from megatron_cp.config_flags import check_choices, setting
from megatron_cp.context_parallel.attention import COMM_TYPES
from megatron_cp.context_parallel.kernels import KERNEL_NAMES
from megatron_cp.initialize import check_hierarchical_sizes


# torch.compile's modes; the last two capture CUDA graphs (refused in GPTConfig.__post_init__)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")


def pad_vocab_size(vocab_size, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1):
    """Megatron's padding: round the vocab up to a multiple of divisible_by x TP."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass
class GPTConfig:
    """Everything that shapes the GPT model. Sizes follow Megatron-LM's argument names."""
    num_layers: int = setting(help="Number of transformer layers.", shapes=True)
    hidden_size: int = setting(help="Transformer hidden size.", shapes=True)
    num_attention_heads: int = setting(help="Number of attention heads.", shapes=True)
    vocab_size: int = setting(flag=None, help="Vocabulary size before padding; it comes from the "
                              "tokenizer (--vocab-size only sizes NullTokenizer).")
    ffn_hidden_size: int | None = setting(None, help="MLP hidden size (default 4 x hidden size).",
                                          shapes=True, fill_arg=True)
    num_query_groups: int | None = setting(
        None, cli_default=1, shapes=True, fill_arg=True,
        gate=("--group-query-attention", "Use grouped-query attention."),
        help="Number of KV head groups with --group-query-attention (default: one per head).")
    kv_channels: int | None = setting(None, shapes=True,
                                      help="Per-head dimension (default hidden size / heads).")
    max_position_embeddings: int = setting(2048, cli_default=None, shapes=True,
                                           help="Size of the position table (default --seq-length).")
    position_embedding_type: str = setting("rope", cli_default="learned_absolute", shapes=True,
                                           choices=("rope", "learned_absolute"),
                                           help="Position embedding type.")
    rotary_base: float = setting(10000.0, help="RoPE base frequency.")
    rotary_percent: float = setting(1.0, help="Fraction of head dims rotated.")
    normalization: str = setting("LayerNorm", choices=("LayerNorm", "RMSNorm"), shapes=True,
                                 help="Normalization layer type.")
    norm_epsilon: float = setting(1e-5, help="Epsilon of the norms.")
    activation: str = setting("gelu", flag="--swiglu", when_set="swiglu", shapes=True,
                              choices=("gelu", "swiglu"),
                              help="Use the SwiGLU activation in the MLP (default GeLU).")
    add_bias_linear: bool = setting(True, flag="--disable-bias-linear", shapes=True,
                                    help="No biases in linear layers.")
    hidden_dropout: float = setting(0.1, help="Dropout on hidden states.")
    attention_dropout: float = setting(0.1, help="Dropout on attention probs.")
    untie_embeddings_and_output_weights: bool = setting(
        False, shapes=True, help="Separate input embedding and output layer weights.")
    make_vocab_size_divisible_by: int = setting(
        128, shapes=True, help="Pad the vocab to a multiple of this times the TP size.")
    init_method_std: float = setting(0.02, help="Std of the normal weight init.")
    seed: int = setting(1234, group="training", help="Random seed (init, data, dropout).")
    params_dtype: torch.dtype = setting(torch.float32, flag=None, arg="params_dtype", shapes=True,
                                        help="Parameter dtype (from --fp16 / --bf16).")
    sequence_parallel: bool = setting(False, group="parallelism",
                                      help="Megatron sequence parallelism (with TP).")
    recompute_granularity: str | None = setting(None, choices=(None, "full", "selective"),
                                                group="training",
                                                help="Activation recomputation granularity.")
    recompute_method: str | None = setting(None, choices=(None, "uniform", "block"), group="training",
                                           help="Which layers to recompute with full granularity.")
    recompute_num_layers: int | None = setting(
        None, cli_default=1, group="training",
        help="Layers per recompute chunk (uniform) or recomputed layers (block).")
    torch_compile: bool = setting(
        False, group="training",
        help="Compile each transformer layer with torch.compile (TorchInductor: fused "
             "elementwise kernels for norms, rotary, SwiGLU, residuals). Core attention stays "
             "eager (one fused kernel either way; context-parallel communication runs as in "
             "eager mode). The first iterations pay the compile time.")
    torch_compile_mode: str = setting(
        "default", choices=COMPILE_MODES, group="training",
        help="torch.compile mode with --torch-compile: default, or max-autotune-no-cudagraphs "
             "(autotuned kernels, longer compile). The CUDA-graph modes (reduce-overhead, "
             "max-autotune) are refused: pipeline schedules keep several forwards in flight "
             "and full recomputation reruns a layer inside backward.")
    attention_kernel: str = setting(
        "auto", choices=KERNEL_NAMES, group="training",
        help="Attention kernels: auto (the device's fused kernels: PyTorch flash / flash "
             "varlen for packed documents on CUDA, the CPU flash kernel on CPU) or torch "
             "(plain PyTorch, scores materialised per block: a second opinion for debugging).")
    cp_comm_type: str = setting("p2p", choices=COMM_TYPES, group="parallelism",
                                help="Context-parallel attention communication.")
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = setting(
        None, group="parallelism", help="Inner (a2a) and outer (p2p) CP sizes for a2a+p2p.")
    allow_dummy_heads: bool = setting(True, flag="--no-cp-dummy-heads", group="parallelism",
                                      help="Refuse Ulysses padding with dummy heads when "
                                           "heads % CP != 0.")
    # MoE (built by the moe package; 0 experts = dense MLP everywhere)
    num_moe_experts: int = setting(0, flag="--num-experts", cli_default=None, shapes=True,
                                   help="Number of MoE experts.")
    extra: dict = setting(default_factory=dict, flag=None,
                          help="Free-form settings for experiments; not on the command line.")

    def __post_init__(self):
        check_choices(self)
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                                 f"num_attention_heads ({self.num_attention_heads}), or set kv_channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_query_groups ({self.num_query_groups})")
        if self.torch_compile_mode in ("reduce-overhead", "max-autotune"):
            mode = self.torch_compile_mode
            raise ValueError(f"torch_compile_mode ({mode!r}) captures CUDA graphs, which replay "
                             f"fixed buffers while pipeline schedules keep several microbatches "
                             f"in flight and recomputation reruns layers in backward; use "
                             f"torch_compile_mode 'default' or 'max-autotune-no-cudagraphs'")
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_granularity 'full' needs recompute_method uniform or block "
                             f"(got {self.recompute_method!r})")

    def validate_parallel(self, tp_size, cp_size=None):
        """Raise ValueError unless the model splits over ``tp_size`` tensor-parallel ranks and
        (when ``cp_size`` is given) runs under ``cp_size`` context-parallel ranks."""
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(self, name) % tp_size != 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be divisible by "
                                 f"tensor_model_parallel_size ({tp_size})")
        if cp_size is None:
            return
        if cp_size > 1 and self.attention_dropout > 0:
            raise ValueError(f"attention_dropout ({self.attention_dropout}) is not supported inside "
                             f"context-parallel attention (context_parallel_size {cp_size}); "
                             f"set attention_dropout 0")
        if self.hierarchical_context_parallel_sizes is not None:
            check_hierarchical_sizes(self.hierarchical_context_parallel_sizes, cp_size)
        elif self.cp_comm_type == "a2a+p2p" and cp_size > 1:
            raise ValueError(f"cp_comm_type a2a+p2p needs hierarchical_context_parallel_sizes U R "
                             f"with U x R = context_parallel_size ({cp_size})")

    def check_positions(self, length, length_name="seq_length"):
        """Raise ValueError if learned absolute positions have no row for a ``length``-token
        sequence (``length_name`` names it in the message)."""
        if self.position_embedding_type == "learned_absolute" and \
                self.max_position_embeddings < length:
            raise ValueError(f"max_position_embeddings ({self.max_position_embeddings}) must be at "
                             f"least {length_name} ({length}) with learned absolute positions; raise "
                             f"max_position_embeddings to at least {length} or use "
                             f"position_embedding_type rope")

    def padded_vocab_size(self, tp_size):
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp_size)
