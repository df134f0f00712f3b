"""The transformer layer (pre-norm attention + MLP or MoE with residuals) and the layer stack.

A stack holds any contiguous (or, for virtual pipeline stages, any) set of GLOBAL layer
numbers, so a pipeline stage builds exactly the layers it owns with the weights the
single-process model would have. Full activation recomputation checkpoints whole layers
(uniform chunks or the first N, Megatron's ``--recompute-method``). With ``--torch-compile``
each layer is compiled on its own (see compile_layers.py). Hidden dropout after attention
and after the MLP draws its mask from each element's global coordinates (hidden_dropout.py),
so every layout and recomputation drop the same elements.
"""
import contextlib

import torch

from megatron_cp import tensor_parallel as tpar
from megatron_cp.fp8 import attach_fp8, fp8_layer
from megatron_cp.layers.activation_offload import offloader_for
from megatron_cp.layers.fine_grained_offload import FineGrainedOffload, offload_group
from megatron_cp.model.attention import SelfAttention
from megatron_cp.model.compile_layers import compile_layer
from megatron_cp.layers.norms import norm_for
from megatron_cp.model.gated_delta_net import GatedDeltaNet
from megatron_cp.layers.hidden_dropout import (hidden_dropout, layer_site_keys, sequence_shard,
                                               token_coordinates)
from megatron_cp.layers.mlp import MLP, chunked_mlp
from megatron_cp.model.multi_latent_attention import MultiLatentAttention
# a module reference: megatron_cp.moe.layer imports the MLP from this package (import cycle)
import megatron_cp.moe.layer as moe_layer


def mark_sequence_parallel(module, sequence_parallel):
    """Norm params see only this rank's tokens under SP: their grads are summed over TP."""
    for p in module.parameters():
        p.sequence_parallel = sequence_parallel


