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
buffers and ``overlap_p2p_comm`` (:func:`get_forward_backward_func` binds the last two; the shape
may change from step to step, so the caller passes it per call; with ``overlap_p2p_comm``
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

from megatron_cp.pipeline_parallel.interleaved import forward_backward_pipelining_with_interleaving
from megatron_cp.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_cp.pipeline_parallel.steps import (backward_step, deallocate_output_tensor,
                                                 forward_step, no_sync)


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
        with contextlib.nullcontext() if (last or forward_only) else no_sync(model):
            loss = forward_step(forward_step_func, loss_func, model, batch, None, True, losses,
                                trace, 0, i)
            if not forward_only:
                start = time.perf_counter()
                loss.backward()
                if trace is not None:
                    trace.append(("B", 0, i, start, time.perf_counter()))
    return losses


class _Exchanges:
    """The exchanges of the 1F1B program, in one of two modes.

    Overlapped (``--overlap-p2p-comm``): every exchange is posted at once and waited for
    only when its data is needed (sends complete by :meth:`finish` at the latest).
    Blocking: each exchange runs when asked, except that a receive from the previous stage
    runs only when its tensor is needed, or together with the next send to the previous
    stage (Megatron's batched send-backward-receive-forward): the order of blocking ops
    of the classic schedule, so it cannot deadlock where that one does not.
    """

    def __init__(self, comm, overlap):
        self.comm, self.overlap = comm, overlap
        self.pending = []  # overlapped exchanges in flight
        self.deferred = None  # blocking: a receive from the previous stage not yet run

    def _post(self, **kwargs):
        self.pending[:] = [handle for handle in self.pending if not handle.done()]
        handle = self.comm.post(**kwargs)
        self.pending.append(handle)
        return handle

    def recv_prev(self, wanted):
        """The next activation, as a :class:`_Later` (None inside when not ``wanted``)."""
        if self.overlap:
            return _Later(lambda handle=self._post(recv_prev=wanted): handle.wait()[0])
        later = _Later(lambda: self.comm.communicate(recv_prev=wanted)[0])
        self.deferred = later if wanted else None
        return later

    def recv_next(self, wanted):
        """The next output gradient, as a :class:`_Later`."""
        if self.overlap:
            return _Later(lambda handle=self._post(recv_next=wanted): handle.wait()[1])
        return _Later(lambda: self.comm.communicate(recv_next=wanted)[1])

    def send_next(self, output, recv_next=False):
        """Send ``output`` (None: nothing) to the next stage; with ``recv_next`` wait for
        and return the gradient coming back."""
        if self.overlap:
            handle = self._post(send_next=output, recv_next=recv_next)
            return handle.wait()[1] if recv_next else None
        return self.comm.communicate(send_next=output, recv_next=recv_next)[1]

    def send_prev(self, input_grad):
        """Send ``input_grad`` (None: nothing) to the previous stage."""
        if self.overlap:
            self._post(send_prev=input_grad)
            return
        deferred, self.deferred = self.deferred, None
        if deferred is not None and not deferred.ready:
            deferred.set(self.comm.communicate(send_prev=input_grad, recv_prev=True)[0])
        else:
            self.comm.communicate(send_prev=input_grad)

    def finish(self):
        for handle in self.pending:
            handle.wait()


class _Later:
    """A tensor obtained by ``fetch()`` on first :meth:`get` (or given by :meth:`set`)."""

    def __init__(self, fetch):
        self.fetch, self.ready, self.value = fetch, False, None

    def set(self, value):
        self.ready, self.value = True, value

    def get(self):
        if not self.ready:
            self.set(self.fetch())
        return self.value


def forward_backward_pipelining_without_interleaving(
        forward_step_func, loss_func, microbatches, model_chunks, state, forward_only=False, *,
        tensor_shape, dtype=torch.float32, trace=None, communicator=None, overlap_p2p_comm=False):
    """1F1B: warmup forwards, then one forward and one backward at a time, then cooldown.

    Stage ``r`` of ``p`` runs ``min(p - r - 1, M)`` warmup forwards, so at most ``p - r``
    microbatches' activations are alive at once (vs M for all-forward-all-backward). With
    ``overlap_p2p_comm`` the receive of the next input is posted before the current forward
    (and that of the next gradient before the current backward in the cooldown), so a
    stage computes while its neighbours' messages travel (see :class:`_Exchanges`).
    """
    if len(model_chunks) != 1:
        raise ValueError(f"1F1B runs one model chunk per rank, got {len(model_chunks)}; use the "
                         f"interleaved schedule (--num-layers-per-virtual-pipeline-stage)")
    model = model_chunks[0]
    comm = communicator or P2PCommunicator.from_state(state, tensor_shape, dtype)
    num = len(microbatches)
    num_warmup = num if forward_only else min(comm.size - comm.rank - 1, num)
    first, last = comm.is_first_stage, comm.is_last_stage
    saved = collections.deque()  # (input, output) of microbatches waiting for their backward
    losses = []
    link = _Exchanges(comm, overlap_p2p_comm)

    def forward(j, input_tensor):
        if input_tensor is not None and not forward_only:
            input_tensor.requires_grad_()
        output = forward_step(forward_step_func, loss_func, model, microbatches[j], input_tensor,
                              last, losses, trace, 0, j)
        if not forward_only:
            saved.append((input_tensor, output))
        return output

    def backward(i, output_grad):
        input_tensor, output = saved.popleft()
        input_grad = backward_step(model, input_tensor, output, output_grad, i == num - 1, trace, 0, i)
        link.send_prev(None if first else input_grad)

    def sent(output):
        if not last:
            deallocate_output_tensor(output)  # backward needs the graph only

    next_input = link.recv_prev(not first and num > 0)
    for j in range(num):  # forward of microbatch j, then (steady) backward of j - num_warmup
        input_tensor = next_input.get()
        next_input = link.recv_prev(not first and j + 1 < num)
        output = forward(j, input_tensor)
        if j < num_warmup:
            link.send_next(None if last else output)
            sent(output)
            continue
        output_grad = link.send_next(None if last else output, recv_next=not last)
        sent(output)
        backward(j - num_warmup, output_grad)
    if not forward_only:  # cooldown: the backwards of the warmup microbatches
        next_grad = link.recv_next(not last and num_warmup > 0)
        for j in range(num_warmup):
            output_grad = next_grad.get()
            next_grad = link.recv_next(not last and j + 1 < num_warmup)
            backward(num - num_warmup + j, output_grad)
    link.finish()
    return losses


def get_forward_backward_func(state, tensor_shape=None, dtype=None, overlap_p2p_comm=False,
                              microbatch_group_size=None):
    """The schedule for this layout: no pipelining at PP=1, else 1F1B, or interleaved 1F1B
    when ``state.virtual_pipeline_model_parallel_size`` > 1.

    With PP > 1, ``dtype`` (the activation dtype, default fp32), ``overlap_p2p_comm`` (post
    the P2P exchanges asynchronously, ``--overlap-p2p-comm``; no effect at PP=1) and, when
    given, ``tensor_shape`` (the P2P buffer shape, see
    :func:`~megatron_cp.pipeline_parallel.stages.pipeline_tensor_shape`; else pass it per
    call) are bound into the returned function; so is ``microbatch_group_size`` for the
    interleaved schedule (``--microbatch-group-size-per-virtual-pipeline-stage``, None: PP).
    """
    if state.size("pp") == 1:
        return forward_backward_no_pipelining
    vp_size = state.virtual_pipeline_model_parallel_size
    bound = {} if tensor_shape is None else {"tensor_shape": tuple(tensor_shape)}
    if vp_size is not None and vp_size > 1:
        schedule = forward_backward_pipelining_with_interleaving
        bound["microbatch_group_size"] = microbatch_group_size
    else:
        schedule = forward_backward_pipelining_without_interleaving
    return functools.partial(schedule, dtype=dtype if dtype is not None else torch.float32,
                             overlap_p2p_comm=bool(overlap_p2p_comm), **bound)
