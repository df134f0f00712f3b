"""FP8 for the routed experts' grouped GEMMs: each local expert's ``x W_e^T`` from FP8 copies
with a scale of its own, under the tensorwise and delayed recipes (the block recipes:
megatron_cp/fp8/grouped_blocks.py, with the state kept here).

Transformer Engine's GroupedLinear (what Megatron-LM's grouped experts run) keeps one
quantizer per GEMM of the group, that is per local expert, for the input, the weight and the
output gradient; here too every expert has its own three amaxes. The state covers all ``E``
experts of the layer on every rank (each rank fills its local experts' rows, and the delayed
recipe's step end reduces them over the stage), so it is whole everywhere and a checkpoint
stores it like a norm weight, loadable under any EP size.

Layout exactness. One process runs each microbatch alone, so an expert's input (and output
gradient) amax is the max over the rows of *one microbatch* routed to it. Under expert
parallelism an expert's rows arrive from several ranks: TP / CP peers hold pieces of the same
microbatch, DP peers hold other microbatches. The dispatcher therefore names, for each run
of consecutive rows, its *class*: the DP rank of the rank that sent it (:class:`ExpertRows`).
Tensorwise scaling takes the amax per (expert, class), reduced with MAX over every replica of
the local experts in the stage (expert-DP x expert-TP: wherever rows of that microbatch for
that expert went), one class per slot so DP peers' microbatches never mix, and runs one scaled
GEMM per run. An expert's weight amax is its whole weight's (MAX over expert-TP). Delayed
scaling quantizes with the step's per-expert scales; its per-step amax is a max over
everything, so the step end reduces it over the stage (:func:`end_grouped_step`).

Rows marked not real (routing padding for FP8: entries with probability 0, see
megatron_cp/moe/dispatcher.py) are computed but stay out of the input amaxes; their output
gradient is exactly 0.
"""
import math

import torch

from megatron_cp.config.fp8 import BLOCK_LENGTH
from megatron_cp.fp8.blocks import BlockRecipe
from megatron_cp.fp8.grouped_blocks import grouped_block_linear
from megatron_cp.fp8.linear import GRAD_OUTPUT, INPUT, WEIGHT, scaled_matmul
from megatron_cp.fp8.scaling import (FORMATS, delayed_scale, quantize, reduce_max,
                                     scale_from_amax)

class ExpertRows:
    """The rows entering the grouped experts: ``counts[e]`` rows per local expert
    (expert-major); ``runs`` ``[(expert, class, rows)]`` in row order, each a stretch of one
    expert's rows sent by ranks of one microbatch class (the senders' DP rank); ``real``
    bool ``[N]``: the rows that enter the input amaxes (None: all)."""

    def __init__(self, counts, runs=None, real=None):
        self.counts, self.real = list(counts), real
        self.runs = runs if runs is not None else \
            [(e, 0, n) for e, n in enumerate(self.counts) if n]

    def spans(self):
        """``[(expert, start row, rows)]`` of each run."""
        starts, total = [], 0
        for e, _, n in self.runs:
            starts.append((e, total, n))
            total += n
        return starts


def runs_of(by_source, source_class):
    """The runs (:class:`ExpertRows`) of rows laid out expert-major with each expert's rows in
    source order, ``by_source`` ``[S, E_local]`` of them from each source, whose microbatch
    classes are ``source_class`` ``[S]``; adjacent sources of one class merge."""
    runs = []
    for e, column in enumerate(by_source.t().tolist()):
        for cls, n in zip(source_class, column):
            if n and runs and runs[-1][:2] == (e, cls):
                runs[-1] = (e, cls, runs[-1][2] + n)
            elif n:
                runs.append((e, cls, n))
    return runs


