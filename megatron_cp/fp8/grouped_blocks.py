"""The routed experts' grouped GEMMs under the block recipes (``--fp8-recipe blockwise`` and
``mxfp8``, megatron_cp/fp8/blocks.py), as Transformer Engine's GroupedLinear runs them:
each local expert's GEMMs from its own block-scaled copies.

- fprop ``y = x W_e^T`` and dgrad ``dx = dy W_e``: x and dy in 1 x L blocks along the
  contracted dim (rowwise), each block within one row, so any order of the rows, on any
  rank, quantizes as one process: no amax crosses ranks;
- each expert's weight in blocks of its own (blockwise: 128 x 128 and its transpose; mxfp8:
  1 x 32 along each dim); an expert-TP shard holds whole blocks (config/fp8.py
  check_block_experts refuses the others), so its blocks are the whole weight's;
- wgrad ``dW_e = dy_e^T x_e``: x and dy quantized again in blocks of L consecutive rows of
  the expert's GEMM (columnwise). One process runs each microbatch alone, so those blocks
  are the rows of *one microbatch* routed to the expert, in its token order: here each run
  of :class:`~megatron_cp.fp8.grouped.ExpertRows` (one expert, one microbatch class) is one
  such GEMM, and :func:`check_source_order` makes sure a run's rows are in that order.

Row order. The dispatcher lays an expert's rows out source after source. Under EP over DP
each source is one microbatch (its own class), its rows in its own token order: exact. Under
EP over TP (+SP) the sources of one microbatch hold contiguous pieces of its ``[s * b]`` token
rows (TP rank r the r-th piece): exact when a class's sources come one after another in piece
order, which the alltoall dispatcher arranges (sources sorted by (class, piece)) and
:func:`check_source_order` checks at the first dispatch (the allgather dispatcher takes them
in rank order). CP's zigzag chunks interleave a sample's positions: refused at start-up.

Rows that routing padding added (probability 0, output gradient exactly 0) add nothing to
``dW`` and are left out of the columnwise copies, so the blocks are the unpadded rows'.
"""
import math

import torch

from megatron_cp.fp8.blocks import Blocked, block_matmul, quantize_1d
from megatron_cp.fp8.linear import GRAD_OUTPUT, INPUT, WEIGHT


def check_source_order(source_class, source_piece):
    """Refuse a layout whose sources (in the dispatcher's order, ``source_class`` their
    microbatch class, ``source_piece`` which piece of that microbatch's tokens each holds)
    would not give each class's rows in one process's token order: one class's sources
    must come one after another, their pieces increasing."""
    pairs = list(zip(source_class, source_piece))
    starts = [c for i, (c, _) in enumerate(pairs) if i == 0 or pairs[i - 1][0] != c]
    ascending = all(a[1] < b[1] for a, b in zip(pairs, pairs[1:]) if a[0] == b[0])
    if len(starts) != len(set(starts)) or not ascending:
        raise ValueError(f"block-scaled FP8 experts: the sources' (microbatch class, token "
                         f"piece) order {pairs} does not give one process's token order; use "
                         f"--fp8-recipe tensorwise or an EP layout over DP or TP ranks in rank "
                         f"order")


def _rows(blocked, start, n):
    """Rows [start, start + n) of a rowwise Blocked (its 1 x L blocks lie within rows)."""
    end = start + n
    return Blocked(blocked.data[start:end], blocked.scale[start:end], blocked.amax[start:end],
                   blocked.block)


def _columnwise(meta, t, start, n, real, dtype):
    """The wgrad copy of rows [start, start + n) of ``t`` [N, c] (routing padding's rows
    left out): [c, real rows] in blocks of L rows from the run's first."""
    part = t[start:start + n]  # [n, c]
    if real is not None:
        part = part[real[start:start + n]]  # [real rows, c]
    return quantize_1d(part.t(), meta.blocks.length, dtype, meta.blocks.name)


