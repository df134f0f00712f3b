"""Forward-backward schedules behind one ``get_forward_backward_func``.

Every schedule has the same contract::

    losses = forward_backward(forward_step_func, loss_func, microbatches, model_chunks,
                              state, forward_only=False)

``forward_step_func(model, batch)`` returns the model output (per-token losses on the last
stage, the hidden states ``[s/CP(/TP), b, h]`` elsewhere); ``loss_func(output, batch)``
returns ``(loss_for_backward, loss_sum)`` where the first already carries the token
normalization and loss scale. ``losses`` is the list of detached per-microbatch
``loss_sum`` (empty where this rank holds no last stage). Gradient reduction is the
caller's (``finalize_model_grads``) after the schedule; the DP bucket reduce is
suppressed for all microbatches but the last of each model chunk, so gradients are
reduced once per global batch.

The pipelined schedules also take, by keyword, ``tensor_shape`` and ``dtype`` of the P2P
buffers and ``overlap_p2p_comm`` (:func:`get_forward_backward_func` binds them; with it
every exchange is posted asynchronously and waited for only when its data is needed), an
optional ``trace`` list that receives one ``(kind, chunk, microbatch, start, end)`` tuple
(``time.perf_counter`` seconds) per forward ("F") or backward ("B") computation, for the
bubble benchmark, and an optional ``communicator`` replacing the P2P one (replay.py records the exchanges).

Schedules here: no pipelining (gradient accumulation) and 1F1B (PipeDream-flush: warmup of
``PP - rank - 1`` forwards, steady one-forward-one-backward, cooldown of the remaining
backwards). The interleaved 1F1B lives in interleaved.py. A non-last stage's output is
freed as soon as it has been sent (only its autograd graph is needed for backward).
"""
import collections
import contextlib
import functools
import time

import torch
from torch.autograd import Variable

from megatron_cp.pipeline_parallel.p2p_communication import P2PCommunicator


def _no_sync(model):
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
    with contextlib.nullcontext() if sync_grads else _no_sync(model):
        _backward(output, output_grad)
    input_grad = input_tensor.grad if input_tensor is not None else None
    if trace is not None:
        trace.append(("B", chunk, microbatch, start, time.perf_counter()))
    return input_grad


def forward_backward_no_pipelining(forward_step_func, loss_func, microbatches, model_chunks,
                                   state, forward_only=False, *, tensor_shape=None, dtype=None,
                                   trace=None):
    """Gradient accumulation over microbatches on a single pipeline stage."""
    if len(model_chunks) != 1:
        raise ValueError(f"without pipeline parallelism there is one model chunk, got {len(model_chunks)}")
    model = model_chunks[0]
    losses = []
    for i, batch in enumerate(microbatches):
        last = i == len(microbatches) - 1
        with contextlib.nullcontext() if (last or forward_only) else _no_sync(model):
            loss = forward_step(forward_step_func, loss_func, model, batch, None, True, losses,
                                trace, 0, i)
            if not forward_only:
                start = time.perf_counter()
                loss.backward()
                if trace is not None:
                    trace.append(("B", 0, i, start, time.perf_counter()))
    return losses


def forward_backward_pipelining_without_interleaving(
        forward_step_func, loss_func, microbatches, model_chunks, state, forward_only=False, *,
        tensor_shape, dtype=torch.float32, trace=None, communicator=None, overlap_p2p_comm=False):
    """1F1B: warmup forwards, then one forward and one backward at a time, then cooldown.

    Stage ``r`` of ``p`` runs ``min(p - r - 1, M)`` warmup forwards, so at most ``p - r``
    microbatches' activations are alive at once (vs M for all-forward-all-backward).
    ``overlap_p2p_comm``: see :func:`_overlapped_1f1b`.
    """
    if len(model_chunks) != 1:
        raise ValueError(f"1F1B runs one model chunk per rank, got {len(model_chunks)}; use the "
                         f"interleaved schedule (--num-layers-per-virtual-pipeline-stage)")
    model = model_chunks[0]
    comm = communicator or P2PCommunicator.from_state(state, tensor_shape, dtype)
    num = len(microbatches)
    num_warmup = num if forward_only else min(comm.size - comm.rank - 1, num)
    num_steady = num - num_warmup
    is_last = comm.is_last_stage
    saved = collections.deque()  # (input, output) of microbatches waiting for their backward
    losses = []
    counters = {"F": 0, "B": 0}

    def forward(input_tensor):
        if input_tensor is not None and not forward_only:
            input_tensor.requires_grad_()
        i = counters["F"]
        counters["F"] += 1
        output = forward_step(forward_step_func, loss_func, model, microbatches[i], input_tensor,
                              is_last, losses, trace, 0, i)
        return output

    def backward(output_grad):
        input_tensor, output = saved.popleft()
        i = counters["B"]
        counters["B"] += 1
        return backward_step(model, input_tensor, output, output_grad, i == num - 1, trace, 0, i)

    def keep(input_tensor, output):
        if not forward_only:
            saved.append((input_tensor, output))
        if not is_last:
            deallocate_output_tensor(output)  # sent already; backward needs the graph only

    if overlap_p2p_comm:
        _overlapped_1f1b(comm, num, num_warmup, forward_only, forward, backward, keep)
        return losses

    for _ in range(num_warmup):
        input_tensor = comm.recv_forward()
        output = forward(input_tensor)
        comm.send_forward(output)
        keep(input_tensor, output)

    input_tensor = comm.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        output = forward(input_tensor)
        output_grad = comm.send_forward_recv_backward(output)
        keep(input_tensor, output)
        input_grad = backward(output_grad)
        if i == num_steady - 1:
            comm.send_backward(input_grad)
            input_tensor = None
        else:
            input_tensor = comm.send_backward_recv_forward(input_grad)

    if not forward_only:
        for _ in range(num_warmup):
            output_grad = comm.recv_backward()
            comm.send_backward(backward(output_grad))
    return losses