class GroupedFp8Meta(torch.nn.Module):
    """The FP8 state of one grouped linear (every expert's fc1 or fc2): per expert of the
    layer and role (input, weight, output gradient) ``step_amax`` / ``last_amax`` ``[E, 3]``,
    as :class:`~megatron_cp.fp8.linear.Fp8Meta` keeps per linear; delayed scaling adds
    ``amax_history`` ``[E, 3, L]`` and ``scale`` ``[E, 3]`` (saved, whole on every rank). This
    rank runs ``local`` (a slice of the E experts). ``groups``: the expert-DP and expert-TP
    groups (every replica of the local experts in the stage); ``num_classes``: the DP size
    (the microbatch classes). Block recipes (``blocks``) keep no scales; their
    ``last_amax`` is each expert's smallest nonzero block amax, as Fp8Meta's."""

    def __init__(self, config, num_experts, local, groups, num_classes):
        super().__init__()
        self.local = local
        self.fwd_dtype, self.bwd_dtype = FORMATS[config.fp8]
        self.delayed = config.fp8_recipe == "delayed"
        self.blocks = BlockRecipe(config.fp8_recipe) if config.fp8_recipe in BLOCK_LENGTH else None
        self.empty_amax = math.inf if self.blocks is not None else 0.0
        self.wgrad_fp8 = config.wgrad_in_fp8
        self.margin, self.algo = config.fp8_margin, config.fp8_amax_compute_algo
        self.groups, self.num_classes = tuple(groups), num_classes
        self.register_buffer("step_amax", torch.full((num_experts, 3), self.empty_amax),
                             persistent=False)
        self.register_buffer("last_amax", torch.zeros(num_experts, 3), persistent=False)
        if self.delayed:
            length = config.fp8_amax_history_len
            self.register_buffer("amax_history", torch.zeros(num_experts, 3, length))
            self.register_buffer("scale", torch.ones(num_experts, 3))

    def dtype(self, role):
        return self.bwd_dtype if role == GRAD_OUTPUT else self.fwd_dtype

    def _record(self, role, amax):
        if self.training:  # evaluation leaves the history and the step's amaxes alone
            mine = self.step_amax[self.local, role]  # [E_local], a view
            mine.copy_(torch.maximum(mine, amax))

    def _scales(self, role):
        """The delayed recipe's scales of the local experts for ``role`` ``[E_local]``."""
        return self.scale[self.local, role].clone()

    def row_scales(self, role, x, rows):
        """(the fp32 scale of each row of ``x`` ``[N]``, of each run ``[runs]``) for the
        ``role`` tensor ``x`` [N, k] laid out as ``rows``."""
        num_local, classes = self.local.stop - self.local.start, self.num_classes
        experts = torch.tensor([e for e, _, _ in rows.runs], dtype=torch.long)
        lengths = torch.tensor([n for _, _, n in rows.runs], dtype=torch.long)
        row_max = x.detach().abs().amax(dim=1).to(torch.float32)  # [N]
        if role == INPUT and rows.real is not None:  # routing padding stays out of the amax
            row_max = torch.where(rows.real, row_max, torch.zeros_like(row_max))
        if self.delayed:
            key = experts.repeat_interleave(lengths).to(x.device)  # [N]
            local = row_max.new_zeros(num_local).scatter_reduce(0, key, row_max, "amax")
            self._record(role, local)  # reduced at step end
            run_scales = self._scales(role)[experts.to(x.device)]  # [runs]
        else:
            cls = torch.tensor([c for _, c, _ in rows.runs], dtype=torch.long)
            run_key = (experts * classes + cls).to(x.device)  # [runs]
            key = run_key.repeat_interleave(lengths.to(x.device))  # [N]
            table = row_max.new_zeros(num_local * classes).scatter_reduce(0, key, row_max, "amax")
            reduce_max(table, self.groups)  # [E_local * C], whole per (expert, class)
            self._record(role, table.view(num_local, classes).amax(dim=1))
            run_scales = scale_from_amax(table, self.dtype(role))[run_key]  # [runs]
        return run_scales.repeat_interleave(lengths.to(x.device)), run_scales

    def weight_scales(self, weight):
        """The fp32 scale of each local expert's weight ``[E_local]`` (``weight`` [E, n, k])."""
        local = weight.detach().abs().amax(dim=(1, 2)).to(torch.float32)  # [E_local]
        if self.delayed:
            self._record(WEIGHT, local)
            return self._scales(WEIGHT)
        amax = reduce_max(local, self.groups[1:])  # whole over expert-TP
        self._record(WEIGHT, amax)
        return scale_from_amax(amax, self.fwd_dtype)

    @torch.no_grad()
    def end_step(self):
        """After a step (delayed: its amaxes reduced): ``last_amax``, then the delayed history
        and scales (newest entry or the history's max, with the margin), then a fresh step."""
        self.last_amax.copy_(self.step_amax)
        if self.delayed:
            self.amax_history.copy_(torch.roll(self.amax_history, 1, dims=2))  # [E, 3, L]
            self.amax_history[:, :, 0] = self.step_amax
            amax = self.amax_history[:, :, 0] if self.algo == "most_recent" else \
                self.amax_history.amax(dim=2)  # [E, 3]
            for role in (INPUT, WEIGHT, GRAD_OUTPUT):
                self.scale[:, role] = delayed_scale(amax[:, role], self.scale[:, role],
                                                    self.dtype(role), self.margin)
        self.step_amax.fill_(self.empty_amax)


def _segments(t, spans):
    return [t[start:start + n] for _, start, n in spans]


def _rows_to_16(t):
    """``t`` [m, ...] with zero rows appended up to a multiple of 16: the GPU's FP8 GEMM needs
    its inner size (a run's rows, in the weight gradient) a multiple of 16, and zero rows add
    nothing to the sum."""
    extra = -t.shape[0] % 16
    return torch.cat([t, t.new_zeros((extra,) + tuple(t.shape[1:]))]) if extra else t


