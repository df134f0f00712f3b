"""The entry point the model's attention uses: :class:`ContextParallelAttention`.

Built once per attention layer, it resolves the communication type (Megatron's
--cp-comm-type names: p2p, a2a, a2a+p2p, all_gather, plus auto) and checks the heads, so
every user error is raised before any communication; each call validates the inputs and
dispatches to ring / Ulysses / hybrid / all-gather attention with the layer's explicit
kernel choice (:class:`~megatron_cp.context_parallel.kernels.AttentionKernel`).
"""

from megatron_cp.context_parallel import comm
from megatron_cp.context_parallel.all_gather import all_gather_attention
from megatron_cp.context_parallel.kernels import attention_kernel
from megatron_cp.context_parallel.local import local_attention
from megatron_cp.context_parallel.ring import ring_attention
from megatron_cp.context_parallel.ulysses import plan_heads, prepare_head_indices, ulysses_attention
from megatron_cp.config.parallel import resolve_comm_type

class ContextParallelAttention:
    """Causal (and document-masked) attention of a sequence sharded over ``cp_group``, with
    its communication resolved once, when the attention layer is built.

    ``comm_type``: "p2p" (ring), "a2a" (Ulysses), "a2a+p2p" (Ulysses over the inner group,
    ring over the outer one of ``hierarchical_groups``, from ``ParallelState``'s
    ``hcp_inner`` / ``hcp_outer``), "all_gather" or "auto". ``num_heads`` /
    ``num_kv_heads``: this rank's query and KV heads (after the TP split). Every user error
    (unknown type, missing sub-groups, heads that cannot split) is raised here, before any
    communication. A CP group of size 1 (or None) runs plain local attention. ``kernel``:
    "auto" (the device's fused kernels), "torch" (plain PyTorch) or an AttentionKernel.
    """

    def __init__(self, cp_group, comm_type, num_heads, num_kv_heads, hierarchical_groups=None,
                 allow_dummy_heads=True, softmax_scale=None, kernel="auto"):
        self.cp_group, self.softmax_scale = cp_group, softmax_scale
        self.kernel = attention_kernel(kernel)
        self.allow_dummy_heads, self.heads = allow_dummy_heads, (num_heads, num_kv_heads)
        self.cp_size = comm.group_size(cp_group)
        groups = tuple(hierarchical_groups) if hierarchical_groups else None
        sizes = tuple(comm.group_size(g) for g in groups) if groups else None
        self.method, wanted = (None, None) if self.cp_size == 1 else \
            resolve_comm_type(comm_type, num_kv_heads, self.cp_size, sizes)
        self.inner_group = self.outer_group = None
        if self.method == "a2a":
            plan_heads(num_heads, num_kv_heads, self.cp_size, allow_dummy_heads)
        elif self.method == "a2a+p2p":
            if sizes != wanted:
                raise ValueError(
                    f"cp comm type {comm_type!r} runs a2a+p2p with (U, R) = {wanted}, but the "
                    f"hierarchical CP groups given are {sizes}; build the ParallelState with "
                    f"hierarchical_context_parallel_sizes={wanted}")
            plan_heads(num_heads, num_kv_heads, wanted[0], allow_dummy_heads)
            self.inner_group, self.outer_group = groups

    def _ring_over_outer(self, q, k, v, token_index, document_ids, scale, dropout, layout):
        return ring_attention(q, k, v, token_index, document_ids, self.outer_group, scale,
                              self.kernel, dropout, layout)

    def prepare(self, layout, length, device):
        """Work out in ``layout`` (the microbatch's SequenceLayout) what this attention will
        look up: the no-CP plan, the ring view over the CP group (p2p, all_gather), the
        Ulysses view and its inner plan (a2a) or ring view over the outer group (a2a+p2p).
        Collective over the CP group: every rank of it prepares the same attentions in the
        same order."""
        if self.cp_size == 1:
            layout.local(length, device)
        elif self.method in ("p2p", "all_gather"):
            layout.ring(self.cp_group)
        elif self.method == "a2a":
            layout.ulysses(self.cp_group).inner.block_plan(length * self.cp_size, device)
            prepare_head_indices(*self.heads, self.cp_group, self.allow_dummy_heads, device)
        else:
            layout.ulysses(self.inner_group).inner.ring(self.outer_group)
            prepare_head_indices(*self.heads, self.inner_group, self.allow_dummy_heads, device)

    def __call__(self, q, k, v, token_index, document_ids, dropout=None, layout=None):
        """q [b, nh, s_local, d], k/v [b, nkv, s_local, d], token_index [b, s_local] (each
        token's index in the full padded sample), document_ids [b, s_local] or None ->
        [b, nh, s_local, d] in q's dtype; gradients flow to q, k and v. ``dropout``: an
        AttentionDropout (context_parallel.dropout: the same mask under every layout) or
        None. ``layout``: the microbatch's SequenceLayout, prepared by :meth:`prepare`
        before the layers (None: the metadata is gathered and planned in this call)."""
        scale, kernel = self.softmax_scale, self.kernel
        if self.cp_size == 1:
            return local_attention(q, k, v, token_index, document_ids, scale, kernel=kernel,
                                   dropout=dropout, layout=layout)
        _check_inputs(q, k, v, token_index, document_ids, dropout)
        if self.method == "p2p":
            return ring_attention(q, k, v, token_index, document_ids, self.cp_group, scale, kernel,
                                  dropout, layout)
        if self.method == "all_gather":
            return all_gather_attention(q, k, v, token_index, document_ids, self.cp_group, scale,
                                        kernel, dropout, layout)
        if self.method == "a2a":
            return ulysses_attention(q, k, v, token_index, document_ids, self.cp_group, scale,
                                     self.allow_dummy_heads, kernel=kernel, dropout=dropout,
                                     layout=layout)
        return ulysses_attention(q, k, v, token_index, document_ids, self.inner_group, scale,
                                 self.allow_dummy_heads, inner_attention=self._ring_over_outer,
                                 dropout=dropout, layout=layout)