def _overlapped_1f1b(comm, num, num_warmup, forward_only, forward, backward, keep):
    """The 1F1B program with every exchange posted asynchronously (``--overlap-p2p-comm``).

    The receive of the next input is posted before the current forward and that of the next
    gradient before the current backward (cooldown), and sends are waited for only at the
    end, so a stage computes while its neighbours' messages travel. Each direction keeps
    the blocking schedule's order of ops, posted no later and waited for no earlier, so it
    cannot deadlock where that one does not.
    """
    first, last = comm.is_first_stage, comm.is_last_stage
    pending = []  # exchanges in flight; sends complete by the end at the latest

    def post(**kwargs):
        pending[:] = [handle for handle in pending if not handle.done()]
        handle = comm.post(**kwargs)
        pending.append(handle)
        return handle

    next_input = post(recv_prev=not first and num > 0)
    for j in range(num):  # forward of microbatch j, then (steady) backward of j - num_warmup
        input_tensor = next_input.wait()[0]
        next_input = post(recv_prev=not first and j + 1 < num)  # travels during this forward
        output = forward(input_tensor)
        if j < num_warmup:
            post(send_next=None if last else output)
            keep(input_tensor, output)
            continue
        output_grad = post(send_next=None if last else output, recv_next=not last).wait()[1]
        keep(input_tensor, output)
        input_grad = backward(output_grad)
        post(send_prev=None if first else input_grad)
    if not forward_only:  # cooldown: the backwards of the warmup microbatches
        next_grad = post(recv_next=not last and num_warmup > 0)
        for j in range(num_warmup):
            output_grad = next_grad.wait()[1]
            next_grad = post(recv_next=not last and j + 1 < num_warmup)  # during this backward
            input_grad = backward(output_grad)
            post(send_prev=None if first else input_grad)
    for handle in pending:
        handle.wait()


def get_forward_backward_func(state, tensor_shape=None, dtype=None, overlap_p2p_comm=False):
    """The schedule for this layout: no pipelining at PP=1, else 1F1B, or interleaved 1F1B
    when ``state.virtual_pipeline_model_parallel_size`` > 1.

    With PP > 1, ``tensor_shape`` (the fixed P2P buffer shape, see
    :func:`~megatron_cp.pipeline_parallel.stages.pipeline_tensor_shape`), ``dtype`` (the
    activation dtype, default fp32) and ``overlap_p2p_comm`` (post the P2P exchanges
    asynchronously, ``--overlap-p2p-comm``; no effect at PP=1) are bound into the returned
    function.
    """
    if state.size("pp") == 1:
        return forward_backward_no_pipelining
    if tensor_shape is None:
        raise ValueError(f"pipeline_model_parallel_size ({state.size('pp')}) > 1 needs the fixed "
                         f"P2P buffer shape: pass tensor_shape=pipeline_tensor_shape(...)")
    vp_size = state.virtual_pipeline_model_parallel_size
    if vp_size is not None and vp_size > 1:
        from megatron_cp.pipeline_parallel.interleaved import \
            forward_backward_pipelining_with_interleaving as schedule
    else:
        schedule = forward_backward_pipelining_without_interleaving
    return functools.partial(schedule, tensor_shape=tuple(tensor_shape),
                             dtype=dtype if dtype is not None else torch.float32,
                             overlap_p2p_comm=bool(overlap_p2p_comm))
