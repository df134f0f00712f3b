"""Data-parallel gradient reduction in flat buckets, and the end-of-step gradient fix-ups.

Megatron-style grad buffers: every trainable parameter gets ``param.main_grad``, a view
into one flat buffer per (dense/expert) set of params, fp32 by default. A
post-accumulate-grad hook adds ``param.grad`` into ``main_grad`` and frees ``param.grad``,
so microbatches accumulate in fp32 even for bf16/fp16 models and the reduction works in
place on contiguous slices (buckets) of the buffer with no flatten/unflatten copies. The
layout lives in :mod:`megatron_cp.distributed.buckets`.

The reduction is a SUM: the training loop makes each rank's loss
``sum(token_loss * mask) / global_num_tokens`` (tokens counted over the whole DP x CP
group), so the sum of the per-rank gradients is exactly the global-batch gradient. Dense
params reduce over ``dp_cp``, expert params (``is_expert``) over ``edp``.
``average_in_collective=True`` divides by the group size instead, for a loss that is a
per-rank mean. With ``use_distributed_optimizer`` each bucket is reduce-scattered instead
of all-reduced (every rank keeps the sum for its shard only) and, after the optimizer
step, the updated params are all-gathered bucket by bucket (``start_param_sync``); with
``overlap_param_gather`` those all-gathers run in the background and a forward pre-hook on
every module waits for the buckets of its own params only.

Buckets are launched strictly in one global order (the order backward fills them), never
out of order, so every rank issues the same collectives in the same sequence on every
group, which NCCL needs to avoid cross-communicator deadlocks.
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from megatron_cp.distributed.buckets import build_buckets


def grad_of(param):
    """The gradient the optimizer uses: ``.grad``, else the DDP ``.main_grad`` buffer view."""
    if param.grad is not None:
        return param.grad
    return getattr(param, "main_grad", None)


class DistributedDataParallel(nn.Module):
    """Wrap ``module``; gradients land in ``param.main_grad`` and are reduced over DP x CP.

    ``bucket_size_mb`` caps a bucket's size (None: one bucket per buffer). With
    ``overlap_grad_reduce`` a bucket's reduction starts, asynchronously, as soon as the last
    of its params got its gradient during backward; otherwise :meth:`finish_grad_sync`
    reduces every bucket. For gradient accumulation run every microbatch's backward but the
    last inside :meth:`no_sync`. ``grad_reduce_dtype`` is the buffer dtype (default fp32).
    ``use_distributed_optimizer`` shards the buckets for
    :class:`~megatron_cp.optimizer.distrib_optimizer.DistributedOptimizer` (module docstring).
    ``grad_check(index, grad_data)``, when set, sees each bucket's local gradient (``index``:
    its place in the launch order) just before its reduction starts: the result checks of
    :mod:`megatron_cp.resilience.rerun` (NaN, inf, unexpectedly large), made on every rank's own part.
    """

    def __init__(self, module, state, bucket_size_mb=40.0, overlap_grad_reduce=False,
                 average_in_collective=False, grad_reduce_dtype=torch.float32,
                 use_distributed_optimizer=False, overlap_param_gather=False):
        super().__init__()
        if bucket_size_mb is not None and not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb ({bucket_size_mb}) must be > 0, or None for one "
                             f"bucket per grad buffer")
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError("overlap_param_gather overlaps the distributed optimizer's parameter "
                             "all-gather: pass use_distributed_optimizer=True too "
                             "(--use-distributed-optimizer)")
        self.module = module
        self.state = state
        self.overlap_grad_reduce = overlap_grad_reduce
        self.average_in_collective = average_in_collective
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather
        self._sync_enabled = True
        self.grad_check = None
        params = [p for p in module.parameters() if p.requires_grad]
        # Backward produces grads roughly in reverse definition order: lay buffers out that way.
        order = list(reversed(params))
        position = {id(p): i for i, p in enumerate(order)}
        elem_bytes = torch.empty((), dtype=grad_reduce_dtype).element_size()
        bucket_numel = None if bucket_size_mb is None else max(1, int(bucket_size_mb * 2 ** 20 / elem_bytes))
        self.buffers, self.param_buffers, self.buckets = build_buckets(
            order, state, bucket_numel, grad_reduce_dtype, shard=use_distributed_optimizer)
        # One global launch order: by when backward completes the bucket (its latest param).
        self.buckets.sort(key=lambda b: max(position[id(p)] for p in b.params))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._accumulate_hook)
                              for p in params]
        if overlap_param_gather:
            for sub in module.modules():
                own = [self._bucket_of[id(p)] for p in sub.parameters(recurse=False)
                       if id(p) in self._bucket_of]
                if own:
                    self._hook_handles.append(sub.register_forward_pre_hook(
                        self._param_gather_hook(list({id(b): b for b in own}.values()))))

    def forward(self, *args, **kwargs):
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    def _accumulate_hook(self, param):
        param.main_grad.add_(param.grad)  # fp32 accumulation across microbatches
        param.grad = None
        if not (self._sync_enabled and self.overlap_grad_reduce):
            return
        bucket = self._bucket_of[id(param)]
        if bucket.launched or id(param) in bucket.ready:
            raise ValueError("a parameter got a second gradient while its bucket was being reduced; "
                             "run all microbatches but the last inside ddp.no_sync(), and call "
                             "finish_grad_sync() before the next backward")
        bucket.ready.add(id(param))
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)

    def _launch(self, bucket):
        if self.grad_check is not None:
            self.grad_check(self._next_launch, bucket.grad_data)
        bucket.start_grad_reduce(self.average_in_collective)
        self._next_launch += 1

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them (all microbatches but the last)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self):
        """Reduce the buckets not launched yet, in order, and wait for all of them (with
        several optimizer instances, each shard is then summed over them)."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        for bucket in self.buckets:
            bucket.finish_grad_reduce()
        self._reset_buckets()

    def _reset_buckets(self):
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.reset()
        self._next_launch = 0

    def zero_grad_buffer(self):
        """Zero every ``main_grad`` (call once per step, before the first microbatch)."""
        self._reset_buckets()
        for buffer in self.buffers:
            buffer.zero_()

    # ----- distributed optimizer: the parameter all-gather -------------------------------
    def start_param_sync(self, force_sync=False):
        """All-gather every bucket's updated param shards, first-used bucket first; in the
        background with ``overlap_param_gather`` (unless ``force_sync``), else now."""
        if not self.use_distributed_optimizer:
            return
        self.finish_param_sync()  # a bucket whose params no forward used may still be gathering
        overlap = self.overlap_param_gather and not force_sync
        for bucket in reversed(self.buckets):  # the forward meets the last-reduced bucket first
            bucket.start_param_gather(async_op=overlap)

    def finish_param_sync(self):
        """Wait for every pending parameter all-gather (call before reading the params
        outside a forward: saving, norms)."""
        for bucket in self.buckets:
            bucket.finish_param_gather()

    @staticmethod
    def _param_gather_hook(buckets):
        def hook(module, args):
            for bucket in buckets:
                bucket.finish_param_gather()
        return hook

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Load into the wrapped module."""
        if assign and self.use_distributed_optimizer:
            raise ValueError("assign=True would detach the params from the flat parameter "
                             "buffers of the distributed optimizer; load with assign=False")
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _as_chunks(model):
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _unique_params(chunks, predicate):
    seen, out = set(), []
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen and predicate(p) and grad_of(p) is not None:
                seen.add(id(p))
                out.append(p)
    return out


def _coalesced_all_reduce(grads, group):
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])  # [sum of numels]
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def allreduce_sequence_parallel_grads(model, state):
    """Sum the grads of ``sequence_parallel`` params over the ranks that each saw a slice of
    the tokens: TP for dense params, ETP for expert params (an MoE fc2 bias added once)."""
    for group_name, expert in (("tp", False), ("etp", True)):
        if state.size(group_name) == 1:
            continue
        params = _unique_params(_as_chunks(model), lambda p: getattr(p, "sequence_parallel", False)
                                and bool(getattr(p, "is_expert", False)) == expert)
        if params:
            _coalesced_all_reduce([grad_of(p) for p in params], state.group(group_name))


def allreduce_embedding_grads(model, state):
    """Sum the tied word-embedding grads of the first and last pipeline stage (no-op at pp=1).

    ``model`` is a module or the list of this rank's model chunks; the params marked
    ``shared_embedding`` are the input embedding (first stage) and output layer (last stage).
    """
    if state.size("pp") == 1 or state.rank("embedding") < 0 or state.size("embedding") < 2:
        return
    params = _unique_params(_as_chunks(model), lambda p: getattr(p, "shared_embedding", False))
    if params:
        _coalesced_all_reduce([grad_of(p) for p in params], state.group("embedding"))


def finalize_model_grads(model_chunks, state):
    """End of a training step's backward: DP/CP sync, SP grads over TP, tied embeddings over PP."""
    chunks = _as_chunks(model_chunks)
    for chunk in chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
    allreduce_sequence_parallel_grads(chunks, state)
    allreduce_embedding_grads(chunks, state)
