"""The GPT model's configuration: one dataclass, the one place each model setting lives; its
MLA, Gated DeltaNet, MoE and MTP parts are declared in mla.py, gated_delta_net.py, moe.py and
mtp.py, whose classes it inherits.

Every field carries its help, its Megatron-LM flag (name and default) and whether it shapes
saved weights (:func:`megatron_cp.config.setting.setting`); its rules live in ``__post_init__``,
:meth:`GPTConfig.validate_parallel` and :meth:`GPTConfig.check_positions`. The command line,
the config built from it and the checkpoint resume check are derived from the fields, so a
new hyper-parameter is one new field.
"""
import dataclasses
import math
from dataclasses import dataclass

import torch

from megatron_cp.config.activation_memory import ActivationMemorySettings
from megatron_cp.config.fp8 import Fp8Settings
from megatron_cp.config.gated_delta_net import GatedDeltaNetSettings
from megatron_cp.config.mla import MLASettings
from megatron_cp.config.moe import MoESettings
from megatron_cp.config.mtp import MTPSettings
from megatron_cp.config.mup import resolve_mup
from megatron_cp.config.parallel import (COMM_TYPE_ALIASES, COMM_TYPES, check_hierarchical_sizes,
                                         resolve_comm_type)
from megatron_cp.config.setting import check_choices, resolve, setting


# Megatron-LM's position embedding types that are not built, and why (one line each)
NOT_BUILT_POSITIONS = {
    "mrope": "multimodal rotary (Qwen2-VL's temporal, height and width sections) rotates by the "
             "3-D position ids of a vision-language model, which token data has none of; use "
             "rope",
    "relative": "T5's relative attention bias, which Megatron-LM's GPT model does not build (it "
                "trains without positions there); use none for that, or rope",
}
KERNEL_NAMES = ("auto", "torch")  # --attention-kernel: auto picks per device and shape
# torch.compile's modes; the last two capture CUDA graphs (refused in GPTConfig.__post_init__)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")