class TransformerLayer(torch.nn.Module):
    """x [s(/tp), b, h] -> x + attn(norm(x)) -> x + mlp(norm(x)). The token mixer
    ``self_attention`` is softmax attention (multi-latent attention with
    --multi-latent-attention), or Gated DeltaNet where the config's linear-attention pattern
    marks the layer (Megatron-LM's name for each)."""
    offload = None  # the block's FineGrainedOffload, with --fine-grained-activation-offloading

    def __init__(self, config, layer_number, tp_group, cp_group, rng_tracker, device=None,
                 ep_group=None, state=None, prefix=None, kind_of=None):
        super().__init__()
        # An MTP layer (multi_token_prediction.py) has its own name (its weights' seeds) and
        # number, and takes the kind (token mixer, dense or MoE) of decoder layer ``kind_of``.
        prefix = prefix or f"decoder.layers.{layer_number}"
        kind_of = layer_number if kind_of is None else kind_of
        self.config, self.rng_tracker, self.layer_number = config, rng_tracker, layer_number
        self.shard = sequence_shard(tp_group, config.sequence_parallel)  # of the local sequence
        # [3]: the keys of this layer's dropout sites and router jitter (a buffer, not ints:
        # compiled layers share one graph; hidden_dropout.layer_site_keys)
        self.register_buffer("site_keys", layer_site_keys(config.seed, layer_number, device),
                             persistent=False)
        self.input_layernorm = norm_for(config, config.hidden_size, device)
        hierarchical = None  # the a2a+p2p sub-groups, when the state was built with them
        if state is not None and state.group("hcp_inner") is not None:
            hierarchical = (state.group("hcp_inner"), state.group("hcp_outer"))
        self.is_linear_attention = config.linear_attention_pattern()[kind_of]
        if self.is_linear_attention:
            self.self_attention = GatedDeltaNet(config, prefix + ".self_attention", tp_group,
                                                device, cp_group, hierarchical, layer_number)
        else:
            attention = MultiLatentAttention if config.multi_latent_attention else SelfAttention
            dynamic = {} if state is None else state.dynamic_cp_groups()
            extra = {"dynamic_cp_groups": dynamic} if dynamic else {}
            self.self_attention = attention(config, prefix + ".self_attention", tp_group,
                                            cp_group, rng_tracker, device, hierarchical,
                                            layer_number, **extra)
        self.pre_mlp_layernorm = norm_for(config, config.hidden_size, device)
        self.is_moe = config.moe_layer_pattern()[kind_of]
        if self.is_moe:
            self.mlp = moe_layer.MoELayer(config, prefix + ".mlp", state, rng_tracker, device)
        else:
            self.mlp = MLP(config, prefix + ".mlp", tp_group, device)
        mark_sequence_parallel(self.input_layernorm, config.sequence_parallel)
        mark_sequence_parallel(self.pre_mlp_layernorm, config.sequence_parallel)

    def prepare_layout(self, layout, length, device):
        """Work out in ``layout`` (the microbatch's SequenceLayout) what this layer's
        attention will look up (softmax attention; Gated DeltaNet plans nothing there)."""
        prepare = getattr(self.self_attention, "prepare_layout", None)
        if prepare is not None:
            prepare(layout, length, device)

    def forward(self, x, position_ids, token_index=None, document_ids=None, loss_mask=None,
                dropout_ids=None, site_number=None, layout=None):
        """x [s(/tp), b, h] -> same shape. ``dropout_ids``: a DropoutIds or None;
        ``site_number``: the number its random draws are keyed by (default the layer number;
        a repeated MTP layer passes each depth's); ``layout``: the microbatch's
        SequenceLayout, prepared before the layers (None: attention plans per call)."""
        c = self.config
        keys = (self.site_keys if site_number is None else
                layer_site_keys(c.seed, site_number, x.device))  # [3]
        coords = None  # built only when something is drawn
        if self.training and (c.hidden_dropout > 0 or (self.is_moe and c.moe_input_jitter_eps)):
            coords = token_coordinates(dropout_ids, x, self.shard)
        h, rebuild = self._norm(self.input_layernorm, x, "attn_norm")
        attn = self.self_attention(h, position_ids, token_index, document_ids, dropout_ids,
                                   layout=layout)
        if rebuild is not None:
            rebuild.discard_after(attn)
        x = x + hidden_dropout(attn, c.hidden_dropout, self.training, keys[0], coords)
        h, rebuild = self._norm(self.pre_mlp_layernorm, x, "mlp_norm")
        mlp = self._mlp(h, loss_mask, coords, keys[2])
        if rebuild is not None:
            rebuild.discard_after(mlp)
        return x + hidden_dropout(mlp, c.hidden_dropout, self.training, keys[1], coords)

    def _norm(self, norm, x, offload_name):
        """(norm(x), its DiscardedOutput or None): with --recompute-modules layernorm the
        norm's output is not kept once the module after it has run; backward rebuilds it.
        ``offload_name``: its fine-grained offloading group (attn_norm or mlp_norm)."""
        with offload_group(self.offload, offload_name):
            if not (self.training and self.config.recomputes("layernorm")):
                return norm(x), None
            rebuild = tpar.DiscardedOutput(norm)
            return rebuild(x), rebuild

    def _mlp(self, h, loss_mask, coords, jitter_key):
        """The MLP or MoE of ``h`` [s(/tp), b, h], checkpointed with --recompute-modules mlp
        (dense layers) or moe (MoE layers, also --moe-layer-recompute)."""
        c, training = self.config, self.training
        if self.is_moe:
            if training and c.recomputes("moe"):
                return tpar.checkpoint(self.mlp, self.rng_tracker, h, loss_mask, coords,
                                       jitter_key)
            return self.mlp(h, loss_mask, coords, jitter_key)
        if c.mlp_chunks_for_training > 1 and training:  # each chunk is recomputed already
            return chunked_mlp(self.mlp, h, c.mlp_chunks_for_training, self.rng_tracker)
        if training and c.recomputes("mlp"):
            return tpar.checkpoint(self.mlp, self.rng_tracker, h)
        return self.mlp(h)


