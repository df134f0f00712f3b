"""Context parallelism: sequence partition, ring / Ulysses / hybrid / all-gather attention.

The model calls :func:`context_parallel_attention`; the data path splits microbatches with
``megatron_cp.data.microbatch.prepare_microbatch``. See attention.py for the dispatcher and ring.py, ulysses.py,
all_gather.py, block_attention.py, partition.py, comm.py for the pieces.
"""
from megatron_cp.context_parallel.all_gather import all_gather_attention
from megatron_cp.context_parallel.attention import (COMM_TYPES, ContextParallelAttention,
                                                    context_parallel_attention, resolve_comm_type)
from megatron_cp.context_parallel.block_attention import (attention_mask, block_backward,
                                                          block_forward, local_attention,
                                                          masked_attention, merge_partial,
                                                          reference_attention, use_block_kernel)
from megatron_cp.context_parallel.partition import (zigzag_all_gather, zigzag_gather,
                                                    zigzag_indices, zigzag_split)
from megatron_cp.context_parallel.ring import ring_attention
from megatron_cp.context_parallel.ulysses import plan_heads, ulysses_attention

__all__ = [
    "COMM_TYPES", "ContextParallelAttention", "all_gather_attention", "attention_mask",
    "block_backward", "block_forward", "context_parallel_attention", "local_attention",
    "masked_attention", "merge_partial", "plan_heads", "reference_attention",
    "resolve_comm_type", "ring_attention", "ulysses_attention", "use_block_kernel",
    "zigzag_all_gather", "zigzag_gather", "zigzag_indices", "zigzag_split",
]
