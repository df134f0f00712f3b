"""Recompute a function's OUTPUT in backward instead of keeping it: Megatron-LM's
output-discarding checkpoint, behind ``--recompute-modules layernorm``, ``moe_act`` and
``mla_up_proj``.

A plain checkpoint (random.checkpoint) drops what a function saves INSIDE it; here the
function is cheap (a norm, an activation, MLA's up projections) and what costs memory is its
output, which the next modules save for their own backward (a linear keeps its input). So::

    rebuild = DiscardedOutput(norm)
    h = rebuild(x)                 # runs without a graph; keeps x only
    out = attention(h)             # saves h (in linear_qkv), as always
    rebuild.discard_after(out)     # frees h's storage; h comes back when backward reaches out

When backward reaches ``out`` (a gradient hook on it), the function reruns on its saved
inputs WITH a graph, and its fresh output is copied into the freed storage, so every saved
reference to h (and its views) sees the same values again before any consumer's backward
runs; the function's own backward then runs through that rebuilt graph. The function must be
deterministic (no dropout) and return fresh contiguous tensors.
"""
import torch

from megatron_cp.fp8 import rows as fp8_rows


class DiscardedOutput:
    """One call of ``function`` whose outputs are rebuilt in backward (module docstring)."""

    def __init__(self, function):
        self.function = function
        self.ctx = None  # the autograd node's context: its saved inputs
        self.outputs = None  # what forward returned (their storage is freed and refilled)
        self.rebuilt = None  # (detached inputs, outputs with a graph) from the backward rerun
        self.real_rows = None  # the call's FP8 real-token rows, which the rerun's amaxes skip

    @torch.compiler.disable
    def __call__(self, *inputs):
        self.real_rows = fp8_rows.current()
        outputs = _Run.apply(self, *inputs)
        return outputs[0] if len(outputs) == 1 else outputs

    @torch.compiler.disable
    def discard_after(self, later):
        """Free the outputs' storage now; rebuild them when the gradient of ``later`` (a
        tensor computed from them) is formed in backward. Nothing happens outside autograd
        (no graph to rebuild for)."""
        if self.ctx is None or not later.requires_grad:
            return
        for out in self.outputs:
            out.untyped_storage().resize_(0)
        later.register_hook(self._refill)

    def _rebuild(self):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in self.ctx.saved_tensors]
        with torch.enable_grad(), fp8_rows.real_rows(self.real_rows):
            outputs = self.function(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        self.rebuilt = (inputs, outputs)

    def _refill(self, grad):
        self._rebuild()
        for out, fresh in zip(self.outputs, self.rebuilt[1]):
            storage = fresh.untyped_storage()
            out.untyped_storage().resize_(storage.nbytes())
            out.untyped_storage().copy_(storage)
        return grad


class _Run(torch.autograd.Function):
    """forward: the function without a graph, its inputs saved; backward: through the rerun
    graph (the gradient hook's, or a fresh one when the outputs were never discarded)."""

    @staticmethod
    def forward(ctx, owner, *inputs):
        with torch.no_grad():
            outputs = owner.function(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        ctx.owner = owner
        ctx.save_for_backward(*inputs)
        owner.ctx, owner.outputs = ctx, outputs
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        owner = ctx.owner
        if owner.rebuilt is None:
            owner._rebuild()
        inputs, outputs = owner.rebuilt
        owner.rebuilt = owner.outputs = owner.ctx = None  # the graph goes with this node
        pairs = [(out, grad) for out, grad in zip(outputs, grads)
                 if grad is not None and out.requires_grad]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        return (None,) + tuple(x.grad if x.requires_grad else None for x in inputs)