def _record(meta, role, e, blocked):
    """The smallest nonzero block amax of local expert ``e``'s ``role`` copy, as
    Fp8Meta.record_blocks keeps for a linear (``step_amax`` starts at inf)."""
    if meta.training and blocked.amax.numel():
        smallest = torch.where(blocked.amax > 0, blocked.amax, math.inf).amin()
        entry = meta.step_amax[meta.local.start + e, role]  # a view
        entry.copy_(torch.minimum(entry, smallest))


class _GroupedBlockMatmul(torch.autograd.Function):
    """forward: ``x`` [N, k] (rows laid out as ``rows``), ``weight`` [E_local, n, k] -> each
    run's ``x W_e^T`` [N, n] from block-scaled copies. backward: each run's ``dx = q(dy)
    q(W_e)``; ``dW_e`` the sum over its runs of ``q'(dy)^T q'(x)`` (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, meta, rows):
        recipe, spans, real = meta.blocks, rows.spans(), rows.real
        x_row = quantize_1d(x, recipe.length, meta.fwd_dtype, recipe.name)  # [N, k]
        weights = [recipe.weight(w, meta.fwd_dtype) for w in weight]  # (fprop [n, k], dgrad [k, n])
        for e, (_, dgrad) in enumerate(weights):
            _record(meta, WEIGHT, e, dgrad)
        parts = [block_matmul(_rows(x_row, start, n), weights[e][0], x.dtype)
                 for e, start, n in spans]  # [n_run, n] each
        out = torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])  # [N, n]
        if meta.wgrad_fp8:
            ctx.x_cols = [_columnwise(meta, x, start, n, real, meta.fwd_dtype)
                          for _, start, n in spans]  # [k, real rows of the run] each
            for (e, _, _), col in zip(spans, ctx.x_cols):
                _record(meta, INPUT, e, col)
            ctx.save_for_backward()
        else:
            for e, start, n in spans:
                _record(meta, INPUT, e, _rows(x_row, start, n))
            ctx.save_for_backward(x)
        ctx.meta, ctx.rows, ctx.w_dgrad = meta, rows, [dgrad for _, dgrad in weights]
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x.dtype, weight.dtype, weight.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        meta, spans, real = ctx.meta, ctx.rows.spans(), ctx.rows.real
        recipe = meta.blocks
        g_row = quantize_1d(grad_out, recipe.length, meta.bwd_dtype, recipe.name)  # [N, n]
        grad_x = [block_matmul(_rows(g_row, start, n), ctx.w_dgrad[e], ctx.x_dtype)
                  for e, start, n in spans]  # [n_run, k] each
        grad_x = torch.cat(grad_x) if grad_x else grad_out.new_zeros(
            0, ctx.w_shape[2], dtype=ctx.x_dtype)  # [N, k]
        grad_w = torch.zeros(ctx.w_shape, dtype=torch.float32, device=grad_out.device)
        for i, (e, start, n) in enumerate(spans):
            if meta.wgrad_fp8:
                g_col = _columnwise(meta, grad_out, start, n, real, meta.bwd_dtype)  # [n, m]
                _record(meta, GRAD_OUTPUT, e, g_col)
                if g_col.data.shape[1]:
                    grad_w[e] += block_matmul(g_col, ctx.x_cols[i], torch.float32)  # [n, k]
            else:
                _record(meta, GRAD_OUTPUT, e, _rows(g_row, start, n))
                x, = ctx.saved_tensors
                grad_w[e] += grad_out[start:start + n].t().float() @ \
                    x[start:start + n].float()  # [n, k]
        ctx.x_cols = ctx.w_dgrad = None
        return grad_x, grad_w.to(ctx.w_dtype), None, None


def grouped_block_linear(x, weight, meta, rows):
    """Rows of ``x`` [N, in] laid out as ``rows`` times each expert's ``weight`` [E_local,
    out, in]^T under a block recipe (``meta.blocks``) -> [N, out]."""
    return _GroupedBlockMatmul.apply(x, weight, meta, rows)
