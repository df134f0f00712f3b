"""The parallel layout's rules that the model config checks too: context parallelism's
communication types and the hierarchical (Ulysses x ring) CP sizes."""
import math


def check_hierarchical_sizes(hierarchical_sizes, context_parallel_size):
    """The hierarchical CP sizes (U, R) as a tuple of ints; ValueError unless there are two,
    each >= 1, whose product is ``context_parallel_size`` (e.g. (2, 4): inner a2a over 2 ranks
    x outer p2p ring over 4 = CP 8)."""
    sizes = tuple(int(size) for size in hierarchical_sizes)
    if len(sizes) != 2:
        raise ValueError(f"hierarchical_context_parallel_sizes {list(sizes)} must be two sizes, "
                         f"U (inner a2a) and R (outer p2p), with U x R = context_parallel_size "
                         f"({context_parallel_size})")
    product = sizes[0] * sizes[1]
    if min(sizes) < 1 or product != context_parallel_size:
        raise ValueError(f"hierarchical_context_parallel_sizes {list(sizes)} multiply to {product}, "
                         f"not context_parallel_size ({context_parallel_size}); give sizes >= 1 "
                         f"whose product is {context_parallel_size}")
    return sizes


COMM_TYPES = ("p2p", "a2a", "a2a+p2p", "all_gather", "auto")


def resolve_comm_type(comm_type, num_kv_heads, cp_size, hierarchical_sizes=None):
    """(comm type, (U, R) or None) actually used; "auto" picks U = gcd(num_kv_heads, cp_size).

    auto: pure a2a when U == cp_size, pure p2p when U == 1, else a2a+p2p with (U, cp/U).
    The one rule for which hierarchical CP groups a model needs: the trainer calls it before
    ``initialize_model_parallel`` builds them, each attention layer when it is built.
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
    return "a2a+p2p", check_hierarchical_sizes(hierarchical_sizes, cp_size)
