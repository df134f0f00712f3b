"""Tensor (and sequence) parallelism: autograd collectives, parallel layers, loss, RNG."""
from megatron_cp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
from megatron_cp.tensor_parallel.layers import (  # noqa: F401
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, drawn_weight,
    mask_padded_vocab, merge_shards,
    normal_init, real_rows_init, scaled_init_std, split_full,
    vocab_parallel_embedding)
from megatron_cp.tensor_parallel.overlap import TPCommOverlap, overlap_from_config  # noqa: F401
from megatron_cp.tensor_parallel.mappings import (  # noqa: F401
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region)
from megatron_cp.tensor_parallel.tiled_cross_entropy import (  # noqa: F401
    tiled_vocab_parallel_cross_entropy)
from megatron_cp.tensor_parallel.random import (  # noqa: F401
    RNGStatesTracker, checkpoint, init_seed, model_parallel_seed)
from megatron_cp.tensor_parallel.discard_output import DiscardedOutput  # noqa: F401
