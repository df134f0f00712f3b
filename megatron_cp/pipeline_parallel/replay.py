"""Replay a schedule without processes: each rank's program, deadlock check, ideal timeline.

:func:`record_program` runs the real schedule code of one rank on tiny stand-in model
chunks (real autograd, so every backward runs) with a :class:`RecordingCommunicator` that
logs each batched exchange instead of sending it. :func:`simulate` then plays all ranks'
programs against each other with rendezvous semantics (a message completes once both its
send and its receive are posted, in order per sender, receiver and direction, the strictest
of NCCL's and gloo's behaviours) and fixed compute costs with free communication. It
raises on a deadlock or an unmatched message, and returns the step time and each stage's
idle fraction: the schedule's own bubble, which the benchmark compares with theory and
with the measured one.
"""
import collections
import functools

import torch

from megatron_cp.pipeline_parallel.p2p_communication import (BACKWARD_TAG, FORWARD_TAG,
                                                             P2PCommunicator)

_SHAPE = (2, 1, 2)  # [s, b, h] of the stand-in activations


class RecordingCommunicator(P2PCommunicator):
    """A P2PCommunicator that records ``("C", ((kind, peer, tag), ...))`` into ``events``
    and hands back zero buffers instead of communicating."""

    def __init__(self, pp_size, pp_rank, events, tensor_shape=_SHAPE):
        super().__init__(None, list(range(pp_size)), pp_rank, tensor_shape, torch.float32,
                         torch.device("cpu"))
        self.events = events

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        messages = []
        if send_next is not None:
            self._check(send_next, "the activation sent to the next stage")
            messages.append(("send", self.next_rank, FORWARD_TAG))
        if recv_prev:
            messages.append(("recv", self.prev_rank, FORWARD_TAG))
        if send_prev is not None:
            self._check(send_prev, "the gradient sent to the previous stage")
            messages.append(("send", self.prev_rank, BACKWARD_TAG))
        if recv_next:
            messages.append(("recv", self.next_rank, BACKWARD_TAG))
        if messages:
            self.events.append(("C", tuple(messages)))
        return (self._buffer().zero_() if recv_prev else None,
                self._buffer().zero_() if recv_next else None)


class _StandIn(torch.nn.Module):
    """y = x * w: the cheapest chunk with an autograd graph and the GPTModel interface."""

    def __init__(self, pre_process):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.pre_process, self.input_tensor = pre_process, None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, batch):
        x = torch.ones(_SHAPE) if self.pre_process else self.input_tensor  # [s, b, h]
        return x * self.weight


def record_program(pp_size, pp_rank, vp_size, num_microbatches, forward_only=False,
                   group_size=None):
    """The ordered events of one rank: ``("F" | "B", chunk, microbatch, ...)`` computations
    and ``("C", messages)`` exchanges, from the real 1F1B / interleaved schedule code
    (``group_size``: the interleaved schedule's microbatches per virtual stage in a row)."""
    from megatron_cp.pipeline_parallel.interleaved import \
        forward_backward_pipelining_with_interleaving
    from megatron_cp.pipeline_parallel.schedules import \
        forward_backward_pipelining_without_interleaving
    events = []
    comm = RecordingCommunicator(pp_size, pp_rank, events)
    chunks = [_StandIn(pp_rank == 0 and c == 0) for c in range(vp_size)]
    if vp_size > 1:
        schedule = functools.partial(forward_backward_pipelining_with_interleaving,
                                     microbatch_group_size=group_size)
    else:
        schedule = forward_backward_pipelining_without_interleaving
    schedule(lambda model, batch: model(batch), lambda out, batch: (out.sum(), out.sum().detach()),
             [None] * num_microbatches, chunks, None, forward_only, tensor_shape=_SHAPE,
             dtype=torch.float32, trace=events, communicator=comm)
    return events


def simulate(programs, forward_cost=1.0, backward_cost=2.0, vp_size=1):
    """Play the ranks' programs against each other; returns ``(step_time, idle_fractions)``.

    A chunk's forward costs ``forward_cost / vp_size`` and its backward
    ``backward_cost / vp_size``; communication is free. Raises RuntimeError on a deadlock
    or on messages left unmatched at the end.
    """
    size = len(programs)
    cursor, clock, busy = [0] * size, [0.0] * size, [0.0] * size
    posted = [None] * size  # this rank's current exchange: [(side, channel, index), ...]
    sides = {"send": collections.defaultdict(list), "recv": collections.defaultdict(list)}
    cost = {"F": forward_cost / vp_size, "B": backward_cost / vp_size}
    while any(cursor[r] < len(programs[r]) for r in range(size)):
        progressed = False
        for r in range(size):
            while cursor[r] < len(programs[r]):
                event = programs[r][cursor[r]]
                if event[0] in cost:
                    clock[r] += cost[event[0]]
                    busy[r] += cost[event[0]]
                    cursor[r] += 1
                    progressed = True
                    continue
                if posted[r] is None:  # post every op of the batch at once
                    posted[r] = []
                    for kind, peer, tag in event[1]:
                        channel = (r, peer, tag) if kind == "send" else (peer, r, tag)
                        sides[kind][channel].append(clock[r])
                        posted[r].append((kind, channel, len(sides[kind][channel]) - 1))
                    progressed = True
                finish = clock[r]
                for kind, channel, index in posted[r]:
                    other = sides["recv" if kind == "send" else "send"][channel]
                    if len(other) <= index:
                        break
                    finish = max(finish, other[index])
                else:
                    clock[r], posted[r] = finish, None
                    cursor[r] += 1
                    progressed = True
                    continue
                break  # waiting for a peer
        if not progressed:
            raise RuntimeError(f"the schedule deadlocks: ranks stuck at events {cursor} of "
                               f"{[len(p) for p in programs]}")
    for channel, sent in sides["send"].items():
        if len(sent) != len(sides["recv"].get(channel, [])):
            raise RuntimeError(f"channel {channel}: {len(sent)} sends but "
                               f"{len(sides['recv'].get(channel, []))} receives")
    total = max(clock)
    return total, [1.0 - b / total for b in busy]


def ideal_bubble(pp_size, vp_size, num_microbatches, forward_cost=1.0, backward_cost=2.0):
    """Mean idle fraction of the stages of the replayed schedule (free communication)."""
    vp_size = vp_size or 1
    programs = [record_program(pp_size, r, vp_size, num_microbatches) for r in range(pp_size)]
    _, idle = simulate(programs, forward_cost, backward_cost, vp_size)
    return sum(idle) / pp_size
