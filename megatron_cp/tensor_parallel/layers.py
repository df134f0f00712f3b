"""Tensor-parallel layers: column / row parallel linears and the vocab-parallel embedding.

Each layer initializes the FULL weight from its own seed and keeps its TP slice, so a TP=N
model holds exactly the weights of the TP=1 model, whatever the layout (:func:`drawn_weight`,
which --init-model-with-meta-device defers to distributed/meta_init.py). Sharded params
carry ``tensor_model_parallel = True`` and ``partition_dim``; replicated params whose
gradient differs across TP ranks under sequence parallelism carry ``sequence_parallel``.
"""
import math
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_cp.distributed.meta_init import drawn_parameter
from megatron_cp.fp8.linear import fp8_linear
from megatron_cp.tensor_parallel import mappings
from megatron_cp.tensor_parallel.overlap import ColumnParallelOverlap, RowParallelOverlap


def normal_init(std):
    """init_method(tensor, generator): N(0, std) drawn from ``generator``."""
    def init(tensor, generator):
        with torch.no_grad():
            tensor.normal_(0.0, std, generator=generator)
    return init


def real_rows_init(init_method, num_rows):
    """init_method for a vocabulary-padded weight: draw the unpadded ``[num_rows, ...]``
    weight from the generator, then zero the padding rows.

    The real rows are then the same whatever the padding (which grows with the TP size),
    and the padded rows start, and stay, zero (they get no gradient: see
    :func:`mask_padded_vocab`).
    """
    def init(tensor, generator):
        real = torch.empty((num_rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
        init_method(real, generator)
        with torch.no_grad():
            tensor.zero_()
            tensor[:num_rows].copy_(real)
    return init


def mask_padded_vocab(logits, vocab_size, tp_group):
    """Vocab-parallel logits [s, b, v/tp] with the padded vocabulary entries set to -inf.

    Padding rows exist only to make the vocabulary divide over TP; as -inf they take no
    part in the softmax (so the loss does not depend on the padding) and get no gradient.
    """
    tp_size, tp_rank = _group_size_rank(tp_group)
    local = logits.shape[-1]
    start = tp_rank * local
    if start + local <= vocab_size:
        return logits
    padded = torch.arange(start, start + local, device=logits.device) >= vocab_size  # [v/tp]
    return logits.masked_fill(padded, float("-inf"))


def _group_size_rank(group):
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def split_full(full, dim, stride, tp_size, tp_rank):
    """This rank's shard of a full weight along ``dim``.

    ``stride`` > 1 means the full dim stacks ``stride`` sub-matrices (e.g. SwiGLU's gate and
    up projections), each split over TP separately.
    """
    full = full.movedim(dim, 0)  # [n, ...]
    n = full.shape[0]
    parts = full.reshape(stride, tp_size, n // (stride * tp_size), *full.shape[1:])
    return parts[:, tp_rank].reshape(n // tp_size, *full.shape[1:]).movedim(0, dim)


def merge_shards(shards, dim, stride=1):
    """Inverse of :func:`split_full`: the full weight from every rank's shard, in TP order."""
    moved = [s.movedim(dim, 0) for s in shards]  # each [n/tp, ...]
    per = moved[0].shape[0] // stride
    pieces = [m.reshape(stride, per, *m.shape[1:]) for m in moved]
    full = torch.stack(pieces, dim=1)  # [stride, tp, n/(stride*tp), ...]
    return full.reshape(-1, *moved[0].shape[1:]).movedim(0, dim)


def _full_then_split(shape, dim, stride, tp_size, tp_rank, init_method, seed, dtype, device):
    """Draw the full weight on CPU from ``seed``, then keep this rank's slice along ``dim``."""
    full = torch.empty(shape, dtype=torch.float32)
    init_method(full, torch.Generator().manual_seed(seed))
    local = split_full(full, dim, stride, tp_size, tp_rank)
    return local.to(dtype=dtype, device=device).contiguous()


def drawn_weight(shape, init_method, seed, dtype, device, dim=0, stride=1, tp_size=1,
                 tp_rank=0):
    """The parameter of this rank's TP slice along ``dim`` (the whole weight with
    ``tp_size`` 1) of the full ``shape`` weight drawn from ``seed``; built on the meta device
    (``with torch.device("meta")``), drawn later by :func:`~megatron_cp.distributed.meta_init.
    materialize`, bit for bit the same."""
    return drawn_parameter(partial(_full_then_split, shape, dim, stride, tp_size, tp_rank,
                                   init_method, seed, dtype), device)


def _linear(layer, x, bias):
    """``F.linear(x, layer.weight, bias)``, in FP8 when the layer has an ``fp8_meta``
    (:func:`megatron_cp.fp8.attach_fp8`)."""
    if layer.fp8_meta is not None:
        return fp8_linear(x, layer.weight, bias, layer.fp8_meta)
    return F.linear(x, layer.weight, bias)


def _mark(param, dim, stride=1):
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split along its output dim over TP.

    Input [s(/tp with SP), b, in] -> output [s, b, out/tp] (or [s, b, out] with gather_output).
    With sequence parallelism the input is all-gathered along s first; ``tp_comm_overlap`` (a
    :class:`~megatron_cp.tensor_parallel.overlap.TPCommOverlap`, SP only) overlaps that
    all-gather and the backward's reduce-scatter with the GEMMs. ``fp8_meta``: set by
    :func:`megatron_cp.fp8.attach_fp8` to run the GEMMs in FP8.
    """

    def __init__(self, input_size, output_size, *, tp_group, init_method, seed, bias=True,
                 gather_output=False, sequence_parallel=False, skip_bias_add=False, stride=1,
                 params_dtype=torch.float32, device=None, tp_comm_overlap=None):
        super().__init__()
        tp_size, tp_rank = _group_size_rank(tp_group)
        if output_size % (tp_size * stride) != 0:
            raise ValueError(f"output size ({output_size}) must be divisible by the tensor parallel "
                             f"size ({tp_size}) x stride ({stride})")
        if gather_output and stride > 1:
            raise ValueError("gather_output=True would interleave the stacked sub-matrices of "
                             f"stride {stride}; gather and merge_shards the output instead")
        self.tp_group, self.gather_output = tp_group, gather_output
        self.sequence_parallel, self.skip_bias_add = sequence_parallel and tp_size > 1, skip_bias_add
        self.tp_comm_overlap = tp_comm_overlap if self.sequence_parallel else None
        self.fp8_meta = None
        self.weight = drawn_weight((output_size, input_size), init_method, seed, params_dtype,
                                   device, 0, stride, tp_size, tp_rank)
        _mark(self.weight, 0, stride)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size // tp_size, dtype=params_dtype,
                                                       device=device))
            _mark(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        bias = None if self.skip_bias_add else self.bias
        if self.tp_comm_overlap is not None:  # [s/tp, b, in] -> [s, b, out/tp]
            out = ColumnParallelOverlap.apply(x, self.weight, bias, self.tp_group,
                                              self.tp_comm_overlap)
        else:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)  # [s, b, in]
            else:
                x = mappings.copy_to_tensor_model_parallel_region(x, self.tp_group)
            out = _linear(self, x, bias)  # [s, b, out/tp]
        if self.gather_output:
            out = mappings.gather_from_tensor_model_parallel_region(out, self.tp_group)
        return (out, self.bias) if self.skip_bias_add else out


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split along its input dim over TP.

    Input [s, b, in/tp] -> partial products summed over TP -> [s, b, out]; with sequence
    parallelism the sum is a reduce-scatter to [s/tp, b, out], which ``tp_comm_overlap`` (SP
    only) overlaps with the GEMM. The bias is added after the reduction (so once).
    """

    def __init__(self, input_size, output_size, *, tp_group, init_method, seed, bias=True,
                 input_is_parallel=True, sequence_parallel=False, skip_bias_add=False,
                 params_dtype=torch.float32, device=None, tp_comm_overlap=None):
        super().__init__()
        tp_size, tp_rank = _group_size_rank(tp_group)
        if input_size % tp_size != 0:
            raise ValueError(f"input size ({input_size}) must be divisible by the tensor parallel "
                             f"size ({tp_size})")
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.sequence_parallel, self.skip_bias_add = sequence_parallel and tp_size > 1, skip_bias_add
        self.tp_comm_overlap = tp_comm_overlap if self.sequence_parallel else None
        self.fp8_meta = None
        self.weight = drawn_weight((output_size, input_size), init_method, seed, params_dtype,
                                   device, 1, 1, tp_size, tp_rank)
        _mark(self.weight, 1)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, self.tp_group)
        if self.tp_comm_overlap is not None:  # [s, b, in/tp] -> [s/tp, b, out]
            out = RowParallelOverlap.apply(x, self.weight, self.tp_group, self.tp_comm_overlap)
        else:
            partial = _linear(self, x, None)  # [s, b, out], partial sum over TP
            if self.sequence_parallel:
                out = mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
            else:
                out = mappings.reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding with the vocabulary split over TP ranks.

    tokens [b, s] -> [s, b, h] (or [s/tp, b, h] with reduce_scatter_output for SP). Each rank
    looks up only its vocab range, zeros the rest, and the partial lookups are summed over TP.
    """

    def __init__(self, num_embeddings, embedding_dim, *, tp_group, init_method, seed,
                 reduce_scatter_output=False, params_dtype=torch.float32, device=None):
        super().__init__()
        tp_size, tp_rank = _group_size_rank(tp_group)
        if num_embeddings % tp_size != 0:
            raise ValueError(f"vocab size ({num_embeddings}) must be divisible by the tensor parallel "
                             f"size ({tp_size}); pad it with --make-vocab-size-divisible-by")
        self.tp_group, self.reduce_scatter_output = tp_group, reduce_scatter_output and tp_size > 1
        self.weight = drawn_weight((num_embeddings, embedding_dim), init_method, seed,
                                   params_dtype, device, 0, 1, tp_size, tp_rank)
        _mark(self.weight, 0)

    def forward(self, tokens):
        return vocab_parallel_embedding(tokens, self.weight, self.tp_group,
                                        self.reduce_scatter_output)


def vocab_parallel_embedding(tokens, weight, tp_group, reduce_scatter_output=False):
    """tokens [b, s] -> [s, b, h] (``[s/tp, b, h]`` with ``reduce_scatter_output``, for SP)
    through ``weight`` [v/tp, h], this TP rank's rows of a vocab-parallel table: each rank
    looks up its own vocabulary range, zeros the rest, and the lookups are summed over TP.
    The embedding layer runs it, and so do the MTP layers of a last pipeline stage that
    holds the tied table only as its output layer."""
    tp_size, tp_rank = _group_size_rank(tp_group)
    if tp_size > 1:
        start = tp_rank * weight.shape[0]
        outside = (tokens < start) | (tokens >= start + weight.shape[0])
        local = (tokens - start).masked_fill(outside, 0)
    else:
        local = tokens
    emb = F.embedding(local, weight)  # [b, s, h]
    if tp_size > 1:
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
    emb = emb.transpose(0, 1).contiguous()  # [s, b, h]
    if reduce_scatter_output and tp_size > 1:
        return mappings.reduce_scatter_to_sequence_parallel_region(emb, tp_group)  # [s/tp, b, h]
    return mappings.reduce_from_tensor_model_parallel_region(emb, tp_group)


def scaled_init_std(std, num_layers):
    """Megatron's std for output projections of residual branches: std / sqrt(2 * num_layers)."""
    return std / math.sqrt(2.0 * num_layers)