class _GroupedFp8Matmul(torch.autograd.Function):
    """forward: ``x`` [N, k] (rows laid out as ``rows``), ``weight`` [E, n, k] -> each run's
    ``x W_e^T`` [N, n] from FP8 copies. backward: ``dx = q(dy) q(W_e)``; ``dW_e`` the sum
    over its runs of ``q(dy)^T q(x)`` (or in high precision without FP8 wgrad)."""

    @staticmethod
    def forward(ctx, x, weight, meta, rows):
        spans = rows.spans()
        x_rows, x_runs = meta.row_scales(INPUT, x, rows)  # [N], [runs]
        x_q = quantize(x, x_rows[:, None], meta.fwd_dtype)  # [N, k]
        w_scale = meta.weight_scales(weight)  # [E]
        w_q = quantize(weight, w_scale[:, None, None], meta.fwd_dtype)  # [E, n, k]
        parts = [scaled_matmul(part, x_runs[i], w_q[e].t(), w_scale[e], x.dtype)
                 for i, ((e, _, _), part) in enumerate(zip(spans, _segments(x_q, spans)))]
        out = torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])  # [N, n]
        ctx.meta, ctx.rows, ctx.x_dtype, ctx.w_dtype = meta, rows, x.dtype, weight.dtype
        saved_x = (x_q, x_runs) if meta.wgrad_fp8 else (x, None)
        ctx.save_for_backward(*saved_x, w_q, w_scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        meta, rows = ctx.meta, ctx.rows
        x_saved, x_runs, w_q, w_scale = ctx.saved_tensors
        spans = rows.spans()
        g_rows, g_runs = meta.row_scales(GRAD_OUTPUT, grad_out, rows)  # [N], [runs]
        g_q = quantize(grad_out, g_rows[:, None], meta.bwd_dtype)  # [N, n]
        g_parts, x_parts = _segments(g_q, spans), _segments(x_saved, spans)
        grad_x = [scaled_matmul(g, g_runs[i], w_q[e], w_scale[e], ctx.x_dtype)
                  for i, ((e, _, _), g) in enumerate(zip(spans, g_parts))]  # [n_run, k] each
        grad_x = torch.cat(grad_x) if grad_x else x_saved.new_zeros(0, w_q.shape[2],
                                                                    dtype=ctx.x_dtype)
        grad_w = torch.zeros(w_q.shape, dtype=torch.float32, device=w_q.device)  # [E, n, k]
        for i, ((e, _, _), g, x) in enumerate(zip(spans, g_parts, x_parts)):
            if meta.wgrad_fp8:
                g, x = _rows_to_16(g), _rows_to_16(x)  # [m16, n], [m16, k]
                grad_w[e] += scaled_matmul(g.t(), g_runs[i], x, x_runs[i], torch.float32)
            else:  # the high-precision gradient, from this run's rows
                grad_w[e] += grad_out[spans[i][1]:spans[i][1] + spans[i][2]].t().float() @ \
                    x.float()
        return grad_x, grad_w.to(ctx.w_dtype), None, None


def grouped_fp8_linear(x, weight, meta, rows):
    """Rows of ``x`` [N, in] laid out as ``rows`` (:class:`ExpertRows`) times each expert's
    ``weight`` [E, out, in]^T, in FP8 under ``meta`` (:class:`GroupedFp8Meta`) -> [N, out]."""
    if meta.blocks is not None:
        return grouped_block_linear(x, weight, meta, rows)
    return _GroupedFp8Matmul.apply(x, weight, meta, rows)


def attach_grouped_fp8(module, config):
    """Give the fc1 and fc2 of every grouped-experts module inside ``module`` (those that name
    their ``fp8_groups``) a :class:`GroupedFp8Meta` (every recipe built)."""
    for experts in module.modules():
        groups = getattr(experts, "fp8_groups", None)
        if groups is None:
            continue
        for linear in (experts.linear_fc1, experts.linear_fc2):
            local = slice(experts.first, experts.first + experts.num_local)
            linear.fp8_meta = GroupedFp8Meta(config, config.num_moe_experts, local, groups,
                                             experts.num_classes)


@torch.no_grad()
def end_grouped_step(chunks, groups):
    """After a training step: reduce every delayed grouped linear's step amax with MAX over
    ``groups`` (TP, CP and DP: every rank of the stage, so each expert's entry is the max over
    every row routed to it), in one flat all-reduce per group, then move each to the next
    step."""
    metas = [m for chunk in chunks for m in chunk.modules() if isinstance(m, GroupedFp8Meta)]
    delayed = [m for m in metas if m.delayed]
    if delayed:
        flat = torch.cat([m.step_amax.flatten() for m in delayed])  # [sum E_local * 3]
        reduce_max(flat, groups)
        for meta, amax in zip(delayed, flat.split([m.step_amax.numel() for m in delayed])):
            meta.step_amax.copy_(amax.view_as(meta.step_amax))
    for meta in metas:
        meta.end_step()
