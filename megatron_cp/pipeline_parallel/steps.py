"""One microbatch through one model chunk: the forward and backward steps every schedule
runs, and the freeing of an activation once it has been sent.

``forward_step`` runs the model (and, on the last stage, the loss); ``backward_step``
runs autograd from the stage's output with the gradient received from the next stage
(or from the scalar loss), holding back the DP gradient reduce unless told to sync.
"""
import contextlib
import time

import torch
from torch.autograd import Variable


def no_sync(model):
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def deallocate_output_tensor(output):
    """Free the storage of a sent activation, keeping its autograd graph for backward.

    Only the graph (``grad_fn``) of a stage's output is needed for its backward, not its
    values, so after the send the ``[s, b, h]`` storage is swapped for one element (the
    Megatron trick). Views are left alone: their storage belongs to another tensor.
    """
    if output is None or output._base is not None or output.numel() <= 1:
        return
    output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def _backward(output, grad):
    """Backward from ``output`` with ``grad``; works on an output freed by
    :func:`deallocate_output_tensor` (``torch.autograd.backward`` would check the shape of
    the freed tensor against ``grad``; the engine checks the graph's recorded shape)."""
    if grad is None:  # the scalar loss of the last stage
        grad = torch.ones_like(output)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


def forward_step(forward_step_func, loss_func, model, batch, input_tensor, is_last_stage,
                 losses, trace=None, chunk=0, microbatch=0):
    """Run one microbatch through one model chunk.

    Returns the activation for the next stage, or on the last stage the scalar loss for
    backward (its detached ``loss_sum`` is appended to ``losses``).
    """
    start = time.perf_counter()
    module = _unwrap(model)
    if hasattr(module, "set_input_tensor"):  # a pipeline stage (any model works at PP=1)
        module.set_input_tensor(input_tensor)
    output = forward_step_func(model, batch)
    if is_last_stage:
        loss, loss_sum = loss_func(output, batch)
        losses.append(loss_sum.detach())
        output = loss
    if trace is not None:
        trace.append(("F", chunk, microbatch, start, time.perf_counter()))
    return output


def backward_step(model, input_tensor, output, output_grad, sync_grads, trace=None, chunk=0,
                  microbatch=0):
    """Backward of one microbatch through one chunk; returns the gradient of its input
    (None on the first stage). ``sync_grads`` False keeps the DP reduce from starting."""
    start = time.perf_counter()
    with contextlib.nullcontext() if sync_grads else no_sync(model):
        _backward(output, output_grad)
    input_grad = input_tensor.grad if input_tensor is not None else None
    if trace is not None:
        trace.append(("B", chunk, microbatch, start, time.perf_counter()))
    return input_grad
