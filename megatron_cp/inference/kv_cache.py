"""Incremental decoding: a model chunk run on new tokens only, with a key/value cache per layer.

This is an inference-only path over the model's OWN modules and weights (embedding, norms,
QKV and output projections, QK norms, rotary, MLP, output layer): the training forward stays
as it is. Each attention layer projects the new tokens to q, k, v with the layer's own
:meth:`megatron_cp.model.attention.SelfAttention.query_key_value` (normalised and rotated by
their positions, as in training), appends k and v to the layer's cache and lets the new
queries attend to every cached key (multi-latent attention caches its compressed latents
instead and expands them each step: mla_cache.py). The first call (the prompt) runs the layer's own
``core_attention``, so its outputs are those of the full forward; later calls attend with one
query row per new token. A Gated DeltaNet layer keeps its conv tail and recurrent state
instead (:mod:`.gdn_cache`).

Tensor parallelism works as in training (heads and MLP split, the same collectives);
sequence parallelism and context parallelism do not apply to a few new tokens and are off.
"""
import torch
import torch.nn.functional as F

from megatron_cp.inference.gdn_cache import GatedDeltaLayerCache
from megatron_cp.inference.mla_cache import LatentCache, latent_query_key_value


class LayerCache:
    """The keys and values of one attention layer for the tokens seen so far:
    ``[b, ng/tp, capacity, d]`` buffers filled left to right."""

    def __init__(self, capacity):
        self.capacity, self.length = capacity, 0
        self.keys = self.values = None

    def append(self, k, v):
        """Add ``k``, ``v`` [b, ng/tp, s, d]; return all keys and values so far
        [b, ng/tp, length, d]."""
        b, groups, s, d = k.shape
        if self.keys is None:
            self.keys = k.new_empty(b, groups, self.capacity, d)
            self.values = v.new_empty(b, groups, self.capacity, d)
        if self.length + s > self.capacity:
            raise ValueError(f"the key/value cache holds {self.capacity} tokens; {self.length + s} "
                             f"were asked for: raise its capacity (prompt + --max-new-tokens)")
        self.keys[:, :, self.length:self.length + s] = k
        self.values[:, :, self.length:self.length + s] = v
        self.length += s
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]


class KVCache:
    """One :class:`LayerCache` per attention layer (a
    :class:`~megatron_cp.inference.gdn_cache.GatedDeltaLayerCache` per Gated DeltaNet layer,
    a :class:`~megatron_cp.inference.mla_cache.LatentCache` per multi-latent attention layer)
    of every model chunk on this rank, for up to ``capacity`` tokens per sequence.
    ``length``: tokens seen (the next token's position)."""

    def __init__(self, model_chunks, capacity):
        self.capacity = capacity
        self.layers = [[self._layer_cache(layer) for layer in chunk.decoder.layers]
                       for chunk in model_chunks]

    def _layer_cache(self, layer):
        """A GDN layer's recurrent cache, an MLA layer's latent cache, or keys and values."""
        if layer.is_linear_attention:
            return GatedDeltaLayerCache()
        if layer.config.multi_latent_attention:
            return LatentCache(self.capacity)
        return LayerCache(self.capacity)

    @property
    def length(self):
        return self.layers[0][0].length if self.layers and self.layers[0] else 0


def _attend(attention, q, k, v, past):
    """q [b, nh/tp, s, d] of the tokens at positions past.., k/v [b, ng/tp, past + s, d]."""
    if past == 0:  # the prompt: the model's own causal attention
        return attention.core_attention(q, k, v, None, None)
    s, total = q.shape[2], k.shape[2]
    mask = None
    if s > 1:  # new token i sees every cached token and the new ones up to itself
        query_positions = past + torch.arange(s, device=q.device)[:, None]  # [s, 1]
        mask = torch.arange(total, device=q.device) <= query_positions  # [s, past + s]
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa,
                                          scale=attention.softmax_scale)


def cached_attention(attention, x, position_ids, cache):
    """``SelfAttention`` or ``MultiLatentAttention`` ``attention`` on the new tokens ``x``
    [s, b, h] at ``position_ids`` [b, s], through ``cache`` (a :class:`LayerCache`, or for
    MLA a :class:`~megatron_cp.inference.mla_cache.LatentCache`) -> [s, b, h]."""
    past = cache.length
    if isinstance(cache, LatentCache):  # MLA: the cache holds latents (mla_cache.py)
        gate = None
        q, k, v = latent_query_key_value(attention, x, position_ids, cache)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, nh/tp, s or past + s, d*]
    else:
        q, k, v, gate = attention.query_key_value(x, position_ids)  # [s, b, heads, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        k, v = cache.append(k, v)  # [b, ng/tp, past + s, d]
    s, b, d = q.shape[2], q.shape[0], attention.head_dim  # d: each head's output width
    out = _attend(attention, q, k, v, past)  # [b, nh/tp, s, d]
    out = out.permute(2, 0, 1, 3).reshape(s, b, attention.local_heads * d)  # [s, b, nh/tp*d]
    return attention.project_out(out, gate)


def cached_chunk_forward(chunk, tokens, position_ids, input_tensor, layer_caches):
    """One model chunk on the new tokens only: ``tokens`` / ``position_ids`` [b, s] (used by
    the embedding and rotary), ``input_tensor`` [s, b, h] from the previous stage (None on the
    first). Returns the hidden states [s, b, h] for the next stage, or on the last stage the
    vocab-parallel logits [1, b, v/tp] of the last new token."""
    if chunk.sequence_parallel or chunk.decoder.layers and \
            chunk.decoder.layers[0].self_attention.cp_size > 1:
        raise ValueError("incremental decoding runs without sequence or context parallelism; "
                         "drop --sequence-parallel and use --context-parallel-size 1")
    h = chunk.embedding(tokens, position_ids) if chunk.pre_process else input_tensor  # [s, b, h]
    for layer, cache in zip(chunk.decoder.layers, layer_caches):
        attention_input = layer.input_layernorm(h)
        if layer.is_linear_attention:
            h = h + cache.continue_sequence(layer.self_attention, attention_input)
        else:
            h = h + cached_attention(layer.self_attention, attention_input, position_ids, cache)
        h = h + layer.mlp(layer.pre_mlp_layernorm(h))
    if not chunk.post_process:
        return h
    return chunk._logits(chunk.final_layernorm(h[-1:]))  # [1, b, v/tp]
