"""--torch-compile: each transformer layer compiled on its own, core attention left eager.

Per layer, as torchtitan does, not the whole model: the layers are identical, so they share
one compiled graph (parameters are graph inputs, not constants) and the compile time does not
grow with depth, while the embedding, the loss, the pipeline schedule and full-layer
recomputation around the layers stay plain eager code. ``Module.compile`` compiles in place,
so parameter names, state dicts and checkpoints are those of the eager model.

What is compiled: the norms, the QKV and output projections with the tensor-parallel (and
sequence-parallel) collectives around them, rotary, the residual adds, dropout and the MLP.
Inductor fuses the elementwise work between the matmuls (norm, rotary, SwiGLU, casts,
residuals) into a few generated kernels.

What stays eager: ``SelfAttention.core_attention``, behind ``torch.compiler.disable``. It is
one fused attention kernel either way, and everything context parallelism does there (ring
and Ulysses autograd Functions with p2p / all-to-all inside, block plans decided from token
metadata on the host, the attention-dropout hash mask) then runs exactly as in eager mode, for
every ``--cp-comm-type``. The layer becomes two graphs, before and after attention; with hidden
dropout its hash mask (layers/hidden_dropout.py ``keep_mask``) is eager too, one more break at
each of the layer's two dropouts.
"""
import torch


def compile_layer(layer, mode="default"):
    """Compile ``layer`` (a TransformerLayer) in place with torch.compile ``mode``; its core
    attention stays eager."""
    attention = layer.self_attention
    assert callable(getattr(type(attention), "core_attention", None)), \
        "SelfAttention.core_attention is the eager boundary of a compiled layer"
    # An instance attribute shadows the method for this layer only; every call site
    # (plain, or through selective recomputation's checkpoint) looks it up on self.
    attention.core_attention = torch.compiler.disable(attention.core_attention)
    layer.compile(mode=mode)
    return layer
