"""Interleaved 1F1B: each rank holds ``VP`` model chunks (virtual stages) of the model.

Model chunk ``c`` of PP rank ``r`` is virtual stage ``c * PP + r``: activations go round
the ring of ranks ``VP`` times, so the pipeline fills ``VP`` times faster and the bubble
shrinks from ``(p-1)/(m+p-1)`` to ``(p-1)/(v*m+p-1)`` of the step (Narayanan et al. 2021).

The ``M * VP`` virtual microbatches run in groups of ``N`` microbatches (Megatron-LM's
``--microbatch-group-size-per-virtual-pipeline-stage``, default PP: depth first): chunk 0
on microbatches ``0..N-1``, chunk 1 on the same, ..., then chunk 0 on ``N..2N-1``; the last
group holds the remaining ``M mod N`` (at least PP of them) when ``N`` does not divide
``M`` (:func:`schedule_table`). The backward of virtual microbatch ``k`` runs the chunks in
reverse order. Each rank does ``2 (PP - r - 1) + (VP - 1) N`` warmup forwards (all of them
when that reaches ``M * VP``), then alternates one forward and one backward with ONE batched
exchange per step (send forward, send backward, receive forward, receive backward), then
the remaining backwards.

Received tensors wait in per-chunk FIFO queues until the forward (or backward) of that
chunk takes them: tensors for one chunk always arrive in microbatch order. The first rank
receives (from the last) what that rank produced ``PP - 1`` virtual microbatches earlier,
and the last rank receives gradients from the first the same way (:func:`_receive_plan`).

With ``overlap_p2p_comm`` (``--overlap-p2p-comm``) every exchange is posted without waiting
and the queues hold :class:`~megatron_cp.pipeline_parallel.p2p_communication.Received`
placeholders, waited for when a forward (backward) pops them; the steady step's exchange
is split in two, the forward half (send the activation, receive the next input) posted
right after the forward so it travels during the backward, the backward half after the
backward so it travels during the next forward (Megatron's overlap). Each direction keeps
its order of ops, and the ops are posted no later and waited for no earlier than in the
blocking schedule, so it cannot deadlock where that one does not.
"""
import collections

from megatron_cp.pipeline_parallel.p2p_communication import P2PCommunicator, Received, resolve
from megatron_cp.pipeline_parallel.steps import backward_step, deallocate_output_tensor, forward_step
from megatron_cp.pipeline_parallel.stages import validate_interleaved_microbatches


def schedule_table(num_microbatches, num_chunks, group_size):
    """``[(microbatch, chunk), ...]``: the forward order of the virtual microbatches, in
    groups of ``group_size`` microbatches per chunk (the last group takes the rest)."""
    table = []
    for start in range(0, num_microbatches, group_size):
        group = range(start, min(start + group_size, num_microbatches))
        table += [(microbatch, chunk) for chunk in range(num_chunks) for microbatch in group]
    return table


def _receive_plan(k, forward, chunk_of, p, r, v):
    """``(receive, chunk)`` after virtual microbatch ``k``: whether a tensor arrives from
    the neighbour (forward: the previous rank's activation; backward: the next rank's
    gradient) and which chunk's queue it joins. The leading rank (the first forward, the
    last backward) gets what the other end of the ring made ``p - 1`` steps earlier: nothing
    before that, nor from the end's last chunk."""
    leading = r == 0 if forward else r == p - 1
    if not leading:
        return True, chunk_of(k + 1, forward)
    if k < p - 1:
        return False, chunk_of(k + 1, forward)
    chunk = chunk_of(k - (p - 1), forward)
    step = 1 if forward else -1
    return chunk != (v - 1 if forward else 0), chunk + step


