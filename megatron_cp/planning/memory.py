"""Predicted peak tensor memory of the most loaded rank of a run, from its
:class:`~megatron_cp.config.run.RunConfig`.

Every term is read off what OUR code holds, not a paper's formula:

- **Static state** per rank: parameters of this rank's pipeline stage (TP, EP and ETP
  shards), their fp32 ``main_grad`` buffers and the optimizer state, by the per-parameter
  formula of :func:`megatron_cp.optimizer.memory.optimizer_bytes_per_param` (the distributed
  optimizer shards main params and Adam moments over DP x CP / instances; expert parameters
  over the expert-DP group; the precision-aware dtypes set their sizes); with
  ``--use-torch-fsdp2`` all of it over DP x CP, plus the params FSDP gathers (the root unit
  and one layer at a time). ``--optimizer-cpu-offload``'s host part is
  ``MemoryEstimate.host_bytes``, apart from the device total.
- **Saved activations** per layer and microbatch: the tensors autograd keeps for backward
  (:func:`layer_activation_bytes`): the norms' inputs and normalised values, each linear's
  input (all-gathered over TP under sequence parallelism, because ``ColumnParallelLinear``
  gathers before its matmul), the fused QKV output (the ``v`` view keeps it), rotated q and k,
  the attention output and log-sum-exp, the MLP's fc1 output and activation, MoE's routing
  tensors and permuted token copies. Selective recompute drops the attention output and
  log-sum-exp; full recompute keeps only each recomputed chunk's input, and backward
  rebuilds one chunk at a time.
- **Microbatches in flight**: 1 without pipelining; 1F1B stage ``r`` of ``p`` holds
  ``min(p - r, M)``; the interleaved schedule ``min(2 (p - r - 1) + (v - 1) g, M v) + 1``
  model chunks (``pipeline_parallel/interleaved.py``'s warmup count).
- **Output layer and loss** on the last stage: the logits ``[s, b, v/tp]``, the padded-vocab
  masked copy where this rank's slice holds padding, cross entropy's fp32 shifted logits
  (its saved softmax), and in backward the gradient of the logits and the output weight's
  gradient before it is added into ``main_grad``.
- **Transient of the largest backward**: the gradients a layer's backward creates while its
  saved tensors are still alive (fc1 and activation gradients, the weight gradient before
  the ``main_grad`` hook adds and frees it).
- **Communication buffers**: the pipeline's received activation and gradient, context
  parallelism's in-flight K/V blocks (ring: one being received while one is used).

- **Offloading** (``--cpu-offloading-num-layers N``, GPU only): the first N layers' saved
  tensors (under full recompute: their checkpoints' inputs) live in host memory and come
  back one layer at a time in backward. What they hold on the host, per pipeline rank, is
  :func:`offloaded_activation_bytes`. Fine-grained offloading (GPU only): the groups
  :func:`offloaded_bytes` counts live in host memory and come back one group at a time.

The peak is the largest of three moments (forward at the loss, backward at the loss,
backward of the last layer) on the stage whose sum is largest. ``device`` "gpu" assumes the
fused norms (apex / Transformer Engine: input and statistics saved); "cpu" PyTorch's
decomposed RMSNorm (input, statistics and normalised values).
"""
from dataclasses import dataclass, field, replace

import torch

from megatron_cp.context_parallel import resolve_comm_type
from megatron_cp.layers.fine_grained_offload import plan_offload
from megatron_cp.layers.gated_delta_rule import CHUNK_SIZE as GDN_CHUNK
from megatron_cp.optimizer.memory import optimizer_bytes_per_param
from megatron_cp.pipeline_parallel import layout_from_config

FP32 = 4
INT64 = 8
# Per token of every microbatch read up front: tokens, labels, position ids and token index
# (int64) and the fp32 loss mask (data/batch.py's microbatch fields).
BATCH_BYTES_PER_TOKEN = 4 * INT64 + FP32
CPU_RNG_STATE = torch.get_rng_state().numel()  # bytes of the CPU generator's state


