"""The FP8 GEMM of a linear layer and the scaling state each FP8 linear keeps.

``y = x W^T`` runs as ``_scaled_mm(q(x), q(W)^T)`` with fp32 accumulation; backward runs
``dx = q(dy) q(W)`` and ``dW = q(dy)^T q(x)`` (``--no-fp8-wgrad``: ``dW = dy^T x`` in the
input's precision). x and W are quantized to the forward format, dy to the gradient format
(e5m2 under --fp8-format hybrid). Operand layouts are those the GPU kernels take: the first
operand row-major, the second column-major.
"""
import torch

from megatron_cp.fp8 import rows
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
    """

    def __init__(self, config, groups):
        super().__init__()
        self.fwd_dtype, self.bwd_dtype = FORMATS[config.fp8]
        self.delayed = config.fp8_recipe == "delayed"
        self.wgrad_fp8 = config.fp8_wgrad
        self.margin, self.algo = config.fp8_margin, config.fp8_amax_compute_algo
        self.groups = tuple(tuple(g) for g in groups)
        self.register_buffer("step_amax", torch.zeros(3), persistent=False)  # [role]
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
        real = rows.current() if role == INPUT else None
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

    @torch.no_grad()
    def end_step(self):
        """After a step (its amaxes reduced, for delayed scaling): keep them as
        ``last_amax``, move the delayed history and scales, start the next step's."""
        self.last_amax.copy_(self.step_amax)
        if self.delayed:
            self.update()
        self.step_amax.zero_()

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
        recipe = "delayed" if self.delayed else "tensorwise"
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


def fp8_linear(x, weight, bias, meta):
    """``F.linear(x, weight, bias)`` with its GEMMs in FP8 under ``meta`` (an
    :class:`Fp8Meta`): ``x`` [..., k] -> [..., n]."""
    lead = x.shape[:-1]
    out = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, meta)  # [m, n]
    out = out.view(*lead, weight.shape[0])  # [..., n]
    return out + bias if bias is not None else out
