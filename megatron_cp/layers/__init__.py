"""Building blocks that model/ and moe/ (and context_parallel/'s state passing) share, so no two
of those packages import each other: the dense MLP, the norms, rotary embeddings, hidden
dropout and its counter-based hash, the chunked gated delta rule kernel, activation offload,
and the one import point of optional accelerators (apex, Transformer Engine, FLA)."""
