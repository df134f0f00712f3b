"""Tensor-parallel communication overlapped with the linear layers' GEMMs (--tp-comm-overlap).

Under sequence parallelism a column-parallel linear all-gathers its input [s/tp, b, h] before
its GEMM, and a row-parallel linear reduce-scatters its output after its GEMM. Megatron-LM
hides these collectives behind the GEMMs with Transformer Engine's userbuffers; here the same
decomposition ("collective matmul") is written in PyTorch on the TP group's point-to-point
sends, with the ring of the context-parallel attention (:class:`RingExchange`):

- all-gather side (:func:`ring_gather_apply`): the sequence chunks travel around the TP ring;
  while a chunk is in flight, the GEMM of the chunk in hand writes its rows of the output. Each
  row is the same GEMM row as in one big GEMM, so the output is the plain path's.
- reduce-scatter side (:func:`ring_reduce_scatter`): each rank computes its partial product for
  one output chunk at a time and adds it to the running sum received from the previous rank,
  while that sum travels on. The terms of a sum are added in ring order, not in the
  collective's order: equal to fp32 rounding.

Which collective is overlapped follows Megatron-LM's flags (:class:`TPCommOverlap`):
``ag`` the column-parallel forward all-gather and the row-parallel backward all-gather of the
output gradient; ``rs`` the row-parallel forward reduce-scatter; ``rs_dgrad`` the
column-parallel backward reduce-scatter of the input gradient, pipelined with the chunks of the
dgrad GEMM. Without ``rs_dgrad`` the column-parallel backward overlaps in bulk: ``bulk_dgrad``
re-gathers the input (saved as this rank's chunk only) while the dgrad GEMM runs, and
``bulk_wgrad`` reduce-scatters the input gradient while the wgrad GEMM runs.

On CPU (gloo) the sends are asynchronous but gain little speed; what the tests show there is
that the results are the plain path's. On GPU (NCCL) the sends run on the side stream of
:mod:`megatron_cp.distributed.device` and overlap the GEMMs: written for it, untested on a GPU so far.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_cp.distributed.ring_exchange import RingExchange
from megatron_cp.distributed.compat import all_gather_flat, reduce_scatter_flat

_TAG = 7100  # keeps these rings' gloo messages apart from other point-to-point traffic


@dataclass(frozen=True)
class TPCommOverlap:
    """Which TP collectives overlap a GEMM (Megatron-LM's --tp-comm-overlap-* flags)."""
    ag: bool = True
    rs: bool = True
    rs_dgrad: bool = False
    bulk_dgrad: bool = True
    bulk_wgrad: bool = True


def overlap_from_config(config):
    """The :class:`TPCommOverlap` a model config asks for (None: --tp-comm-overlap is off)."""
    if not config.tp_comm_overlap:
        return None
    return TPCommOverlap(ag=config.tp_comm_overlap_ag, rs=config.tp_comm_overlap_rs,
                         rs_dgrad=config.tp_comm_overlap_rs_dgrad,
                         bulk_dgrad=config.tp_comm_bulk_dgrad,
                         bulk_wgrad=config.tp_comm_bulk_wgrad)


def ring_gather_apply(local, group, consume):
    """Visit every TP rank's sequence chunk ``local`` [s/tp, ...], starting with this rank's
    own and then the previous ranks' around the ring: ``consume(source_rank, chunk)`` runs
    while the next chunk is on its way."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ring = RingExchange(group, local.device, tag=_TAG)
    chunk = local
    for step in range(size):
        if step + 1 < size:
            ring.post([chunk])
        consume((rank - step) % size, chunk)
        if step + 1 < size:
            (chunk,) = ring.wait()


def ring_reduce_scatter(partial, group, device):
    """The sum over the TP ranks of ``partial(rank)`` for this rank's chunk, where each rank
    computes ``partial(c)`` ([s/tp, ...], its term for chunk ``c``) for every chunk: the sum
    for chunk ``c`` starts at rank c+1 and gathers one term per hop, each computed while the
    previous hop's sum travels."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ring = RingExchange(group, device, tag=_TAG + 1)
    # at step k this rank adds its term for chunk rank-k-1: the chunk whose sum arrives now
    total = partial((rank - 1) % size)
    for step in range(1, size):
        ring.post([total])
        mine = partial((rank - step - 1) % size)
        (total,) = ring.wait()
        total = total + mine
    return total


def _gather(local, group, async_op=False):
    size = dist.get_world_size(group)
    out = torch.empty((local.shape[0] * size,) + tuple(local.shape[1:]), dtype=local.dtype,
                      device=local.device)
    work = all_gather_flat(out, local.contiguous(), group=group, async_op=async_op)
    return out, work


def _reduce_scatter(full, group, async_op=False):
    size = dist.get_world_size(group)
    out = torch.empty((full.shape[0] // size,) + tuple(full.shape[1:]), dtype=full.dtype,
                      device=full.device)
    work = reduce_scatter_flat(out, full.contiguous(), group=group, async_op=async_op)
    return out, work


def _wgrad(grad, x):
    """grad [n, b, out]^T x [n, b, in] -> [out, in]: a linear's weight gradient."""
    return grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class ColumnParallelOverlap(torch.autograd.Function):
    """Sequence-parallel column-parallel linear with its collectives overlapped.

    Forward: x [s/tp, b, in] all-gathered along s (a ring with ``ag``) into
    F.linear(x_full, W, b) [s, b, out/tp]. Backward: grad_x = reduce-scatter of grad W (a ring
    pipelined with the dgrad chunks with ``rs_dgrad``, else in bulk behind the wgrad GEMM),
    grad_W = grad^T x_full, grad_b = grad summed over s and b.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, overlap):
        size = dist.get_world_size(group)
        chunk = x.shape[0]
        out = x.new_empty((chunk * size,) + tuple(x.shape[1:-1]) + (weight.shape[0],))
        if overlap.ag:
            x_full = x.new_empty((chunk * size,) + tuple(x.shape[1:]))

            def consume(source, piece):  # piece [s/tp, b, in] of rank ``source``
                rows = slice(source * chunk, (source + 1) * chunk)
                out[rows] = F.linear(piece, weight, bias)  # [s/tp, b, out/tp]
                x_full[rows] = piece

            ring_gather_apply(x, group, consume)
        else:
            x_full, _ = _gather(x, group)  # [s, b, in]
            out = F.linear(x_full, weight, bias)  # [s, b, out/tp]
        # the bulk re-gather keeps only this rank's chunk for backward, as Megatron-LM does
        ctx.regather = overlap.bulk_dgrad and not overlap.rs_dgrad
        ctx.save_for_backward(x if ctx.regather else x_full, weight)
        ctx.group, ctx.overlap, ctx.has_bias, ctx.chunk = group, overlap, bias is not None, chunk
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [s, b, out/tp]
        x_saved, weight = ctx.saved_tensors
        group, chunk = ctx.group, ctx.chunk
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        if ctx.overlap.rs_dgrad:
            x_full = x_saved
            grad_weight = torch.zeros_like(weight)

            def partial(c):  # this rank's term of grad_x for chunk c, and its wgrad share
                rows = slice(c * chunk, (c + 1) * chunk)
                grad_weight.add_(_wgrad(grad[rows], x_full[rows]))
                return grad[rows].matmul(weight)  # [s/tp, b, in]

            grad_x = ring_reduce_scatter(partial, group, grad.device)
            return grad_x, grad_weight, grad_bias, None, None
        gather = None
        if ctx.regather:  # the input's all-gather runs behind the dgrad GEMM
            x_full, gather = _gather(x_saved, group, async_op=True)
        else:
            x_full = x_saved
        grad_full = grad.matmul(weight)  # [s, b, in], partial over TP
        if gather is not None:
            gather.wait()
        # the input gradient's reduce-scatter runs behind the wgrad GEMM
        grad_x, scatter = _reduce_scatter(grad_full, group, async_op=ctx.overlap.bulk_wgrad)
        grad_weight = _wgrad(grad, x_full)
        if scatter is not None:
            scatter.wait()
        return grad_x, grad_weight, grad_bias, None, None


class RowParallelOverlap(torch.autograd.Function):
    """Sequence-parallel row-parallel linear (no bias) with its collectives overlapped.

    Forward: x [s, b, in/tp] -> reduce-scatter over TP of x W^T -> [s/tp, b, out] (a ring with
    ``rs``). Backward: the output gradient [s/tp, b, out] all-gathered (a ring with ``ag``:
    each chunk's dgrad rows and wgrad share computed while the next chunk travels).
    """

    @staticmethod
    def forward(ctx, x, weight, group, overlap):
        size = dist.get_world_size(group)
        chunk = x.shape[0] // size
        if overlap.rs:
            out = ring_reduce_scatter(
                lambda c: F.linear(x[c * chunk:(c + 1) * chunk], weight), group, x.device)
        else:
            out, _ = _reduce_scatter(F.linear(x, weight), group)  # [s/tp, b, out]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.overlap, ctx.chunk = group, overlap, chunk
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [s/tp, b, out]
        x, weight = ctx.saved_tensors
        group, chunk = ctx.group, ctx.chunk
        if not ctx.overlap.ag:
            grad_full, _ = _gather(grad, group)  # [s, b, out]
            return grad_full.matmul(weight), _wgrad(grad_full, x), None, None
        grad_x = torch.empty_like(x)  # [s, b, in/tp]
        grad_weight = torch.zeros_like(weight)

        def consume(source, piece):  # piece [s/tp, b, out]: rank ``source``'s output gradient
            rows = slice(source * chunk, (source + 1) * chunk)
            grad_x[rows] = piece.matmul(weight)
            grad_weight.add_(_wgrad(piece, x[rows]))

        ring_gather_apply(grad.contiguous(), group, consume)
        return grad_x, grad_weight, None, None
