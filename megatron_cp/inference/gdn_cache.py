"""The recurrent cache of a Gated DeltaNet layer for incremental decoding.

A GDN layer needs no keys and values of past tokens: everything later tokens read of the
past is the causal conv's tail (the last ``w - 1`` inputs of its q/k/v channels, w =
--linear-conv-kernel-dim) and the gated delta rule's state (fp32, one [dk, dv] matrix per
value head). The prompt's forward fills both, each new token updates them, so the cache has
the same size at every length. It sits beside the attention layers' key/value caches in
:class:`megatron_cp.inference.kv_cache.KVCache`; the layer's own modules and weights do the
work (:meth:`megatron_cp.model.gated_delta_net.GatedDeltaNet.continue_sequence`).
"""


class GatedDeltaLayerCache:
    """Conv tail [b, channels/tp, w-1] and fp32 state [b, nv/tp, dk, dv] of one GDN layer
    after the ``length`` tokens seen so far (None before the prompt)."""

    def __init__(self):
        self.length = 0
        self.conv_tail = self.state = None

    def continue_sequence(self, layer, x):
        """``layer`` (a GatedDeltaNet) on the new tokens x [s, b, h] after those cached ->
        [s, b, h]; the cache then holds the tail and state after them."""
        out, self.conv_tail, self.state = layer.continue_sequence(x, self.conv_tail, self.state)
        self.length += x.shape[0]
        return out
