"""The FP8 GEMM of a linear layer and the scaling state each FP8 linear keeps.

``y = x W^T`` runs as ``_scaled_mm(q(x), q(W)^T)`` with fp32 accumulation; backward runs
``dx = q(dy) q(W)`` and ``dW = q(dy)^T q(x)`` (``--no-fp8-wgrad`` with the delayed recipe:
``dW = dy^T x`` in the input's precision). x and W are quantized to the forward format, dy to the gradient format
(e5m2 under --fp8-format hybrid). Operand layouts are those the GPU kernels take: the first
operand row-major, the second column-major.
"""
import math

import torch

from megatron_cp.config.fp8 import BLOCK_LENGTH
from megatron_cp.fp8 import rows
from megatron_cp.fp8.blocks import Blocked, BlockRecipe, block_matmul
from megatron_cp.fp8.scaling import (FORMATS, amax_of, delayed_scale, local_amax, quantize,
                                     scale_from_amax)

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2  # the three quantized tensors of one linear


class Fp8Meta(torch.nn.Module):
    """One linear's FP8 settings and scaling state.

    ``groups[role]``: the process groups over which the amax of that tensor is reduced so it
    is the whole logical tensor's (the input and the output gradient: TP and CP, where they
    are split over the sequence or the hidden size; the weight: its TP group).

    Tensorwise (current) scaling keeps no state: each tensor's scale comes from its own
    amax. Delayed scaling keeps ``amax_history`` ``[3, L]`` (newest first) and ``scale``
    ``[3]`` as persistent buffers (saved in checkpoints): during training each forward and
    backward records the largest local amax of the step in ``step_amax``, and
    :meth:`update` (once per global batch, after the amaxes are reduced over the layout)
    pushes it into the history and derives the scales the next step uses.

    ``last_amax`` ``[3]`` (not saved): the last training step's largest amax of each tensor,
    over its microbatches (tensorwise: the amaxes the casts used, already whole over TP and
    CP, per DP rank; delayed: reduced over the whole stage), for logs and layout checks.

    Block recipes (``blocks``, megatron_cp/fp8/blocks.py) keep no state: each block's scale
    comes from the block. Their ``last_amax`` is the step's smallest nonzero block amax of
    each tensor's blocks across the tokens (the input and output gradient's wgrad copies;
    the weight's dgrad copy), the one that shows which tokens share a block (each rank's
    own, whole over a block's ranks; the MIN over the stage's ranks is one process's).
    ``token_groups``: the ranks holding the other tokens of a microbatch (CP), over which a
    token block's amax is reduced.
    """

    def __init__(self, config, groups, token_groups=()):
        super().__init__()
        self.fwd_dtype, self.bwd_dtype = FORMATS[config.fp8]
        self.delayed = config.fp8_recipe == "delayed"
        self.blocks = BlockRecipe(config.fp8_recipe) if config.fp8_recipe in BLOCK_LENGTH else None
        self.token_groups = tuple(token_groups)
        self.wgrad_fp8 = config.wgrad_in_fp8
        self.margin, self.algo = config.fp8_margin, config.fp8_amax_compute_algo
        self.groups = tuple(tuple(g) for g in groups)
        start = math.inf if self.blocks is not None else 0.0
        self.register_buffer("step_amax", torch.full((3,), start), persistent=False)  # [role]
        self.register_buffer("last_amax", torch.zeros(3), persistent=False)  # [role]
        if self.delayed:
            length = config.fp8_amax_history_len
            self.register_buffer("amax_history", torch.zeros(3, length))  # [role, L]
            self.register_buffer("scale", torch.ones(3))  # [role]

    def dtype(self, role):
        return self.bwd_dtype if role == GRAD_OUTPUT else self.fwd_dtype

    def scale_for(self, role, x):
        """The fp32 scale that quantizes ``x`` (the ``role`` tensor) now; an input's amax
        skips pad tokens (megatron_cp/fp8/rows.py; a pad token's output gradient is 0)."""
        real = rows.real_mask() if role == INPUT else None
        if real is not None:
            if real.numel() != x.shape[0]:
                raise AssertionError(f"{x.shape[0]} input rows, {real.numel()} row marks")
            x = x[real]  # [real tokens, k]
        if not self.delayed:
            amax = amax_of(x, self.groups[role])
            self._record(role, amax)
            return scale_from_amax(amax, self.dtype(role))
        self._record(role, local_amax(x))  # reduced at step end
        return self.scale[role].clone()  # the step's scale, apart from the buffer

    def _record(self, role, amax):
        if self.training:  # evaluation leaves the history and the step's amaxes alone
            self.step_amax[role] = torch.maximum(self.step_amax[role], amax)

    def record_blocks(self, role, blocked):
        """Block recipes: keep the smallest nonzero amax of ``blocked``'s blocks (its pad
        block left out) in ``step_amax`` (inf until one is seen)."""
        if not self.training:
            return
        amax = blocked.amax
        if blocked.columns is not None:
            amax = amax[:, :-1]
        if amax.numel():  # (no boolean indexing: no host sync on a GPU)
            smallest = torch.where(amax > 0, amax, math.inf).amin()
            self.step_amax[role] = torch.minimum(self.step_amax[role], smallest)

    @torch.no_grad()
    def end_step(self):
        """After a step (its amaxes reduced, for delayed scaling): keep them as
        ``last_amax``, move the delayed history and scales, start the next step's."""
        self.last_amax.copy_(self.step_amax)
        if self.delayed:
            self.update()
        self.step_amax.fill_(math.inf if self.blocks is not None else 0.0)

    @torch.no_grad()
    def update(self):
        """Delayed scaling, once per step: ``step_amax`` (already reduced) enters the history
        as its newest entry; the new scales come from the newest entry (most_recent) or the
        history's max (max), with the margin."""
        self.amax_history.copy_(torch.roll(self.amax_history, 1, dims=1))  # [3, L]
        self.amax_history[:, 0] = self.step_amax
        amax = self.amax_history[:, 0] if self.algo == "most_recent" else \
            self.amax_history.amax(dim=1)  # [3]
        for role in (INPUT, WEIGHT, GRAD_OUTPUT):
            self.scale[role] = delayed_scale(amax[role], self.scale[role], self.dtype(role),
                                             self.margin)

    def extra_repr(self):
        recipe = self.blocks.name if self.blocks is not None else \
            "delayed" if self.delayed else "tensorwise"
        return f"{recipe}, fwd={self.fwd_dtype}, bwd={self.bwd_dtype}, wgrad_fp8={self.wgrad_fp8}"


