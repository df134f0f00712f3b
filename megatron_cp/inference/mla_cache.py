"""Incremental decoding of multi-latent attention: the cache holds the compressed latent.

What MLA saves is memory per cached token: instead of every head's key and value
(nh x (qk_head_dim + qk_pos_emb_head_dim + v_head_dim) numbers), :class:`LatentCache` keeps
the normalised key/value latent c_kv (kv_lora_rank) and the rotated shared key k_pe
(qk_pos_emb_head_dim) of each token, the same on every TP rank. Each step the layer's own
up projection expands the cached latents to this rank's heads' keys and values (the
non-absorbed form: exactly the training computation, with the up projection's cost per
step; Megatron-LM's absorbed decode folds it into the query instead).
"""
import torch


class LatentCache:
    """The [c_kv | rotated k_pe] of one MLA layer for the tokens seen so far: one
    ``[capacity, b, kv_lora_rank + qk_pos_emb_head_dim]`` buffer filled front to back."""

    def __init__(self, capacity):
        self.capacity, self.length = capacity, 0
        self.latents = None

    def append(self, latent):
        """Add ``latent`` [s, b, kv_lora_rank + pos]; return every cached one so far
        [length, b, kv_lora_rank + pos]."""
        s, b, width = latent.shape
        if self.latents is None:
            self.latents = latent.new_empty(self.capacity, b, width)
        if self.length + s > self.capacity:
            raise ValueError(f"the latent cache holds {self.capacity} tokens; {self.length + s} "
                             f"were asked for: raise its capacity (prompt + --max-new-tokens)")
        self.latents[self.length:self.length + s] = latent
        self.length += s
        return self.latents[:self.length]


def latent_query_key_value(attention, x, position_ids, cache):
    """A :class:`~megatron_cp.model.multi_latent_attention.MultiLatentAttention` on the new
    tokens ``x`` [s, b, h] at ``position_ids`` [b, s] through ``cache`` -> q [s, b, nh/tp,
    dk] of the new tokens, k [past + s, b, nh/tp, dk] and v [past + s, b, nh/tp, dv] of every
    token so far."""
    q_in, c_kv, k_pe = attention.latents(x)  # [s, b, ...]
    cos, sin = attention.rotary.cos_sin(position_ids)  # [s, b, 1, pos/2]
    k_pe = attention.rotary.rotate(attention.shared_key(k_pe), cos, sin)  # [s, b, 1, pos]
    latents = cache.append(torch.cat([c_kv, k_pe[:, :, 0]], dim=-1))  # [past + s, b, kvl + pos]
    c_kv_all, k_pe_all = latents.split([c_kv.shape[-1], k_pe.shape[-1]], dim=-1)
    k, v = attention.keys_values(c_kv_all, k_pe_all.unsqueeze(2))
    return attention.queries(q_in, cos, sin), k, v