@dataclass
class MemoryEstimate:
    """Predicted peak tensor bytes of the most loaded rank (``pp_rank``'s stage) and its
    parts (bytes): params, grads, optimizer, activations, loss, transient, buffers, batch;
    ``host_bytes``: what that rank keeps in host memory (the offloaded optimizer part,
    :func:`~megatron_cp.optimizer.memory.optimizer_bytes_per_param`, and on a GPU the
    activations of :func:`offloaded_bytes` per microbatch in flight), not in ``total_bytes``."""
    total_bytes: int
    pp_rank: int
    parts: dict = field(default_factory=dict)
    host_bytes: int = 0  # host memory of that rank (see above)


def tokenizer_vocab_size(data):
    """The vocabulary size of the tokenizer that the data section ``data`` (a
    :class:`~megatron_cp.config.data.DataConfig`) names, as the trainer builds it: the
    ``vocab_size`` a :class:`~megatron_cp.config.run.RunConfig` is built with (NullTokenizer's
    is --vocab-size + 1, its end-of-document token; the output layer's padding follows)."""
    from megatron_cp.data import tokenizer_from_config
    try:
        return tokenizer_from_config(data).vocab_size
    except (ValueError, OSError) as error:
        raise ValueError(f"the memory model needs the vocabulary size and could not build the "
                         f"tokenizer ({error}); pass the tokenizer's files or --vocab-size with "
                         f"--tokenizer-type NullTokenizer") from None


# ----- parameters ----------------------------------------------------------------------
def _mlp_params(h, ffn, swiglu, bias):
    return h * ffn * (3 if swiglu else 2) + (ffn * (2 if swiglu else 1) + h if bias else 0)


