"""Muon (Megatron-LM's ``--optimizer muon``): momentum SGD whose step on a weight matrix is
the orthogonalised momentum.

One step on a matrix ``W`` with gradient ``g`` (Megatron-LM's emerging-optimizers Muon)::

    W -= lr * weight_decay * W                      (decoupled weight decay)
    m  = momentum * m + (1 - momentum) * g          (the momentum buffer)
    u  = g + momentum * (m - g)  with --muon-nesterov, else m
    W -= lr * extra_scale * scale(rows, cols) * NS(u)

``NS`` is the Newton-Schulz orthogonalisation (:mod:`.newton_schulz`) and ``scale`` the
``--muon-scale-mode`` factor of the whole matrix's shape. Which matrices: the 2-D weights of
the transformer layers (QKV, projections, MLP, router, shared-expert gate, learned position
table) and each routed expert's own ``[out, in]`` weights; the word embedding, the output
layer, biases and norms go to Adam (:func:`megatron_cp.optimizer.get_param_groups`). The
fused QKV weight is orthogonalised as its Q, K and V parts (over all query groups) unless
``--muon-no-split-qkv``.

A tensor-parallel shard is orthogonalised as the whole matrix (``--muon-tp-mode
duplicated``: gathered over TP, or ``distributed``: the Gram matrix summed over TP), or as
its own block (``blockwise``). :class:`Muon` steps whole params; :class:`ShardedMuon` steps
the distributed optimizer's flat shards, which hold pieces of matrices.
"""
import contextlib

import torch
import torch.distributed as dist

from megatron_cp.distributed.compat import all_gather_flat, reduce_scatter_flat
from megatron_cp.optimizer.newton_schulz import newton_schulz, update_scale


@contextlib.contextmanager
def _matmul_precision(precision, device):
    """torch's float32 matmul precision during Newton-Schulz, on CUDA (TF32 for "high");
    CPU matmuls stay fp32, so the result does not depend on the CPU's bf16 units."""
    if device.type != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class Orthogonalizer:
    """``(param, update) -> scaled NS(update)``: Muon's update of one parameter, ``update``
    of the param's shape (this rank's TP shard). ``config`` is the OptimizerConfig; ``state``
    the ParallelState with the TP and expert-TP groups (None: one process)."""

    def __init__(self, config, state=None):
        self.steps, self.kind = config.muon_num_ns_steps, config.muon_coefficient_type
        self.precision = config.muon_fp32_matmul_prec
        self.scale_mode, self.extra_scale = config.muon_scale_mode, config.muon_extra_scale_factor
        self.tp_mode, self.split_qkv = config.muon_tp_mode, config.muon_split_qkv
        self.state = state

    def __call__(self, param, update):
        with _matmul_precision(self.precision, update.device):
            if getattr(param, "is_expert", False):  # [E_local, out, in]: a matrix per expert
                return torch.stack([self._matrix(param, m, 1) for m in update.unbind(0)])
            return self._matrix(param, update, 0)

    def _split(self, param, leading):
        """(group, size, rank, dim) of the matrix's TP split (dim None: orthogonalised as
        it is); ``leading``: dims before the matrix's own (the expert dim)."""
        name = "etp" if getattr(param, "is_expert", False) else "tp"
        size = self.state.size(name) if self.state is not None else 1
        if size == 1 or self.tp_mode == "blockwise" or \
                not getattr(param, "tensor_model_parallel", False):
            return None, 1, 0, None
        return self.state.group(name), size, self.state.rank(name), param.partition_dim - leading

    def _matrix(self, param, m, leading):
        split = self._split(param, leading)
        parts = getattr(param, "qkv_split_shapes", None) if self.split_qkv else None
        if parts is None:
            return self._orthogonalize(m, *split)
        rows, cols = sum(parts), m.shape[-1]
        groups = m.shape[0] // rows
        pieces = m.view(groups, rows, cols).split(list(parts), dim=1)  # each [g, part, cols]
        out = [self._orthogonalize(p.reshape(-1, cols), *split).view(groups, -1, cols)
               for p in pieces]  # Q, K, V of every query group, each one matrix
        return torch.cat(out, dim=1).view_as(m)

    def _orthogonalize(self, m, group, size, rank, dim):
        """m [r, c] (this rank's part along ``dim`` of the whole matrix) -> its part of the
        scaled orthogonalised whole."""
        shape, bf16 = list(m.shape), self.precision == "medium"
        if dim is None:
            out = newton_schulz(m, self.steps, self.kind, bf16)
        else:
            shape[dim] *= size
            if self.tp_mode == "duplicated":
                parts = [torch.empty_like(m) for _ in range(size)]
                dist.all_gather(parts, m.contiguous(), group=group)
                whole = newton_schulz(torch.cat(parts, dim=dim), self.steps, self.kind, bf16)
                out = whole.chunk(size, dim=dim)[rank]
            else:  # distributed: the Gram matrix sums over the split dim
                out = newton_schulz(m, self.steps, self.kind, bf16, transpose=dim == 0,
                                    group=group)
        return out * (update_scale(*shape, self.scale_mode) * self.extra_scale)