class TransformerBlock(torch.nn.Module):
    """The layers of one model chunk, with optional full activation recomputation."""

    def __init__(self, config, layer_numbers, tp_group, cp_group, rng_tracker, device=None,
                 state=None):
        super().__init__()
        self.config, self.rng_tracker = config, rng_tracker
        # --distribute-saved-activations: each recomputed chunk's input split over TP
        self.distribute_group = tp_group if config.distribute_saved_activations else None
        self.layer_numbers = list(layer_numbers)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, n, tp_group, cp_group, rng_tracker, device, state=state)
            for n in self.layer_numbers)
        for n, layer in zip(self.layer_numbers, self.layers):
            if fp8_layer(config, n):  # --fp8-format, but --first-last-layers-bf16's layers
                attach_fp8(layer, config, tp_group, cp_group)
        if config.torch_compile:
            for layer in self.layers:
                compile_layer(layer, config.torch_compile_mode)
        self.offloader = offloader_for(config.cpu_offloading_num_layers, device,
                                       config.cpu_offloading_retain_pinned_cpu_buffers)
        self.fine_offload = None  # --fine-grained-activation-offloading: its groups' offloader
        if config.fine_grained_activation_offloading:
            pp = (state.rank("pp"), state.size("pp")) if state is not None else (0, 1)
            self.fine_offload = FineGrainedOffload(config, device, *pp)
            for layer in self.layers:
                layer.offload = layer.self_attention.offload = self.fine_offload
                if layer.is_moe:
                    layer.mlp.experts.offload = self.fine_offload

    def _offload(self, layer_number):
        """Where layer ``layer_number`` (global) keeps what it saves for backward: host
        memory for the first --cpu-offloading-num-layers layers, else the device."""
        if self.offloader is None or layer_number >= self.config.cpu_offloading_num_layers:
            return contextlib.nullcontext()
        return self.offloader.context()

    def _run(self, start, end, offload=True):
        def run(x, position_ids, token_index, document_ids, loss_mask, dropout_ids, layout):
            for number, layer in zip(self.layer_numbers[start:end], self.layers[start:end]):
                with self._offload(number) if offload else contextlib.nullcontext():
                    x = layer(x, position_ids, token_index, document_ids, loss_mask, dropout_ids,
                              layout=layout)
            return x
        return run

    def _recomputed(self, start, end, x, *args):
        """Layers [start, end) under full recomputation. Offloading wraps the checkpoint,
        never the layers inside it: what the checkpoint saves (its input) moves to the host,
        while the layers' own tensors stay with the checkpoint, which drops them and
        recomputes them in backward (saved-tensor hooks inside a checkpoint would take its
        tensors away from it)."""
        with self._offload(self.layer_numbers[start]):
            return tpar.checkpoint(self._run(start, end, offload=False), self.rng_tracker, x,
                                   *args, distribute_group=self.distribute_group)

    def prepare_layout(self, layout, length, device):
        """Work out in ``layout`` (the microbatch's SequenceLayout) every plan the layers'
        attention will look up, before the first layer runs."""
        for layer in self.layers:
            layer.prepare_layout(layout, length, device)

    def forward(self, x, position_ids, token_index=None, document_ids=None, loss_mask=None,
                dropout_ids=None, layout=None):
        c = self.config
        n = len(self.layers)
        args = (position_ids, token_index, document_ids, loss_mask, dropout_ids, layout)
        if c.recompute_granularity != "full" or not self.training:
            if self.fine_offload is None or not self.training:
                return self._run(0, n)(x, *args)
            self.fine_offload.start_forward()
            try:
                return self._run(0, n)(x, *args)
            finally:
                self.fine_offload.end_forward()
        k = c.recompute_num_layers or 1
        if c.recompute_method == "uniform":
            for start in range(0, n, k):
                x = self._recomputed(start, min(start + k, n), x, *args)
            return x
        for i in range(n):  # block: recompute the first k layers of this chunk
            x = self._recomputed(i, i + 1, x, *args) if i < k else self._run(i, i + 1)(x, *args)
        return x
