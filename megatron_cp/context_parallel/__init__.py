"""Context parallelism: sequence partition, ring / Ulysses / hybrid / all-gather attention.

The model calls :class:`ContextParallelAttention` (or :func:`local_attention` without CP);
the data path splits microbatches with ``megatron_cp.data.microbatch.prepare_microbatch``.
The pieces: attention.py (dispatcher), ring.py, ulysses.py, all_gather.py (communication),
blockwise.py (one block: dense or segment plan, log-sum-exp merge), segments.py (the
per-document segment planner), layout.py (a microbatch's metadata and plans, worked out once
before the layers), kernels.py / cuda_kernels.py (the kernels of each device
behind an explicit :class:`AttentionKernel` choice), dropout.py (attention dropout with a
hash mask that every layout draws identically), local.py (no CP), reference.py (the fp32
truth), partition.py and comm.py.
"""
from megatron_cp.context_parallel.all_gather import all_gather_attention
from megatron_cp.config.parallel import COMM_TYPES, resolve_comm_type
from megatron_cp.context_parallel.attention import ContextParallelAttention, context_parallel_attention
from megatron_cp.context_parallel.blockwise import (Block, block_backward, block_forward,
                                                    masked_attention, merge_partial)
from megatron_cp.context_parallel.dropout import AttentionDropout, dropout_key, keep_mask
from megatron_cp.config.model import KERNEL_NAMES
from megatron_cp.context_parallel.kernels import AttentionKernel, attention_kernel
from megatron_cp.context_parallel.local import local_attention
from megatron_cp.context_parallel.partition import (zigzag_all_gather, zigzag_gather,
                                                    zigzag_indices, zigzag_split)
from megatron_cp.context_parallel.reference import attention_mask, reference_attention
from megatron_cp.context_parallel.ring import ring_attention
from megatron_cp.context_parallel.segments import classify_block, plan_segments
from megatron_cp.context_parallel.ulysses import plan_heads, ulysses_attention

__all__ = [
    "COMM_TYPES", "KERNEL_NAMES", "AttentionDropout", "AttentionKernel", "Block",
    "ContextParallelAttention", "all_gather_attention", "attention_kernel", "attention_mask",
    "block_backward", "block_forward", "classify_block", "context_parallel_attention",
    "dropout_key", "keep_mask", "local_attention",
    "masked_attention", "merge_partial", "plan_heads", "plan_segments", "reference_attention",
    "resolve_comm_type", "ring_attention", "ulysses_attention", "zigzag_all_gather",
    "zigzag_gather", "zigzag_indices", "zigzag_split",
]