def pad_vocab_size(vocab_size, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1):
    """Megatron's padding: round the vocab up to a multiple of divisible_by x TP."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(kw_only=True, frozen=True)
class GPTConfig(MLASettings, GatedDeltaNetSettings, MoESettings, MTPSettings,
                ActivationMemorySettings, Fp8Settings):
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
    position_embedding_type: str = setting(
        "rope", cli_default="learned_absolute", shapes=True,
        choices=("rope", "yarn", "learned_absolute", "none") + tuple(NOT_BUILT_POSITIONS),
        help="Position embedding type: rope (rotary), yarn (rotary with YaRN's frequencies for "
             "a context --rotary-scaling-factor times the original one), learned_absolute, or "
             "none (NoPE: no position table and no rotation; only the causal mask orders the "
             "tokens). Megatron-LM's mrope and relative are refused.")
    rotary_base: float = setting(10000.0, help="RoPE base frequency.")
    rotary_percent: float = setting(1.0, help="Fraction of head dims rotated.")
    rotary_interleaved: bool = setting(
        False, shapes=True, help="Rotate the interleaved channel pairs (0, 1), (2, 3), ... of "
        "each head (RoFormer, GPT-J) instead of the pairs (i, i + d/2) of its two halves.")
    # Llama 3.1's scaling and position interpolation (position_embedding_type rope)
    use_rope_scaling: bool = setting(
        False, help="Llama 3.1's RoPE scaling: the frequencies slower than 8192 positions per "
        "turn are divided by --rope-scaling-factor, those faster than 2048 kept, and those in "
        "between blended (Hugging Face's llama3 rope type).")
    rope_scaling_factor: float = setting(
        8.0, help="Llama 3.1's RoPE scaling factor (with --use-rope-scaling).")
    rotary_seq_len_interpolation_factor: int | None = setting(
        None, help="Position interpolation: every position p turns by the angles of p / this "
        "factor (plain rope only).")
    # YaRN (position_embedding_type yarn); Megatron-LM's flags and defaults
    rotary_scaling_factor: float = setting(
        1.0, help="YaRN: how many times longer the context is than the original one; the "
        "slowly turning rotary frequencies are divided by it.")
    yarn_original_max_position_embeddings: int = setting(
        4096, cli_default=None, help="YaRN: the context length before scaling (default 4096).")
    yarn_beta_fast: float = setting(
        32.0, cli_default=None, help="YaRN: channel pairs that turn at least this many times "
        "over the original context keep their frequency (default 32) ...")
    yarn_beta_slow: float = setting(
        1.0, cli_default=None, help="... those that turn at most this many times are divided "
        "by the factor, with a linear ramp in between (default 1).")
    yarn_correction_range_round_to_int: bool = setting(
        True, flag="--no-yarn-correction-range-round-to-int",
        help="YaRN: do not round the ramp's ends to whole channel pairs (rounded by default).")
    mscale: float = setting(
        1.0, help="YaRN: cos and sin are multiplied by (0.1 mscale ln(factor) + 1) / "
        "(0.1 mscale_all_dim ln(factor) + 1), so the attention logits by its square.")
    mscale_all_dim: float = setting(0.0, help="YaRN: see --mscale.")
    normalization: str = setting("LayerNorm", choices=("LayerNorm", "RMSNorm"), shapes=True,
                                 help="Normalization layer type.")
    norm_epsilon: float = setting(1e-5, help="Epsilon of the norms.")
    layernorm_zero_centered_gamma: bool = setting(
        False, flag="--apply-layernorm-1p", shapes=True,
        help="Zero-centred norm weights: every norm (LayerNorm or RMSNorm) stores w, starting "
             "at 0, and scales by 1 + w.")
    qk_layernorm: bool = setting(
        False, shapes=True, help="Normalise each head of the queries and keys (before rotary) "
             "with a norm of the --normalization kind over the head dim, one weight for all "
             "heads.")
    activation: str = setting("gelu", flag="--swiglu", when_set="swiglu", shapes=True,
                              choices=("gelu", "gelu_tanh", "swiglu", "squared_relu"),
                              help="Use the SwiGLU activation in the MLP (default GeLU).")
    squared_relu: bool = setting(False, shapes=True,
                                 help="Use the squared ReLU activation, relu(x)^2, in the MLP "
                                      "(default GeLU; not with --swiglu).")
    bias_gelu_fusion: bool = setting(
        False, flag="--no-bias-gelu-fusion", arg="bias_gelu_fusion", store_false=True,
        fill_arg=True,
        help="Do not fuse fc1's bias with the GELU, so the MLP computes the exact (erf) GELU. "
        "Megatron-LM's fusion (on by default with biases; off with --disable-bias-linear) "
        "computes GELU with the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 "
        "x^3))), in the dense MLP and the MTP layers; it refuses --squared-relu and MoE "
        "experts, which it has no fused kernel for. A config built in Python defaults to "
        "megatron-core's TransformerConfig (no fusion, erf GELU).")
    add_bias_linear: bool = setting(True, flag="--disable-bias-linear", shapes=True,
                                    help="No biases in linear layers.")
    hidden_dropout: float = setting(0.1, help="Dropout on hidden states.")
    attention_dropout: float = setting(
        0.1, help="Dropout on attention probs. Its mask follows each element's place in the run "
                  "(seed, layer, sample, global head, query and key position), so every "
                  "parallel layout drops the same elements; in training it runs the plain "
                  "PyTorch attention path (fused kernels take no external mask).")
    untie_embeddings_and_output_weights: bool = setting(
        False, shapes=True, help="Separate input embedding and output layer weights.")
    make_vocab_size_divisible_by: int = setting(
        128, shapes=True, help="Pad the vocab to a multiple of this times the TP size.")
    init_method_std: float = setting(0.02, help="Std of the normal weight init.")
    init_model_with_meta_device: bool = setting(
        False, help="Build the model on the meta device, then draw each weight where it lives, "
        "one at a time (its full tensor from its seed, this rank's shard kept, the full tensor "
        "freed): the weights of the default build, bit for bit; under FSDP a rank then never "
        "holds more than its shards and one full weight.")
    # Maximal Update Parameterization (model/mup.py). Megatron-LM's flags and defaults.
    use_mup: bool = setting(
        False, help="Maximal Update Parameterization: hidden weights start at std / "
        "sqrt(width_mult) (output projections also / sqrt(2 num_layers)), Adam's hidden "
        "matrices get lr, min_lr and eps / width_mult, the embedding output is multiplied by "
        "--mup-embedding-mult, the logits by --mup-output-mult, and attention scores by "
        "sqrt(--mup-base-head-dim) / kv_channels^--mup-attn-scale-power.")
    mup_width_mult: float = setting(
        1.0, fill_arg=True, help="muP width multiplier; --use-mup computes it as hidden_size / "
        "--mup-base-hidden-size (a given value must agree).")
    mup_base_hidden_size: int | None = setting(
        None, help="muP: the base (proxy) model's hidden size (default: hidden_size, "
        "width_mult 1).")
    mup_embedding_mult: float = setting(1.0, help="muP: multiplier of the embedding output.")
    mup_output_mult: float = setting(
        1.0, help="muP: multiplier of the logits; left at 1 it becomes 1 / width_mult.")
    mup_base_head_dim: float | None = setting(
        None, help="muP: the base head dim; the attention scale is sqrt(this) / "
        "kv_channels^power (default: 1 / kv_channels^power).")
    mup_attn_scale_power: float = setting(
        1.0, help="muP: the power of kv_channels in the attention scale (1: 1/d, 0.5: the "
        "standard 1/sqrt(d)).")
    softmax_scale: float | None = setting(
        None, flag=None, help="Attention score scale (None: 1 / sqrt(kv_channels)); --use-mup "
        "sets it.")
    seed: int = setting(1234, group="training", help="Random seed (init, data, dropout).")
    params_dtype: torch.dtype = setting(torch.float32, flag=None, arg="params_dtype", shapes=True,
                                        help="Parameter dtype (from --fp16 / --bf16).")
    sequence_parallel: bool = setting(False, group="parallelism",
                                      help="Megatron sequence parallelism (with TP).")
    # TP communication overlapped with the linear layers' GEMMs (tensor_parallel/overlap.py).
    # Megatron-LM's flags and defaults; the sub-flags matter only with tp_comm_overlap.
    tp_comm_overlap: bool = setting(
        False, group="parallelism",
        help="Overlap the sequence-parallel all-gather and reduce-scatter of the column- and "
             "row-parallel linears with their GEMMs: the sequence chunks (or the partial sums) "
             "travel around the TP ring while the GEMM of the chunk in hand runs. Needs "
             "--sequence-parallel (so TP > 1).")
    tp_comm_overlap_ag: bool = setting(
        True, flag="--no-tp-comm-overlap-ag", aliases=("--disable-tp-comm-overlap-ag",),
        group="parallelism",
        help="With --tp-comm-overlap: gather plainly instead of through the ring (the "
             "column-parallel forward's input, the row-parallel backward's output gradient).")
    tp_comm_overlap_rs: bool = setting(
        True, flag="--no-tp-comm-overlap-rs", aliases=("--disable-tp-comm-overlap-rs",),
        group="parallelism",
        help="With --tp-comm-overlap: reduce-scatter the row-parallel output plainly instead "
             "of through the ring.")
    tp_comm_overlap_rs_dgrad: bool = setting(
        False, group="parallelism",
        help="With --tp-comm-overlap: reduce-scatter the column-parallel input gradient "
             "through the ring, pipelined with the chunks of its GEMM (the bulk overlaps of "
             "--tp-comm-bulk-dgrad / -wgrad then do not apply).")
    tp_comm_bulk_dgrad: bool = setting(
        True, flag="--no-tp-comm-bulk-dgrad", aliases=("--disable-tp-comm-bulk-dgrad",),
        group="parallelism",
        help="With --tp-comm-overlap: the column-parallel linear keeps only its sequence chunk "
             "of the input for backward and re-gathers it while the input-gradient GEMM runs; "
             "off: it keeps the gathered input.")
    tp_comm_bulk_wgrad: bool = setting(
        True, flag="--no-tp-comm-bulk-wgrad", aliases=("--disable-tp-comm-bulk-wgrad",),
        group="parallelism",
        help="With --tp-comm-overlap: the column-parallel input gradient's reduce-scatter "
             "runs while the weight-gradient GEMM runs; off: before it.")
    recompute_granularity: str | None = setting(None, choices=(None, "full", "selective"),
                                                group="training",
                                                help="Activation recomputation granularity.")
    recompute_method: str | None = setting(None, choices=(None, "uniform", "block"), group="training",
                                           help="Which layers to recompute with full granularity.")
    recompute_num_layers: int | None = setting(
        None, group="training",
        help="Layers per recompute chunk (uniform) or recomputed layers (block).")
    tiled_logits_chunk_size: int = setting(
        0, group="training",
        help="Compute the output layer and the cross-entropy loss this many sequence positions "
             "at a time, forward and backward (the chunk's logits are recomputed in backward), "
             "so the [s, b, vocab/tp] logits never exist at once: the loss path then holds "
             "about chunk x b x vocab/tp x 4 bytes x 3 instead of s x b x vocab/tp x 4 x 2 or "
             "more. The loss and gradients are the untiled ones. 0: off (the logits are "
             "formed whole, as Megatron-LM does).")
    mlp_chunks_for_training: int = setting(
        1, group="training",
        help="Run each dense MLP over this many chunks of the sequence in training "
             "(Megatron-LM's chunking: torch.chunk along s into min(N, s) pieces). Unlike "
             "Megatron-LM, each chunk is recomputed in backward, so only one chunk's "
             "[s/N, b, ffn/tp] intermediates exist at a time (a tiled MLP); the result is the "
             "same. 1: one piece. Dense layers only: an MoE layer routes with capacity and "
             "balancing losses over all of its tokens at once.")
    cpu_offloading_num_layers: int = setting(
        0, group="training",
        help="Keep the activations the first N transformer layers save for backward in host "
             "memory (pinned, copied on a side stream) until backward needs them (Megatron-LM's "
             "flag). On a GPU only: on a CPU they already live in host memory and a note says "
             "so. Unlike Megatron-LM it combines with pipeline parallelism and with full "
             "recomputation, where what moves is each recomputed layer's input (its checkpoint).")
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
    cp_comm_type: str | tuple[str, ...] = setting(
        "p2p", cli_default=("p2p",), nargs="+", group="parallelism",
        help="Context-parallel attention communication: p2p (ring), a2a (Ulysses), a2a+p2p "
             "(both, with --hierarchical-context-parallel-sizes), all_gather (Megatron-LM's "
             "help spells it allgather) or auto; one type for every layer, or one per layer "
             "(--num-layers types, e.g. p2p p2p a2a a2a).")
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = setting(
        None, group="parallelism", help="Inner (a2a) and outer (p2p) CP sizes for a2a+p2p.")
    allow_dummy_heads: bool = setting(True, flag="--no-cp-dummy-heads", group="parallelism",
                                      help="Refuse Ulysses padding with dummy heads when "
                                           "heads % CP != 0.")
    attention_output_gate: bool = setting(
        False, shapes=True, help="Gate each full-attention head's output by sigmoid(x W_g) "
        "before the output projection (Qwen3-Next); W_g's rows join each query group's rows "
        "of the QKV projection: [q heads | gate heads | k | v].")
    extra: dict = setting(default_factory=dict, flag=None,
                          help="Free-form settings for experiments; not on the command line.")

    def __post_init__(self):
        self._resolve_balancing_lists()
        self._resolve_cp_comm_type()
        check_choices(self)
        if self.position_embedding_type in NOT_BUILT_POSITIONS:
            raise ValueError(f"position_embedding_type {self.position_embedding_type}: "
                             f"{NOT_BUILT_POSITIONS[self.position_embedding_type]}")
        if self.squared_relu:
            if self.activation == "swiglu":
                raise ValueError("squared_relu (True) and activation ('swiglu') are two MLP "
                                 "activations; give one")
            resolve(self, activation="squared_relu")
        resolve(self, squared_relu=self.activation == "squared_relu")
        self._resolve_gelu()
        self._check_mla()
        self._check_rotary()
        if self.ffn_hidden_size is None:
            resolve(self, ffn_hidden_size=4 * self.hidden_size)
        if self.num_query_groups is None:
            resolve(self, num_query_groups=self.num_attention_heads)
        if not 0.0 <= self.attention_dropout <= 1.0:
            raise ValueError(f"attention_dropout ({self.attention_dropout}) is a probability: "
                             f"give a value from 0 to 1")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                                 f"num_attention_heads ({self.num_attention_heads}), or set kv_channels")
            resolve(self, kv_channels=self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_query_groups ({self.num_query_groups})")
        if self.torch_compile_mode in ("reduce-overhead", "max-autotune"):
            mode = self.torch_compile_mode
            raise ValueError(f"torch_compile_mode ({mode!r}) captures CUDA graphs, which replay "
                             f"fixed buffers while pipeline schedules keep several microbatches "
                             f"in flight and recomputation reruns layers in backward; use "
                             f"torch_compile_mode 'default' or 'max-autotune-no-cudagraphs'")
        resolve_mup(self)
        if self.num_moe_experts:
            self._check_moe()
        self._check_linear_attention()
        if self.tiled_logits_chunk_size < 0:
            raise ValueError(f"tiled_logits_chunk_size ({self.tiled_logits_chunk_size}) must be "
                             f">= 0 (0: the output layer and loss are not tiled)")
        if self.tiled_logits_chunk_size and self.use_mup and self.mup_output_mult != 1.0:
            raise ValueError(f"tiled_logits_chunk_size ({self.tiled_logits_chunk_size}) does not "
                             f"apply muP's output multiplier ({self.mup_output_mult:g}); drop "
                             f"--tiled-logits-chunk-size with --use-mup")
        if not 0 <= self.cpu_offloading_num_layers < self.num_layers:
            raise ValueError(f"cpu_offloading_num_layers ({self.cpu_offloading_num_layers}) must "
                             f"be from 0 to num_layers - 1 ({self.num_layers - 1}): the last "
                             f"layer's activations are needed first in backward (Megatron-LM's "
                             f"rule)")
        if self.mlp_chunks_for_training < 1:
            raise ValueError(f"mlp_chunks_for_training ({self.mlp_chunks_for_training}) must be "
                             f">= 1 (1: the MLP runs on the whole sequence)")
        if self.mlp_chunks_for_training > 1 and any(self.moe_layer_pattern()):
            raise ValueError(f"mlp_chunks_for_training ({self.mlp_chunks_for_training}) chunks "
                             f"dense MLPs only: an MoE layer's capacity and balancing losses "
                             f"count all of its tokens at once, which chunks would change; "
                             f"drop mlp_chunks_for_training or the MoE layers")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("tp_comm_overlap (True) overlaps the sequence-parallel all-gather "
                             "and reduce-scatter with the GEMMs: add sequence_parallel (with "
                             "tensor_model_parallel_size > 1) or drop tp_comm_overlap")
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_granularity 'full' needs recompute_method uniform or block "
                             f"(got {self.recompute_method!r})")
        # Megatron-LM's rules (its TransformerConfig): full recomputation names its layers,
        # selective recomputation has none to name
        if self.recompute_granularity == "full" and not (self.recompute_num_layers or 0) >= 1:
            raise ValueError(f"recompute_granularity 'full' needs recompute_num_layers >= 1 (got "
                             f"{self.recompute_num_layers}): the layers per recomputed chunk "
                             f"(uniform) or the recomputed layers of each stage (block)")
        if self.recompute_granularity == "selective" and self.recompute_num_layers is not None:
            raise ValueError(f"recompute_num_layers ({self.recompute_num_layers}) applies to "
                             f"recompute_granularity 'full' only; drop it with 'selective'")
        self._check_activation_memory()
        self.check_fp8()

    @property
    def hidden_init_std(self):
        """The init std of hidden weights: init_method_std, divided by sqrt(mup_width_mult)
        under muP (model/mup.py); the embeddings and an untied output layer keep
        init_method_std."""
        return self.init_method_std / math.sqrt(self.mup_width_mult) if self.use_mup \
            else self.init_method_std

    def _resolve_gelu(self):
        """Megatron-LM's GELU: the bias-GELU fusion (``bias_gelu_impl``) computes the tanh
        approximation, the unfused path ``F.gelu`` (erf); its fusion is off without biases and
        refuses an activation or an MoE expert it has no fused kernel for."""
        if not self.add_bias_linear:
            resolve(self, bias_gelu_fusion=False)  # Megatron-LM turns it off silently, so do we
        if not self.bias_gelu_fusion or self.activation not in ("gelu", "gelu_tanh"):
            if self.bias_gelu_fusion and self.activation == "squared_relu":
                raise ValueError("--squared-relu with biases meets Megatron-LM's bias-GELU fusion "
                                 "(on by default), which refuses any activation but GELU: add "
                                 "--no-bias-gelu-fusion or --disable-bias-linear")
            return
        if self.num_moe_experts:
            raise ValueError(f"--num-experts {self.num_moe_experts} with GELU and biases meets "
                             f"Megatron-LM's bias-GELU fusion (on by default), which has no "
                             f"kernel for the routed experts and stops at their first forward: "
                             f"add --no-bias-gelu-fusion (exact GELU), --disable-bias-linear or "
                             f"--swiglu")
        resolve(self, activation="gelu_tanh")

    def _check_rotary(self):
        """YaRN's settings mean something with position_embedding_type yarn only, and YaRN
        rotates whole heads in halves (Megatron-LM's YarnRotaryEmbedding); Llama 3.1's
        scaling and position interpolation with the model's own plain RoPE only (Megatron-LM's
        GPT model gives them to its RotaryEmbedding, never to YaRN's or MLA's)."""
        self._check_rope_scaling()
        yarn = ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
                "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int",
                "mscale", "mscale_all_dim")
        if self.multi_latent_attention:  # MLA's own YaRN takes these three (_check_mla)
            yarn = tuple(n for n in yarn if n not in ("rotary_scaling_factor", "mscale",
                                                      "mscale_all_dim"))
        if self.position_embedding_type != "yarn":
            given = [f"{f.name} ({getattr(self, f.name)})" for f in dataclasses.fields(self)
                     if f.name in yarn and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} "
                                 f"only to position_embedding_type yarn (the model has "
                                 f"{self.position_embedding_type}); add position_embedding_type "
                                 f"yarn or drop {'them' if len(given) > 1 else 'it'}")
            return
        given = [f"{name} ({getattr(self, name)})" for name, plain in
                 (("rotary_percent", 1.0), ("rotary_interleaved", False))
                 if getattr(self, name) != plain]
        if given:
            raise ValueError(f"position_embedding_type yarn rotates every channel of a head in "
                             f"halves, as Megatron-LM's YaRN does: drop {' and '.join(given)}")
        for name in ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
                     "yarn_beta_fast", "yarn_beta_slow"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")

    def _check_rope_scaling(self):
        given = [f"{name} ({getattr(self, name)})" for name, plain in
                 (("use_rope_scaling", False), ("rotary_seq_len_interpolation_factor", None))
                 if getattr(self, name) != plain]
        if not self.use_rope_scaling and self.rope_scaling_factor != 8.0:
            raise ValueError(f"rope_scaling_factor ({self.rope_scaling_factor}) applies only "
                             f"with use_rope_scaling; add use_rope_scaling or drop it")
        if given and (self.position_embedding_type != "rope" or self.multi_latent_attention):
            rope = "multi-latent attention's" if self.multi_latent_attention else \
                f"position_embedding_type {self.position_embedding_type}"
            raise ValueError(f"{' and '.join(given)} {'scale' if len(given) > 1 else 'scales'} "
                             f"the plain RoPE of "
                             f"position_embedding_type rope, not {rope}; use "
                             f"position_embedding_type rope or drop {'them' if len(given) > 1 else 'it'}")
        if not self.rope_scaling_factor > 0:
            raise ValueError(f"rope_scaling_factor ({self.rope_scaling_factor}) must be positive")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and not factor > 0:
            raise ValueError(f"rotary_seq_len_interpolation_factor ({factor}) must be positive "
                             f"(positions are divided by it)")

    def _resolve_cp_comm_type(self):
        """Megatron-LM's --cp-comm-type: one type for every layer, or a list of one per layer
        (a one-entry list is the one type); allgather, as Megatron-LM's help spells it, is
        all_gather."""
        value = self.cp_comm_type
        types = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        types = tuple(COMM_TYPE_ALIASES.get(t, t) for t in types)
        for entry in types:
            if entry not in COMM_TYPES:
                raise ValueError(f"cp_comm_type ({entry}) is not a context-parallel "
                                 f"communication type; give p2p, a2a, a2a+p2p, all_gather "
                                 f"(allgather) or auto, once for every layer or once per layer")
        resolve(self, cp_comm_type=types[0] if len(types) == 1 else types)

    def cp_comm_types(self):
        """The CP comm types as a tuple: one entry for every layer, or one per layer."""
        value = self.cp_comm_type
        return value if isinstance(value, tuple) else (value,)

    def layer_cp_comm_type(self, layer_number):
        """The CP comm type of global layer ``layer_number`` (from 0): the one type, or the
        layer's entry of the per-layer list. MTP depth d's layer (numbered num_layers + d)
        takes entry d, as in Megatron-LM, which numbers the MTP layers from 1 again."""
        types = self.cp_comm_types()
        if len(types) == 1:
            return types[0]
        return types[layer_number if layer_number < self.num_layers else
                     layer_number - self.num_layers]

    def hierarchical_cp_sizes(self, tp_size, cp_size):
        """The (U, R) of the a2a+p2p sub-groups that the layers' comm types resolve to under
        ``tp_size`` x ``cp_size`` ("auto" included), or None when no layer needs them; the
        trainer builds these groups. ValueError when two layers need different sizes."""
        needed = {resolve_comm_type(t, self.num_query_groups // tp_size, cp_size,
                                    self.hierarchical_context_parallel_sizes)[1]
                  for t in self.cp_comm_types()} - {None}
        if len(needed) > 1:
            raise ValueError(f"cp_comm_type ({' '.join(self.cp_comm_types())}) needs a2a+p2p "
                             f"sub-groups of two sizes {sorted(needed)} (auto picks U = "
                             f"gcd(num_query_groups / TP, CP)); use one (U, R) for every "
                             f"a2a+p2p layer: hierarchical_context_parallel_sizes "
                             f"{' '.join(map(str, min(needed)))} or no auto")
        return needed.pop() if needed else None

    def validate_parallel(self, tp_size, cp_size=None):
        """Raise ValueError unless the model splits over ``tp_size`` tensor-parallel ranks and
        (when ``cp_size`` is given) runs under ``cp_size`` context-parallel ranks."""
        if self.tp_comm_overlap and tp_size == 1:
            raise ValueError("tp_comm_overlap (True) overlaps tensor-parallel communication, "
                             "and tensor_model_parallel_size is 1: give "
                             "tensor_model_parallel_size > 1 with sequence_parallel, or drop "
                             "tp_comm_overlap")
        self.check_distributed_activations(tp_size)
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(self, name) % tp_size != 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be divisible by "
                                 f"tensor_model_parallel_size ({tp_size})")
        if self.experimental_attention_variant is not None:
            for name in ("linear_num_key_heads", "linear_num_value_heads"):
                if getattr(self, name) % tp_size:
                    raise ValueError(f"{name} ({getattr(self, name)}) must be divisible by "
                                     f"tensor_model_parallel_size ({tp_size}): TP splits the "
                                     f"Gated DeltaNet heads")
        if cp_size is None:
            return
        types = self.cp_comm_types()
        if cp_size > 1 and len(types) > 1 and len(types) != self.num_layers:
            raise ValueError(f"cp_comm_type ({' '.join(types)}) lists {len(types)} types, and a "
                             f"per-layer list needs one per layer: num_layers ({self.num_layers}) "
                             f"(Megatron-LM's rule); give {self.num_layers} types, or one for "
                             f"every layer")
        if self.hierarchical_context_parallel_sizes is not None:
            check_hierarchical_sizes(self.hierarchical_context_parallel_sizes, cp_size)
        elif "a2a+p2p" in types and cp_size > 1:
            raise ValueError(f"cp_comm_type a2a+p2p needs hierarchical_context_parallel_sizes U R "
                             f"with U x R = context_parallel_size ({cp_size})")
        if cp_size > 1:
            self.hierarchical_cp_sizes(tp_size, cp_size)
        if self.experimental_attention_variant is not None and cp_size > 1:
            pattern = self.linear_attention_pattern()
            mtp = [self.num_layers + d for d in range(self.mtp_num_layers or 0)] \
                if pattern[-1] else []  # MTP layers take the last layer's kind
            for number in [n for n, gdn in enumerate(pattern) if gdn] + mtp:
                self.gdn_cp_comm_type(tp_size, cp_size, number)

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