def forward_backward_pipelining_with_interleaving(
        forward_step_func, loss_func, microbatches, model_chunks, state, forward_only=False, *,
        tensor_shape, dtype, trace=None, communicator=None, overlap_p2p_comm=False,
        microbatch_group_size=None):
    """Interleaved 1F1B over ``len(model_chunks)`` virtual stages per rank (see module doc);
    ``overlap_p2p_comm`` posts the exchanges asynchronously; ``microbatch_group_size``:
    microbatches per virtual stage in a row (None: PP)."""
    comm = communicator or P2PCommunicator.from_state(state, tensor_shape, dtype)
    p, r, v = comm.size, comm.rank, len(model_chunks)
    num = len(microbatches)
    if v < 2:
        raise ValueError(f"the interleaved schedule needs >= 2 model chunks per rank, got {v}; "
                         f"use 1F1B (no virtual pipeline stages)")
    validate_interleaved_microbatches(num, p, v, microbatch_group_size)
    group = p if microbatch_group_size is None else microbatch_group_size
    table = schedule_table(num, v, group)
    total = num * v
    if forward_only:
        num_warmup = total
    else:
        num_warmup = min(2 * (p - r - 1) + (v - 1) * group, total)
    all_warmup = num_warmup == total
    num_steady = total - num_warmup

    def chunk_of(k, forward=True):
        chunk = table[k % total][1]
        return chunk if forward else v - 1 - chunk

    def microbatch_of(k):
        return table[k][0]

    def receive_plan(k, forward):
        return _receive_plan(k, forward, chunk_of, p, r, v)

    def virtual_first(chunk):
        return r == 0 and chunk == 0

    def virtual_last(chunk):
        return r == p - 1 and chunk == v - 1

    inputs = [collections.deque() for _ in range(v)]  # received activations, per chunk
    grads = [collections.deque() for _ in range(v)]  # received output gradients, per chunk
    saved = [collections.deque() for _ in range(v)]  # (input, output) awaiting backward
    losses = []
    pending = []  # exchanges in flight (overlap): their sends complete by the end at the latest

    def exchange(send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """``(from_prev, from_next)``: tensors, or Received placeholders under overlap."""
        if not overlap_p2p_comm:
            return comm.communicate(send_next, send_prev, recv_prev, recv_next)
        pending[:] = [handle for handle in pending if not handle.done()]
        handle = comm.post(send_next, send_prev, recv_prev, recv_next)
        pending.append(handle)
        return (Received(handle, 0) if recv_prev else None,
                Received(handle, 1) if recv_next else None)

    def forward(k):
        chunk, mb = chunk_of(k), microbatch_of(k)
        input_tensor = None if virtual_first(chunk) else resolve(inputs[chunk].popleft())
        if input_tensor is not None and not forward_only:
            input_tensor.requires_grad_()
        output = forward_step(forward_step_func, loss_func, model_chunks[chunk], microbatches[mb],
                              input_tensor, virtual_last(chunk), losses, trace, chunk, mb)
        if not forward_only:
            saved[chunk].append((input_tensor, output))
        return None if virtual_last(chunk) else output  # what goes to the next stage

    def backward(k):
        chunk, mb = chunk_of(k, forward=False), microbatch_of(k)
        input_tensor, output = saved[chunk].popleft()
        output_grad = None if virtual_last(chunk) else resolve(grads[chunk].popleft())
        input_grad = backward_step(model_chunks[chunk], input_tensor, output, output_grad,
                                   sync_grads=mb == num - 1, trace=trace, chunk=chunk,
                                   microbatch=mb)
        return None if virtual_first(chunk) else input_grad

    def sent(output):
        if not forward_only:
            deallocate_output_tensor(output)

    # The first activation of chunk 0 (rank 0 reads its data instead).
    if r != 0:
        inputs[0].append(exchange(recv_prev=True)[0])

    for k in range(num_warmup):
        output = forward(k)
        recv_prev, next_chunk = receive_plan(k, forward=True)
        recv_prev = recv_prev and k != total - 1
        if k == num_warmup - 1 and not forward_only and not all_warmup:
            # The last warmup step already receives the first gradient.
            recv_next = r != p - 1
            from_prev, from_next = exchange(send_next=output, recv_prev=recv_prev,
                                            recv_next=recv_next)
            if recv_next:
                grads[v - 1].append(from_next)
        else:
            from_prev, _ = exchange(send_next=output, recv_prev=recv_prev)
        sent(output)
        if recv_prev:
            inputs[next_chunk].append(from_prev)

    for i in range(num_steady):
        forward_k, backward_k = i + num_warmup, i
        # Which chunk the tensors received now belong to (see _receive_plan).
        recv_prev, next_forward = receive_plan(forward_k, forward=True)
        recv_next, next_backward = receive_plan(backward_k, forward=False)
        if i == num_steady - 1:
            recv_prev = False
        output = forward(forward_k)
        if overlap_p2p_comm:  # forward half travels during the backward, and vice versa
            from_prev, _ = exchange(send_next=output, recv_prev=recv_prev)
            sent(output)
            input_grad = backward(backward_k)
            _, from_next = exchange(send_prev=input_grad, recv_next=recv_next)
        else:
            input_grad = backward(backward_k)
            from_prev, from_next = exchange(send_next=output, send_prev=input_grad,
                                            recv_prev=recv_prev, recv_next=recv_next)
            sent(output)
        if recv_prev:
            inputs[next_forward].append(from_prev)
        if recv_next:
            grads[next_backward].append(from_next)

    if not forward_only:
        if all_warmup and r != p - 1:
            grads[v - 1].append(exchange(recv_next=True)[1])
        for k in range(num_steady, total):
            input_grad = backward(k)
            recv_next, next_backward = receive_plan(k, forward=False)
            recv_next = recv_next and k != total - 1
            _, from_next = exchange(send_prev=input_grad, recv_next=recv_next)
            if recv_next:
                grads[next_backward].append(from_next)
    for handle in pending:
        handle.wait()
    return losses
