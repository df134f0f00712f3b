"""A ring of point-to-point exchanges: each rank sends to the next rank of its group and
receives from the previous one, with batched ``isend/irecv`` posted before the compute they
should hide behind (on a GPU on a side stream from :mod:`megatron_cp.distributed.device`; on
the CPU the stream helpers do nothing). Context parallelism's ring attention rotates K/V with
it, and ``--tp-comm-overlap`` its TP ring of partial matmuls."""
import torch
import torch.distributed as dist

from megatron_cp.distributed import device as device_mod


def _side_waits_for_compute(stream, device):
    # The side stream must see everything the compute stream queued (the tensors it sends).
    device_mod.side_waits_for_current(stream, device)


class RingExchange:
    """Rotate tensors around the ring of ``group``: send to rank+1, receive from rank-1.

    ``post(tensors)`` starts the exchange of a list of tensors (returns at once); ``wait()``
    returns the received list (same shapes/dtypes) after the compute stream has been made
    to wait for it. Every rank posts the same sequence of exchanges, so the batched
    isend/irecv pairs match and cannot deadlock. ``tag`` (+ position in the list) keeps
    concurrent rings on the same ranks (KV and dKV) apart on gloo.
    """

    def __init__(self, group, device, tag=0):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.device, self.tag = group, device, tag
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)
        self.stream = device_mod.side_stream(device)
        self._pending = None

    def post(self, tensors):
        assert self._pending is None, "wait() for the previous exchange first"
        tensors = [t.contiguous() for t in tensors]  # kernels may return permuted layouts
        received = [torch.empty_like(t) for t in tensors]
        _side_waits_for_compute(self.stream, self.device)
        with device_mod.stream_context(self.stream):
            ops = [dist.P2POp(dist.isend, t, self.next_rank, self.group, self.tag + n)
                   for n, t in enumerate(tensors)]
            ops += [dist.P2POp(dist.irecv, t, self.prev_rank, self.group, self.tag + n)
                    for n, t in enumerate(received)]
            requests = dist.batch_isend_irecv(ops)
        self._pending = (requests, tensors, received)  # keep the sent tensors alive until done

    def wait(self):
        requests, _, received = self._pending
        self._pending = None
        for request in requests:
            request.wait()
        device_mod.wait_stream(self.stream)
        return received
