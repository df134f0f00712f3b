"""The entry point the model's attention calls: ``context_parallel_attention``.

It validates the inputs (every user error is raised before any communication), resolves
the communication type (Megatron's --cp-comm-type names: p2p, a2a, a2a+p2p, all_gather,
plus auto) and dispatches to ring / Ulysses / hybrid / all-gather attention. A CP group of
size 1 (or None) runs plain local attention.
"""
import math

from megatron_cp.context_parallel import block_attention as blocks
from megatron_cp.context_parallel import comm
from megatron_cp.context_parallel.all_gather import all_gather_attention
from megatron_cp.context_parallel.ring import ring_attention
from megatron_cp.context_parallel.ulysses import plan_heads, ulysses_attention

COMM_TYPES = ("p2p", "a2a", "a2a+p2p", "all_gather", "auto")


def resolve_comm_type(comm_type, num_kv_heads, cp_size, hierarchical_sizes=None):
    """(comm type, (U, R) or None) actually used; "auto" picks U = gcd(num_kv_heads, cp_size).

    auto: pure a2a when U == cp_size, pure p2p when U == 1, else a2a+p2p with (U, cp/U).
    Call it at model build time to know which hierarchical groups to build.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp comm type {comm_type!r} is unknown; use one of {list(COMM_TYPES)}")
    if comm_type == "auto":
        inner = math.gcd(num_kv_heads, cp_size)
        if inner == cp_size:
            return "a2a", None
        if inner == 1:
            return "p2p", None
        return "a2a+p2p", (inner, cp_size // inner)
    if comm_type != "a2a+p2p":
        return comm_type, None
    if hierarchical_sizes is None or len(hierarchical_sizes) != 2:
        raise ValueError(f"--cp-comm-type a2a+p2p needs hierarchical_sizes (U, R) with U x R = "
                         f"cp size ({cp_size}); got {hierarchical_sizes}")
    inner, outer = (int(size) for size in hierarchical_sizes)
    if inner < 1 or outer < 1 or inner * outer != cp_size:
        raise ValueError(f"hierarchical_sizes (U={inner}, R={outer}) multiply to {inner * outer}, "
                         f"but the context parallel size is {cp_size}; give U x R = {cp_size}")
    return "a2a+p2p", (inner, outer)


def _check_inputs(q, k, v, token_index, document_ids):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, heads, s_local, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, nh, s, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (s, d):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [b={b}, nkv, s={s}, "
                         f"d={d}] to match q {tuple(q.shape)}")
    if nh % k.shape[1] != 0:
        raise ValueError(f"query heads ({nh}) must be a multiple of KV heads ({k.shape[1]})")
    for name, meta in (("token_index", token_index), ("document_ids", document_ids)):
        if meta is not None and tuple(meta.shape) != (b, s):
            raise ValueError(f"{name} must be [b={b}, s_local={s}]; got {tuple(meta.shape)}")
    if token_index is None:
        raise ValueError("token_index is required with context parallelism; take it from "
                         "partition_batch(...)['token_index']")


def context_parallel_attention(q, k, v, token_index, document_ids, cp_group, comm_type,
                               softmax_scale=None, hierarchical_sizes=None,
                               allow_dummy_heads=True):
    """Causal (and document-masked) attention of a sequence sharded over ``cp_group``.

    q: [b, nh, s_local, d]; k, v: [b, nkv, s_local, d] (nh % nkv == 0, GQA: KV heads are
    never repeated before communication except where an all-to-all needs it);
    token_index: [b, s_local] int64, each token's index in the full padded sample
    (causality: token_index_q >= token_index_k); document_ids: [b, s_local] or None (a query
    sees only keys of its own document; rows that see no key give 0). comm_type: "p2p"
    (ring), "a2a" (Ulysses), "a2a+p2p" (Ulysses over U consecutive CP ranks, ring over the
    R ranks with equal cp_rank % U; hierarchical_sizes=(U, R)), "all_gather" or "auto".
    Returns [b, nh, s_local, d] in q's dtype. Forward and backward are those of the chosen
    method (custom autograd Functions); gradients flow to q, k and v.
    """
    cp_size = comm.group_size(cp_group)
    if cp_size == 1:
        return blocks.local_attention(q, k, v, token_index, document_ids, softmax_scale)
    _check_inputs(q, k, v, token_index, document_ids)
    method, sizes = resolve_comm_type(comm_type, k.shape[1], cp_size, hierarchical_sizes)
    if method == "a2a":
        plan_heads(q.shape[1], k.shape[1], cp_size, allow_dummy_heads)
    elif method == "a2a+p2p":
        plan_heads(q.shape[1], k.shape[1], sizes[0], allow_dummy_heads)

    if method == "p2p":
        return ring_attention(q, k, v, token_index, document_ids, cp_group, softmax_scale)
    if method == "all_gather":
        return all_gather_attention(q, k, v, token_index, document_ids, cp_group, softmax_scale)
    if method == "a2a":
        return ulysses_attention(q, k, v, token_index, document_ids, cp_group, softmax_scale,
                                 allow_dummy_heads)
    inner_group, outer_group = comm.hierarchical_groups(cp_group, *sizes)

    def ring_over_outer(q_, k_, v_, tokens, docs, scale):
        return ring_attention(q_, k_, v_, tokens, docs, outer_group, scale)

    return ulysses_attention(q, k, v, token_index, document_ids, inner_group, softmax_scale,
                             allow_dummy_heads, inner_attention=ring_over_outer)