def _column_major(t):
    """``t`` [m, n] with the same values laid out column-major (``t.t()`` contiguous)."""
    return t.t().contiguous().t()


def scaled_matmul(a_q, a_scale, b_q, b_scale, out_dtype):
    """``(a_q / a_scale) @ (b_q / b_scale)`` for float8 ``a_q`` [m, k] and ``b_q`` [k, n],
    accumulated in fp32, returned as ``out_dtype`` [m, n]."""
    return torch._scaled_mm(a_q.contiguous(), _column_major(b_q), scale_a=a_scale.reciprocal(),
                            scale_b=b_scale.reciprocal(), out_dtype=out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """forward: ``x`` [m, k], ``weight`` [n, k] -> ``x W^T`` [m, n] from their FP8 copies.
    backward: ``dx = q(dy) q(W)`` [m, k]; ``dW = q(dy)^T q(x)`` [n, k] (or in high
    precision without FP8 wgrad)."""

    @staticmethod
    def forward(ctx, x, weight, meta):
        x_scale = meta.scale_for(INPUT, x)
        x_q = quantize(x, x_scale, meta.fwd_dtype)  # [m, k]
        if hasattr(weight, "fp8_pair"):  # --fp8-param-gather: kept in FP8 (fp8/params.py)
            w_q, w_scale = weight.fp8_pair()  # [n, k]
        else:
            w_scale = meta.scale_for(WEIGHT, weight)
            w_q = quantize(weight, w_scale, meta.fwd_dtype)  # [n, k]
        out = scaled_matmul(x_q, x_scale, w_q.t(), w_scale, x.dtype)  # [m, n]
        ctx.meta, ctx.x_dtype, ctx.w_dtype = meta, x.dtype, weight.dtype
        if meta.wgrad_fp8:
            ctx.save_for_backward(x_q, x_scale, w_q, w_scale)
        else:
            ctx.save_for_backward(x, None, w_q, w_scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        meta = ctx.meta
        x_saved, x_scale, w_q, w_scale = ctx.saved_tensors
        g_scale = meta.scale_for(GRAD_OUTPUT, grad_out)
        g_q = quantize(grad_out, g_scale, meta.bwd_dtype)  # [m, n]
        grad_x = scaled_matmul(g_q, g_scale, w_q, w_scale, ctx.x_dtype)  # [m, k]
        if meta.wgrad_fp8:
            grad_w = scaled_matmul(g_q.t(), g_scale, x_saved, x_scale, ctx.w_dtype)  # [n, k]
        else:
            grad_w = (grad_out.t() @ x_saved).to(ctx.w_dtype)  # [n, k]
        return grad_x, grad_w, None


class _BlockMatmul(torch.autograd.Function):
    """:class:`_Fp8Matmul` under a block recipe (megatron_cp/fp8/blocks.py): forward ``x``
    [m, k], ``weight`` [n, k] -> ``x W^T`` [m, n]; backward ``dx = q(dy) q(W)`` and ``dW =
    q'(dy)^T q'(x)``, the primes the copies quantized in blocks along the tokens (from high
    precision), in one process's token blocks (megatron_cp/fp8/rows.py)."""

    @staticmethod
    def forward(ctx, x, weight, meta):
        recipe, wgrad = meta.blocks, meta.wgrad_fp8
        tokens = rows.one_process_rows(x.shape[0])  # [m] or None
        groups = meta.token_groups if tokens is not None else ()
        x_row, x_col = recipe.input(x, meta.fwd_dtype, wgrad, tokens, groups)
        w_fprop, w_dgrad = recipe.weight(weight, meta.fwd_dtype)
        out = block_matmul(x_row, w_fprop, x.dtype)  # [m, n]
        meta.record_blocks(INPUT, x_col if wgrad else x_row)
        meta.record_blocks(WEIGHT, w_dgrad)
        ctx.meta, ctx.x_dtype, ctx.w_dtype = meta, x.dtype, weight.dtype
        ctx.w_block, ctx.x_block = w_dgrad.block, x_col.block if wgrad else None
        saved = (x_col.data, x_col.scale, x_col.columns) if wgrad else (x, None, None)
        ctx.save_for_backward(*saved, w_dgrad.data, w_dgrad.scale, tokens)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        meta = ctx.meta
        x_data, x_scale, x_columns, w_data, w_scale, tokens = ctx.saved_tensors
        groups = meta.token_groups if tokens is not None else ()
        g_row, g_col = meta.blocks.grad(grad_out, meta.bwd_dtype, meta.wgrad_fp8, tokens, groups)
        w_dgrad = Blocked(w_data, w_scale, None, ctx.w_block)
        grad_x = block_matmul(g_row, w_dgrad, ctx.x_dtype)  # [m, k]
        if meta.wgrad_fp8:
            meta.record_blocks(GRAD_OUTPUT, g_col)
            x_col = Blocked(x_data, x_scale, None, ctx.x_block, x_columns)
            grad_w = block_matmul(g_col, x_col, ctx.w_dtype)  # [n, k]
        else:
            meta.record_blocks(GRAD_OUTPUT, g_row)
            grad_w = (grad_out.t() @ x_data).to(ctx.w_dtype)  # [n, k]
        return grad_x, grad_w, None


def fp8_linear(x, weight, bias, meta):
    """``F.linear(x, weight, bias)`` with its GEMMs in FP8 under ``meta`` (an
    :class:`Fp8Meta`): ``x`` [..., k] -> [..., n]."""
    lead = x.shape[:-1]
    matmul = _BlockMatmul if meta.blocks is not None else _Fp8Matmul
    out = matmul.apply(x.reshape(-1, x.shape[-1]), weight, meta)  # [m, n]
    out = out.view(*lead, weight.shape[0])  # [..., n]
    return out + bias if bias is not None else out