def layer_param_counts(config, number, tp, ep, etp):
    """(dense, expert) parameters of global layer ``number`` held by one rank."""
    c = config
    h, d = c.hidden_size, c.kv_channels
    bias = c.add_bias_linear
    norms = 2 * h * (2 if c.normalization == "LayerNorm" else 1)
    if c.linear_attention_pattern()[number]:
        mixer = _gdn_params(c) // tp
    else:
        q_rows = c.num_attention_heads * d * (2 if c.attention_output_gate else 1)
        qkv_rows = q_rows + 2 * c.num_query_groups * d
        mixer = (h * qkv_rows + c.num_attention_heads * d * h) // tp
        mixer += (qkv_rows // tp + h) if bias else 0
        mixer += 2 * d if c.qk_layernorm else 0
    swiglu = c.activation == "swiglu"
    if not c.moe_layer_pattern()[number]:
        return norms + mixer + _mlp_params(h, c.ffn_hidden_size, swiglu, bias) // tp, 0
    dense = c.num_moe_experts * h  # the router
    if c.moe_shared_expert_intermediate_size:
        dense += _mlp_params(h, c.moe_shared_expert_intermediate_size, swiglu, bias) // tp
    experts = c.num_moe_experts // ep * _mlp_params(h, c.moe_ffn_hidden_size, swiglu, bias) // etp
    return norms + mixer + dense, experts


def _gdn_params(c):
    """Gated DeltaNet's projections (model/gated_delta_net.py): q/k/v/z in, the gates, the
    short convolution and the output projection, approximately (biases left out)."""
    h = c.hidden_size
    kd = c.linear_num_key_heads * c.linear_key_head_dim
    vd = c.linear_num_value_heads * c.linear_value_head_dim
    in_proj = h * (2 * kd + 2 * vd + 2 * c.linear_num_value_heads)
    conv = (2 * kd + vd) * c.linear_conv_kernel_dim
    return in_proj + conv + vd * h


def stage_param_counts(config, layout, pp_rank, tp, ep, etp):
    """(dense, expert) parameters of pipeline rank ``pp_rank``'s model chunks on one rank."""
    c = config
    dense = experts = 0
    vocab = c.padded_vocab_size(tp) // tp * c.hidden_size
    tied = not c.untie_embeddings_and_output_weights
    for chunk in range(layout.vp_size):
        for n in layout.layer_numbers(pp_rank, chunk):
            layer_dense, layer_experts = layer_param_counts(c, n, tp, ep, etp)
            dense, experts = dense + layer_dense, experts + layer_experts
        first, last = layout.has_embedding(pp_rank, chunk), layout.has_loss(pp_rank, chunk)
        if first:
            dense += vocab
            if c.position_embedding_type == "learned_absolute":
                dense += c.max_position_embeddings * c.hidden_size
        if last:
            dense += c.hidden_size * (2 if c.normalization == "LayerNorm" else 1)
            if not (tied and first):
                dense += vocab
    return dense, experts


# ----- activations ---------------------------------------------------------------------
@dataclass
class _Shapes:
    """The sizes one rank's layers see for one microbatch."""
    micro_batch: int  # b
    tokens: int  # b x s / cp: the rank's tokens in attention and the MLP
    norm_tokens: int  # the tokens of the residual stream (/ tp under sequence parallelism)
    tp: int
    cp: int
    cp_comms: tuple | None  # each layer's resolved CP comm type (None without CP)
    act: int  # bytes per activation element (the params dtype)
    fused_norm: bool  # device norms save input and statistics only
    offloaded: int = 0  # layers [0, N) keep their saved tensors in host memory (GPU)
    fine_offload: bool = False  # --fine-grained-activation-offloading moves its groups (GPU)


def _checkpoint_bytes(sh):
    """What one checkpoint (random.checkpoint) keeps besides its inputs: the default
    generator's state and the RNG tracker's snapshot; host memory on a GPU, CPU generator
    states (CPU_RNG_STATE bytes each) on a CPU."""
    return 0 if sh.fused_norm else 2 * CPU_RNG_STATE


def _norm_bytes(sh, h, normalization, rebuilt=False):
    """A norm's saved tensors over ``norm_tokens`` tokens (its output is saved by the next
    linear and counted there). ``rebuilt`` (--recompute-modules layernorm): only its input,
    the statistics are recomputed with the output."""
    if rebuilt:
        return sh.norm_tokens * h * sh.act
    per = h * sh.act + FP32 * (2 if normalization == "LayerNorm" else 1)
    if normalization == "RMSNorm" and not sh.fused_norm:
        per += h * sh.act  # F.rms_norm's decomposition keeps x * rstd for the weight grad
    return sh.norm_tokens * per


def _attention_bytes(c, sh, selective, cp_comm):
    """Softmax attention's saved tensors per layer (norm excluded); ``cp_comm`` the layer's
    resolved CP comm type (None without CP)."""
    d, t = c.kv_channels, sh.tokens
    heads, groups = c.num_attention_heads // sh.tp, c.num_query_groups // sh.tp
    q_rows = heads * d * (2 if c.attention_output_gate else 1)
    qkv = t * (q_rows + 2 * groups * d) * sh.act  # fused output, kept alive by the v view
    linear_inputs = t * c.hidden_size * sh.act + t * heads * d * sh.act  # qkv in, proj in
    rotary = c.position_embedding_type in ("rope", "yarn")
    cos_sin = t * d * FP32 if rotary else 0  # cos and sin, d/2 each
    q = t * heads * d * sh.act  # rotated (or a contiguous copy of the strided slice)
    k = t * groups * d * sh.act if rotary else 0
    core_out = t * heads * d * sh.act + t * heads * FP32  # output and log-sum-exp
    if cp_comm in ("a2a", "a2a+p2p"):
        # Ulysses: instead of the projection's output, q, k, v after the all-to-all, twice:
        # put in token order (the zigzag chunks arrive out of order) and the inner
        # attention's contiguous copies. KV heads are repeated up to the all-to-all size.
        inner = sh.cp if cp_comm == "a2a" else c.hierarchical_cp_sizes(sh.tp, sh.cp)[0]
        kv_heads = max(groups, inner)
        qkv = 2 * t * (heads + 2 * kv_heads) * d * sh.act
        q = k = 0
    elif cp_comm == "all_gather":
        qkv += 2 * t * groups * d * sh.act * sh.cp  # the gathered K and V
    if selective:
        core_out = 0
    return linear_inputs + cos_sin + qkv + q + k + core_out


def _gdn_bytes(c, sh):
    """Gated DeltaNet's saved tensors per layer (norm and in_proj input excluded), counted
    per token and value head from what the layer saves: on CPU the plain-PyTorch chunked
    delta rule (layers/gated_delta_rule.py, chunks of GDN_CHUNK positions) keeps 8 [C, C]
    matrices per chunk and value head, about 10 key-width and 14 value-width vectors per
    token and value head (the convolution's input, output and SiLU, the chunked q, k, v and
    their decays and corrections, the per-chunk states, the output, its norm and gate); on
    GPUs the fused kernels (FLA) keep no [C, C] matrices, and the count there is an estimate
    (4 key-width and 8 value-width vectors), not measured."""
    heads = c.linear_num_value_heads // sh.tp
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    if sh.fused_norm:
        per_head = 4 * dk + 8 * dv
    else:
        per_head = 8 * GDN_CHUNK + 10 * dk + 14 * dv
    return sh.tokens * heads * per_head * FP32


def _mlp_bytes(c, sh, ffn, tokens=None):
    """The dense MLP's saved tensors: fc1's input, fc1's output (the activation's input)
    and the activation's output (fc2's input)."""
    t = sh.tokens if tokens is None else tokens
    ffn_local = ffn // sh.tp
    fc1_out = ffn_local * (2 if c.activation == "swiglu" else 1)
    return t * (c.hidden_size + fc1_out + ffn_local) * sh.act


def routed_tokens(c, tokens, ep):
    """Token copies an MoE layer's experts on one rank process: tokens x top-k when
    dropless (balanced routing), at most the experts' capacity with a capacity factor, and
    exactly that capacity with --moe-pad-expert-input-to-capacity."""
    k, experts = c.moe_router_topk, c.num_moe_experts
    copies = tokens * k
    if c.moe_expert_capacity_factor is None:
        return copies
    capacity = -(-int(tokens * k * c.moe_expert_capacity_factor) // experts)
    padded = capacity * experts
    return padded if c.moe_pad_expert_input_to_capacity else min(copies, padded)


def _moe_bytes(c, sh, ep, etp):
    """An MoE layer's saved tensors: the router's input and routing tensors (probabilities
    and map [t, E], top-k indices and weights), the permuted token copies, each expert's fc1
    output and activation, and the combine's weighted copies. --recompute-modules moe: its
    input and the checkpoint's RNG states only; moe_act: no activation output (rebuilt in
    backward); shared_experts: the shared MLP's input and RNG states only."""
    h, t, k, experts = c.hidden_size, sh.tokens, c.moe_router_topk, c.num_moe_experts
    if c.recomputes("moe"):
        return sh.norm_tokens * h * sh.act + _checkpoint_bytes(sh)
    routing = t * h * sh.act + t * experts * (FP32 + 1) + t * k * (2 * INT64 + 2 * FP32)
    copies = routed_tokens(c, t, ep)
    ffn = c.moe_ffn_hidden_size // etp
    fc1_out = ffn * (2 if c.activation == "swiglu" else 1)
    # [copies, h] thrice: the permuted input, the experts' output and its probability-weighted
    # copy (the all-to-all's own buffers are not saved)
    act_out = 0 if c.recomputes("moe_act") else ffn
    experts_bytes = copies * (3 * h + fc1_out + act_out) * sh.act
    shared = 0
    if c.moe_shared_expert_intermediate_size:
        shared = _mlp_bytes(c, sh, c.moe_shared_expert_intermediate_size)
        if c.recomputes("shared_experts"):
            shared = sh.norm_tokens * h * sh.act + _checkpoint_bytes(sh)
    return routing + experts_bytes + shared


def layer_activation_bytes(c, sh, number, ep=1, etp=1):
    """Saved tensors of global layer ``number`` for one microbatch, without full recompute;
    selective recomputation drops what its --recompute-modules rebuild in backward."""
    h = c.hidden_size
    rebuilt_norms = c.recomputes("layernorm")
    # a norm output that is rebuilt frees what its reader kept of it: the token-local copy
    # (the next linear's input without SP; under SP that linear keeps its all-gathered input)
    sp = sh.norm_tokens < sh.tokens
    norm_output = sh.norm_tokens * h * sh.act if rebuilt_norms else 0
    total = 2 * _norm_bytes(sh, h, c.normalization, rebuilt_norms)
    if c.linear_attention_pattern()[number]:
        total += _gdn_bytes(c, sh)
    else:
        total += _attention_bytes(c, sh, c.recomputes("core_attn"),
                                  sh.cp_comms and sh.cp_comms[number])
        total -= 0 if sp else norm_output
    if c.moe_layer_pattern()[number]:
        # the router keeps the norm's output itself, with or without SP
        total += _moe_bytes(c, sh, ep, etp) - norm_output
    elif c.mlp_chunks_for_training > 1:  # tiled MLP: each chunk saves only its input
        total += sh.norm_tokens * h * sh.act
    elif c.recomputes("mlp"):  # the checkpoint keeps the MLP's input
        total += sh.norm_tokens * h * sh.act + _checkpoint_bytes(sh) - norm_output
    else:
        total += _mlp_bytes(c, sh, c.ffn_hidden_size) - (0 if sp else norm_output)
    if c.hidden_dropout > 0:
        total += 2 * sh.norm_tokens * c.hidden_size  # bool masks of both dropouts
    return total


def _layer_backward_transient(c, sh, number):
    """Gradients a layer's backward holds at its largest point: the MLP's (fc2 input grad,
    fc1 output grad, fc1's weight grad before the main_grad hook frees it, the input grad).
    A tiled MLP (--mlp-chunks-for-training N) rebuilds one chunk's saved tensors and takes
    one chunk's gradients at a time."""
    h = c.hidden_size
    extra = 0
    if c.moe_layer_pattern()[number]:
        ffn, t = c.moe_ffn_hidden_size, routed_tokens(c, sh.tokens, 1)
    else:
        ffn, t = c.ffn_hidden_size, sh.tokens
        if c.mlp_chunks_for_training > 1:
            t = -(-sh.tokens // min(c.mlp_chunks_for_training, sh.tokens))
            extra = _mlp_bytes(c, sh, ffn, t)
    fc1 = ffn // sh.tp * (2 if c.activation == "swiglu" else 1)
    return (t * (ffn // sh.tp + fc1 + h) + h * fc1) * sh.act + extra


def _offload_group_bytes(c, sh, number, ep, etp):
    """[(name, bytes)] of layer ``number``'s fine-grained offloading groups (its calls of the
    --offload-modules, in forward order): the bytes of the tensors each saves that have at
    least --min-offloaded-tensor-size elements, counted once per save as the offloader copies
    them. Softmax attention (not MLA, whose groups are not modelled) and MoE experts taking
    one grouped matmul."""
    h, t, nt, act = c.hidden_size, sh.tokens, sh.norm_tokens, sh.act
    rebuilt = c.recomputes("layernorm")
    if rebuilt:
        norm = [(nt * h, act)]
    elif c.normalization == "LayerNorm":
        norm = [(nt * h, act), (nt, FP32), (nt, FP32)]
    elif sh.fused_norm:
        norm = [(nt * h, act), (nt, FP32)]
    else:  # F.rms_norm's decomposition saves the input and x * rstd thrice, rstd twice
        norm = [(nt * h, act)] * 3 + [(nt, FP32)] * 2
    heads, groups, d = c.num_attention_heads // sh.tp, c.num_query_groups // sh.tp, c.kv_channels
    saves = {"attn_norm": norm, "mlp_norm": norm}
    softmax = not (c.linear_attention_pattern()[number] or c.multi_latent_attention)
    if softmax:
        saves["qkv_linear"] = [(t * h, act)]
        # the kernel's q, k, v, output and log-sum-exp; a checkpoint keeps its own inputs
        saves["core_attn"] = [] if c.recomputes("core_attn") else [
            (t * heads * d, act), (t * groups * d, act), (t * groups * d, act),
            (t * heads * d, act), (t * heads, FP32)]
        saves["attn_proj"] = [(t * heads * d, act)]
    if c.moe_layer_pattern()[number]:
        copies, ffn = routed_tokens(c, t, ep), c.moe_ffn_hidden_size // etp
        fc1_out = ffn * (2 if c.activation == "swiglu" else 1)
        # the permuted tokens and the grouped matmul's int32 offsets [E_local]
        saves["expert_fc1"] = [(copies * h, act), (c.num_moe_experts // ep, 4)]
        twice = c.activation == "squared_relu" and not c.recomputes("moe_act")
        saves["moe_act"] = [(copies * fc1_out, act)] * (2 if twice else 1)
    order = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
             "moe_act")
    return [(name, sum(n * size for n, size in saves[name]
                       if n >= c.min_offloaded_tensor_size))
            for name in order if name in c.offload_modules and name in saves]


def offloaded_bytes(c, sh, layers, ep=1, etp=1):
    """(bytes fine-grained offloading moves to the host in one microbatch's forward through
    ``layers``, the largest group's bytes): Megatron-LM's choice (layers/
    fine_grained_offload.py's plan_offload) with the last group of each name kept, as on
    the last stage (earlier stages keep them in each step's first microbatch only, so there
    this predicts a little more on the device); 0 without --fine-grained-activation-
    offloading or under full recompute (its layers save nothing outside the checkpoints).
    The host holds these bytes for each microbatch in flight."""
    if not c.fine_grained_activation_offloading or c.recompute_granularity == "full":
        return 0, 0
    groups = [g for n in layers for g in _offload_group_bytes(c, sh, n, ep, etp)]
    moves, _ = plan_offload(groups, c.activation_offload_fraction)
    moved = [size for (_, size), move in zip(groups, moves) if move]
    return sum(moved), max(moved, default=0)


def _chunk_activation_bytes(c, sh, layers, ep, etp):
    """(saved bytes of one microbatch through ``layers``, extra of the largest backward)."""
    per_layer = [layer_activation_bytes(c, sh, n, ep, etp) for n in layers]
    on_device = [n >= sh.offloaded for n in layers]  # --cpu-offloading-num-layers moves the rest
    transient = max((_layer_backward_transient(c, sh, n) for n in layers), default=0)
    if sh.fine_offload and c.recompute_granularity != "full":  # back one group at a time
        moved, largest = offloaded_bytes(c, sh, layers, ep, etp)
        return sum(per_layer) - moved, transient + largest
    if c.recompute_granularity != "full" or not layers:
        # an offloaded layer's tensors come back one layer at a time, in its backward
        back = max((b for b, kept in zip(per_layer, on_device) if not kept), default=0)
        return sum(b for b, kept in zip(per_layer, on_device) if kept), transient + back
    k = c.recompute_num_layers or 1
    chunk_input = sh.norm_tokens * c.hidden_size
    if c.distribute_saved_activations and sh.tp > 1:  # each TP rank keeps 1/TP (padded)
        chunk_input = -(-chunk_input // sh.tp)
    chunk_input *= sh.act
    if c.recompute_method == "uniform":
        starts = range(0, len(per_layer), k)
        chunks = [per_layer[i:i + k] for i in starts]
        # backward rebuilds one chunk at a time while every chunk's input stays saved
        # (offloaded: on the host, when the chunk starts in the first N layers)
        inputs = sum(chunk_input for i in starts if on_device[i])
        return inputs, transient + max(sum(ch) for ch in chunks)
    recomputed = min(k, len(per_layer))
    kept = sum(b for b, dev in zip(per_layer[recomputed:], on_device[recomputed:]) if dev)
    rebuilt = max(per_layer[:recomputed], default=0)
    inputs = sum(chunk_input for dev in on_device[:recomputed] if dev)
    return inputs + kept, transient + rebuilt


def _tiled_loss_bytes(c, sh, vocab_local, has_padding):
    """(peak above what stays saved, saved) of the tiled output layer and loss
    (--tiled-logits-chunk-size; tensor_parallel/tiled_cross_entropy.py): it saves the output
    layer's input and two fp32 numbers per token. Its loops hold the previous chunk's fp32
    logits (the loop variable) while the next chunk's are formed: the matmul's output, its
    fp32 copy (half models) and its padded-vocab masked copy. Backward adds the input
    gradient [s, b, h], the fp32 weight gradient it sums over chunks (and, for half models,
    each chunk's product before the sum) and the chunk's gradient cast to the model's dtype."""
    t, h = sh.tokens, c.hidden_size
    half = sh.act != FP32
    positions = t // sh.micro_batch
    rows = min(c.tiled_logits_chunk_size, positions) * sh.micro_batch * vocab_local
    new_chunk = rows * max(sh.act + (FP32 if half else 0),
                           (FP32 if half else sh.act) + (FP32 if has_padding else 0))
    forward = rows * FP32 + new_chunk
    saved = t * h * sh.act + t * (2 * FP32 + INT64 + 1) + _norm_bytes(sh, h, c.normalization)
    weight_grad = vocab_local * h * FP32 * (2 if half else 1)
    backward = t * h * sh.act + weight_grad + forward + (rows * sh.act if half else 0)
    return max(forward, backward), saved


def _loss_bytes(c, sh, vocab_local, has_padding):
    """(peak of the output layer and loss above what stays saved, what stays saved) on the
    last stage. Forward: the logits and their padded-vocab masked copy, then the masked
    logits, their fp32 copy (half models) and cross entropy's fp32 shifted logits (kept as
    its softmax). Backward: the softmax reused as the gradient and masked_fill's new
    gradient, its half cast, then the output layer's input gradient and weight gradient."""
    t, h = sh.tokens, c.hidden_size
    logits = t * vocab_local * sh.act
    fp32 = t * vocab_local * FP32
    half = sh.act != FP32
    masked = logits if has_padding else 0
    saved = t * h * sh.act + _norm_bytes(sh, h, c.normalization)  # final norm, output input
    forward = max(logits + masked, (masked or logits) + (fp32 if half else 0) + fp32)
    grad_masked = fp32 if has_padding else 0
    steps = [fp32 + grad_masked]
    if half:
        steps.append((grad_masked or fp32) + logits)
    steps.append((logits if half else fp32) + t * h * sh.act + vocab_local * h * sh.act)
    return max(forward, max(steps)), saved


# ----- the estimate --------------------------------------------------------------------
def pipeline_layout_of(run):
    """The :class:`~megatron_cp.pipeline_parallel.PipelineLayout` of ``run``: its model's
    layers over its parallel section's (virtual) stages."""
    return layout_from_config(run.parallel, run.model.num_layers, run.model.mtp_num_layers)


def _fully_sharded_bytes(run, layout, stage_params, act, d):
    """(gathered params, sharded state, host state) bytes under FSDP2 (one stage, EP 1):
    16/d bytes per param sharded (fp32 params, fp32 gradients, Adam), and in the compute
    dtype the root unit (embeddings, output layer, final norm; gathered through the step)
    plus the largest layer, or every layer with --torch-fsdp2-no-reshard-after-forward."""
    c, parallel = run.model, run.parallel
    layers = [sum(layer_param_counts(c, n, parallel.tensor_model_parallel_size, 1,
                                     parallel.expert_tensor_parallel_size))
              for n in layout.layer_numbers(0, 0)]
    root = stage_params - sum(layers)
    whole = run.optimizer.torch_fsdp2_no_reshard_after_forward or run.optimizer.keeps_params_whole
    held = sum(layers) if whole else max(layers)
    state, host = (stage_params * per for per in optimizer_bytes_per_param(
        run.optimizer, c.params_dtype, d, fully_sharded=True))
    return (root + held) * act, int(state), int(host)


def _in_flight(parallel, layout, pp_rank, num_microbatches):
    """Model chunks of microbatches whose activations a pipeline rank holds at once."""
    pp, vp = layout.pp_size, layout.vp_size
    if pp == 1:
        return 1
    if vp == 1:
        return min(pp - pp_rank, num_microbatches)
    group = parallel.microbatch_group_size_per_vp_stage or pp
    return min(2 * (pp - pp_rank - 1) + (vp - 1) * group, num_microbatches * vp) + 1


def _shapes(run, device):
    """The :class:`_Shapes` of ``run``'s layers on ``device`` ("cpu" or "gpu")."""
    c, parallel = run.model, run.parallel
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    cp_comms = None
    if cp > 1:
        cp_comms = tuple(resolve_comm_type(c.layer_cp_comm_type(n), c.num_query_groups // tp, cp,
                                           c.hierarchical_context_parallel_sizes)[0]
                         for n in range(c.num_layers))
    act = torch.tensor([], dtype=c.params_dtype).element_size()
    micro_batch = run.training.micro_batch_size
    tokens = micro_batch * run.data.seq_length // cp
    sp = c.sequence_parallel and tp > 1
    gpu = device == "gpu"  # CPU activations live in host memory already: nothing offloads
    return _Shapes(micro_batch, tokens, tokens // tp if sp else tokens, tp, cp, cp_comms,
                   act, gpu, c.cpu_offloading_num_layers if gpu else 0,
                   gpu and c.fine_grained_activation_offloading)


def estimate_memory(run, device="cpu"):
    """The :class:`MemoryEstimate` of ``run`` (a :class:`~megatron_cp.config.run.RunConfig`
    of checked arguments: its model, layout, optimizer, batch and sequence length).
    ``device``: "cpu" or "gpu" (which norm kernels run)."""
    c, parallel, optimizer = run.model, run.parallel, run.optimizer
    tp, cp, pp = parallel.tensor_model_parallel_size, parallel.context_parallel_size, \
        parallel.pipeline_model_parallel_size
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    dp = parallel.data_parallel_size
    layout = pipeline_layout_of(run)
    sh = _shapes(run, device)
    act, tokens = sh.act, sh.tokens
    distributed = optimizer.use_distributed_optimizer
    instances = optimizer.num_distributed_optimizer_instances  # validated: at least 1
    world = dp * cp * tp * pp
    expert_dp = world // (pp * ep * etp)
    dense_per, dense_host = optimizer_bytes_per_param(optimizer, c.params_dtype,
                                                      dp * cp // instances, distributed)
    expert_per, expert_host = optimizer_bytes_per_param(optimizer, c.params_dtype,
                                                        expert_dp // instances, distributed)
    num_microbatches = run.training.num_microbatches or 1
    padded = c.padded_vocab_size(tp)
    vocab_local = padded // tp
    has_padding = padded > c.vocab_size  # the last TP rank's slice holds the padding
    best = None
    cp_comms = sh.cp_comms
    for pp_rank in range(pp):
        dense, experts = stage_param_counts(c, layout, pp_rank, tp, ep, etp)
        if optimizer.fully_sharded:
            params, state, host = _fully_sharded_bytes(run, layout, dense + experts, act, dp * cp)
        else:
            params = dense * act + experts * act
            state = int(dense * dense_per + experts * expert_per) - params
            host = int(dense * dense_host + experts * expert_host)
        chunk_layers = layout.chunk_layer_numbers(pp_rank)
        saved, transient = 0, 0
        flights = _in_flight(parallel, layout, pp_rank, num_microbatches)
        per_chunk = [_chunk_activation_bytes(c, sh, layers, ep, etp) for layers in chunk_layers]
        chunk_saved = max(s for s, _ in per_chunk)
        saved = flights * chunk_saved if layout.vp_size > 1 else flights * per_chunk[0][0]
        transient = max(tr for _, tr in per_chunk)
        if sh.fine_offload:  # fine-grained offloading's groups wait on the host
            host += flights * max(offloaded_bytes(c, sh, layers, ep, etp)[0]
                                  for layers in chunk_layers)
        loss = 0
        last = any(layout.has_loss(pp_rank, ch) for ch in range(layout.vp_size))
        if last:
            loss_path = _tiled_loss_bytes if c.tiled_logits_chunk_size else _loss_bytes
            peak, loss_saved = loss_path(c, sh, vocab_local, has_padding)
            loss = loss_saved + max(peak, transient)
        else:
            loss = transient
        buffers = 2 * sh.norm_tokens * c.hidden_size * act if pp > 1 else 0
        if set(cp_comms or ()) & {"p2p", "a2a+p2p"}:  # a ring's K/V blocks
            groups = c.num_query_groups // tp
            buffers += 2 * 2 * tokens * groups * c.kv_channels * act  # K/V in use + in flight
        batch = num_microbatches * tokens * BATCH_BYTES_PER_TOKEN
        parts = {"params": params, "grads_and_optimizer": state, "activations": saved,
                 "loss_and_transient": loss, "buffers": buffers, "batch": batch}
        total = sum(parts.values())
        if best is None or total > best.total_bytes:
            best = MemoryEstimate(int(total), pp_rank, parts, host)
    return best


def offloaded_activation_bytes(run, device="gpu", in_flight=True):
    """Host bytes of each pipeline rank (a list, by pp rank) that --cpu-offloading-num-layers
    moves off the device: what the offloaded layers save (under full recompute: their
    checkpoints' inputs), for every microbatch in flight (``in_flight``; else for one
    microbatch through the rank's model chunks). 0 on CPU, where nothing moves. These bytes
    are the device estimate's saved activations with offloading minus those without."""
    sh = _shapes(run, device)
    if not sh.offloaded:
        return [0] * run.parallel.pipeline_model_parallel_size
    kept_all = replace(sh, offloaded=0)
    c, parallel, layout = run.model, run.parallel, pipeline_layout_of(run)
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    num_microbatches = run.training.num_microbatches or 1
    host = []
    for pp_rank in range(layout.pp_size):
        moved = [_chunk_activation_bytes(c, kept_all, layers, ep, etp)[0]
                 - _chunk_activation_bytes(c, sh, layers, ep, etp)[0]
                 for layers in layout.chunk_layer_numbers(pp_rank)]
        if not in_flight:
            host.append(sum(moved))
            continue
        flights = _in_flight(parallel, layout, pp_rank, num_microbatches)
        host.append(flights * (max(moved) if layout.vp_size > 1 else moved[0]))
    return host
