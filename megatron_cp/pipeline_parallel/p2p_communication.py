"""Point-to-point communication between neighbouring pipeline stages.

Activations go forward (to the next stage) and their gradients backward (to the previous
stage) in buffers of ONE shape fixed by the config, ``[s / CP (/ TP with SP), b, h]``
(:func:`~megatron_cp.pipeline_parallel.stages.pipeline_tensor_shape`): a receiver
allocates its buffer without asking the sender, so there is never a per-batch shape
exchange. A tensor of another shape is refused before anything is sent.

Every exchange is one batch of ``isend``/``irecv`` (``torch.distributed.batch_isend_irecv``)
posted together and then waited for, so a stage that sends to its neighbour while the
neighbour sends back cannot deadlock. Ops are posted in one canonical order, forward
traffic (to next / from previous) before backward traffic (to previous / from next), and
tagged by direction. With PP=2 and interleaving, both neighbours are the same rank and
activations and gradients travel the same way; the order (NCCL, which ignores tags) and
the tag (gloo) keep them apart.

With ``--overlap-p2p-comm`` the schedules use :meth:`P2PCommunicator.post` instead: the
same ops, posted without waiting, in a :class:`P2PHandle` waited for only when a received
tensor is needed (:class:`Received`), so the latency hides behind compute. Each direction
(tag) keeps its order of ops, which is all gloo matches on (NCCL, matching by order
alone, would also need the halves of a split exchange in the same order on both sides).

The ranks form a ring: the "next" of the last stage is the first and the "previous" of
the first is the last, which only the interleaved schedule uses (virtual stage c on the
last rank feeds virtual stage c+1 on the first).
"""
import torch
import torch.distributed as dist

FORWARD_TAG = 0  # activations, previous -> next
BACKWARD_TAG = 1  # gradients, next -> previous


class P2PCommunicator:
    """Fixed-shape send/recv with the neighbours of this rank in its pipeline group.

    ``pp_ranks``: the global ranks of the pipeline group in stage order; ``pp_group``: its
    process group; ``tensor_shape``: the buffer shape; ``dtype``/``device`` of the buffers.
    """

    def __init__(self, pp_group, pp_ranks, pp_rank, tensor_shape, dtype, device):
        self.group = pp_group
        self.size = len(pp_ranks)
        self.rank = pp_rank
        self.next_rank = pp_ranks[(pp_rank + 1) % self.size]
        self.prev_rank = pp_ranks[(pp_rank - 1) % self.size]
        self.tensor_shape = tuple(int(n) for n in tensor_shape)
        self.dtype, self.device = dtype, device

    @classmethod
    def from_state(cls, state, tensor_shape, dtype):
        """The communicator of this rank's pipeline group in ``state``."""
        return cls(state.group("pp"), state.group_ranks("pp"), state.rank("pp"), tensor_shape,
                   dtype, state.device)

    @property
    def is_first_stage(self):
        return self.rank == 0

    @property
    def is_last_stage(self):
        return self.rank == self.size - 1

    def _check(self, tensor, what):
        if tuple(tensor.shape) != self.tensor_shape:
            raise ValueError(
                f"{what} has shape {list(tensor.shape)} but the pipeline buffers are "
                f"{list(self.tensor_shape)} ([s/CP(/TP with SP), micro batch, hidden]); every "
                f"microbatch must be padded to the pipeline sequence length "
                f"(--pipeline-seq-length, default --seq-length)")
        if tensor.dtype != self.dtype:
            raise ValueError(f"{what} has dtype {tensor.dtype}, the pipeline buffers {self.dtype}; "
                             f"the model and the schedule must agree on the activation dtype")

    def _buffer(self):
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)  # [s', b, h]

    def _ops(self, send_next, send_prev, recv_prev, recv_next):
        """The P2P ops of one exchange in the canonical order, and the receive buffers."""
        ops, from_prev, from_next = [], None, None
        if send_next is not None:
            self._check(send_next, "the activation sent to the next stage")
            # detach: the schedule may free the output's storage (deallocate_output_tensor)
            # while an async send is in flight; the detached view keeps the storage alive.
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), self.next_rank,
                                  self.group, tag=FORWARD_TAG))
        if recv_prev:
            from_prev = self._buffer()
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.group,
                                  tag=FORWARD_TAG))
        if send_prev is not None:
            self._check(send_prev, "the gradient sent to the previous stage")
            ops.append(dist.P2POp(dist.isend, send_prev.detach().contiguous(), self.prev_rank,
                                  self.group, tag=BACKWARD_TAG))
        if recv_next:
            from_next = self._buffer()
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.group,
                                  tag=BACKWARD_TAG))
        return ops, from_prev, from_next

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """One batched exchange with the neighbours; returns ``(from_prev, from_next)``.

        ``send_next``: activation for the next stage; ``send_prev``: gradient for the
        previous stage; ``recv_prev``/``recv_next``: receive an activation from the previous
        stage / a gradient from the next one (fresh buffers; None when not asked for).
        Returns once every op of the batch is complete, so sent tensors may be freed.
        """
        return self.post(send_next, send_prev, recv_prev, recv_next).wait()

    def post(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """The exchange of :meth:`communicate`, posted without waiting: a :class:`P2PHandle`."""
        ops, from_prev, from_next = self._ops(send_next, send_prev, recv_prev, recv_next)
        return P2PHandle(dist.batch_isend_irecv(ops) if ops else [], from_prev, from_next, ops)

    # Megatron's named exchanges of the (non-interleaved) 1F1B schedule; the first stage
    # receives no activation and the last stage no gradient.
    def recv_forward(self):
        """The activation from the previous stage (None on the first stage)."""
        return self.communicate(recv_prev=not self.is_first_stage)[0]

    def send_forward(self, output):
        """Send ``output`` to the next stage (nothing on the last stage)."""
        if not self.is_last_stage:
            self.communicate(send_next=output)

    def recv_backward(self):
        """The gradient of this stage's output from the next stage (None on the last)."""
        return self.communicate(recv_next=not self.is_last_stage)[1]

    def send_backward(self, input_grad):
        """Send the gradient of this stage's input to the previous stage (not from the first)."""
        if not self.is_first_stage:
            self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output):
        """Send ``output`` forward and receive its gradient, in one batch."""
        if self.is_last_stage:
            return None
        return self.communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):
        """Send ``input_grad`` backward and receive the next activation, in one batch."""
        if self.is_first_stage:
            return None
        return self.communicate(send_prev=input_grad, recv_prev=True)[0]


class P2PHandle:
    """An exchange in flight: :meth:`wait` completes it and returns ``(from_prev, from_next)``
    (idempotent); ``ops`` keeps the sent tensors alive until then."""

    def __init__(self, requests, from_prev, from_next, ops=()):
        self.requests, self.ops = list(requests), ops
        self.from_prev, self.from_next = from_prev, from_next  # [s', b, h] buffers or None

    def wait(self):
        for request in self.requests:
            request.wait()
        self.requests, self.ops = [], ()
        return self.from_prev, self.from_next

    def done(self):
        """Whether every op has completed (then the handle is waited, releasing the sends)."""
        if all(request.is_completed() for request in self.requests):
            self.wait()
            return True
        return False


class Received:
    """A tensor still being received: ``get()`` waits for its exchange and returns it
    (``index`` 0: from the previous stage, 1: from the next)."""

    def __init__(self, handle, index):
        self.handle, self.index = handle, index

    def get(self):
        return self.handle.wait()[self.index]


def resolve(item):
    """``item`` itself, or the tensor of a :class:`Received` once it has arrived."""
    return item.get() if isinstance(item, Received) else item