def _check_inputs(q, k, v, token_index, document_ids, dropout):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, heads, s_local, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, nh, s, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[2:] != (s, d):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [b={b}, nkv, s={s}, "
                         f"d={d}] and [b, nkv, s, dv] to match q {tuple(q.shape)}")
    if nh % k.shape[1] != 0:
        raise ValueError(f"query heads ({nh}) must be a multiple of KV heads ({k.shape[1]})")
    positions = None if dropout is None else dropout.positions
    for name, meta in (("token_index", token_index), ("document_ids", document_ids),
                       ("dropout positions", positions)):
        if meta is not None and tuple(meta.shape) != (b, s):
            raise ValueError(f"{name} must be [b={b}, s_local={s}]; got {tuple(meta.shape)}")
    if dropout is not None and (tuple(dropout.samples.shape) != (b,)
                                or tuple(dropout.heads.shape) != (nh,)):
        raise ValueError(f"dropout samples {tuple(dropout.samples.shape)} and heads "
                         f"{tuple(dropout.heads.shape)} must be [b={b}] and [nh={nh}]")
    if token_index is None:
        raise ValueError("token_index is required with context parallelism; take it from "
                         "prepare_microbatch(...)['token_index']")


def context_parallel_attention(q, k, v, token_index, document_ids, cp_group, comm_type,
                               softmax_scale=None, hierarchical_groups=None,
                               allow_dummy_heads=True, kernel="auto", dropout=None):
    """One call of :class:`ContextParallelAttention` (built for these heads and groups);
    a model builds the object once per layer instead."""
    attention = ContextParallelAttention(cp_group, comm_type, q.shape[1], k.shape[1],
                                         hierarchical_groups, allow_dummy_heads, softmax_scale,
                                         kernel)
    return attention(q, k, v, token_index, document_ids, dropout)