class Muon(torch.optim.Optimizer):
    """Muon over whole params (the module docstring's step). ``orthogonalize(param,
    update)`` is an :class:`Orthogonalizer`; groups carry ``lr``, ``momentum`` and
    ``weight_decay`` (the LR scheduler sets the first and last)."""

    def __init__(self, params, orthogonalize, lr, momentum, nesterov=False, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.orthogonalize, self.nesterov = orthogonalize, nesterov

    def _momentum(self, group, p):
        """Weight decay on ``p`` and the momentum step; returns what is orthogonalised."""
        lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        if decay:
            p.add_(p, alpha=-decay * lr)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buffer = state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buffer, momentum) if self.nesterov else buffer

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = self._momentum(group, p)
                    p.add_(self.orthogonalize(p, update), alpha=-group["lr"])


class ShardedMuon(Muon):
    """Muon over the distributed optimizer's shards (``--optimizer dist_muon``): each rank
    keeps the momentum of its flat shard of the buckets (a shard may hold part of a matrix).

    Per bucket holding Muon params: each rank's momentum step on its shard, an all-gather of
    the bucket's update inputs, each whole matrix orthogonalised by one rank of the bucket's
    group (round robin: Megatron-LM's layer-wise split of the work), and a reduce-scatter
    that hands every rank its shard of the results (a sum with zeros: exact). ``shards``
    are this rank's ``_Shard``s of Muon params (their ``main`` are this optimizer's params);
    ``plan``: ``[(bucket, [(model param, owner group rank)])]``, alike on every rank.
    """

    def __init__(self, params, orthogonalize, shards, plan, **settings):
        super().__init__(params, orthogonalize, **settings)
        self.shard_of = {id(s.model): s for s in shards}
        self.plan = plan

    @torch.no_grad()
    def step(self, closure=None):
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for bucket, members in self.plan:
            flat = torch.zeros(bucket.grad_data.numel(), dtype=torch.float32,
                               device=bucket.grad_data.device)  # [n] update inputs
            mine = [(p, self.shard_of[id(p)]) for p, _ in members if id(p) in self.shard_of]
            for p, s in mine:
                lo = bucket.offsets[id(p)][0]
                flat[lo + s.start:lo + s.stop] = self._momentum(group_of[id(s.main)], s.main)
            first, last = bucket.shard_range()
            if bucket.group_size > 1:
                all_gather_flat(flat, flat[first:last].clone(), group=bucket.group)
            out = torch.zeros_like(flat)  # [n] the owners' orthogonalised updates
            for p, owner in members:
                if owner == bucket.group_rank:
                    lo, hi = bucket.offsets[id(p)]
                    out[lo:hi] = self.orthogonalize(p, flat[lo:hi].view(p.shape)).reshape(-1)
            if bucket.group_size > 1:
                own = torch.empty(last - first, dtype=out.dtype, device=out.device)
                reduce_scatter_flat(own, out, group=bucket.group)
            else:
                own = out[first:last]
            for p, s in mine:
                lo = bucket.offsets[id(p)][0] - first
                s.main.add_(own[lo + s.start:lo + s.stop], alpha=-group_of[id(s.main)]["lr"])


def sharding_plan(model_chunks, muon_params):
    """The :class:`ShardedMuon` plan: the buckets of ``model_chunks`` (DDP wrappers) that
    hold ``muon_params``, each param with the group rank that orthogonalises it."""
    wanted, plan, count = {id(p) for p in muon_params}, [], 0
    for chunk in model_chunks:
        for bucket in chunk.buckets:
            members = []
            for p in bucket.params:
                if id(p) in wanted:
                    members.append((p, count % bucket.group_size))
                    count += 1
            if members:
                plan.append((bucket, members))
    return plan
