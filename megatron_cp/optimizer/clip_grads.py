"""Global gradient norm over every model-parallel rank, and clipping by it.

Each rank holds part of the model. After the data-parallel gradient reduction, gradients
are identical across the DP and CP ranks (dense) or the expert-DP ranks (experts), so the
norm is reduced only over the groups along which the *parameters themselves* differ:

* dense params differ over TP (sharded ones) and PP (different layers): reduce over
  ``tp`` then ``pp``. A param replicated over TP (no ``tensor_model_parallel``) is
  counted on TP rank 0 only, and a tied word embedding (``shared_embedding``) is counted
  on the first pipeline stage only, so nothing is counted twice;
* expert params (``is_expert``) differ over EP (different experts), ETP (sharded when
  ``tensor_model_parallel``) and PP: reduce over ``ep``, ``etp`` then ``pp``; the
  replicated-over-ETP ones are counted on ETP rank 0 only.

The same rule gives the parameter norm of ``--log-params-norm`` (``get_param_norm``), the
zeros of ``--log-num-zeros-in-grad`` (``count_zeros``) and, through ``counted_here``, the
whole-model parameter count of the start-up banner.

With ``sharded=True`` (the distributed optimizer) each rank holds a disjoint shard of the
gradients of its model-parallel rank: the dense part is first summed over ``dp_cp`` and the
expert part over ``edp`` (each shard counted once; with several optimizer instances, over
one instance, which holds every shard once), then reduced as above.

Every rank issues the same collectives, whether or not it holds expert params, so a
pipeline stage without MoE layers cannot deadlock one with them.
"""
import math

import torch
import torch.distributed as dist

from megatron_cp.distributed.initialize import optimizer_groups
from megatron_cp.distributed.data_parallel import grad_of
from megatron_cp.distributed.shards import local_tensor


def counted_here(param, state):
    """True if this rank owns the contribution of ``param`` to a whole-model norm or parameter
    count (no double counting; see the module docstring)."""
    if getattr(param, "shared_embedding", False) and state.size("pp") > 1 \
            and not state.is_pipeline_first_stage:
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    tp_name = "etp" if getattr(param, "is_expert", False) else "tp"
    return state.rank(tp_name) == 0


def _all_reduce(tensor, state, name, op):
    if state.size(name) > 1:
        dist.all_reduce(tensor, op=op, group=state.group(name))


def get_grad_norm(params, state, norm_type=2, sharded=False):
    """The norm of all gradients of the whole model, the same float on every rank.

    ``params`` are this rank's parameters (model params, or fp32 main params carrying the
    same attributes); those without a gradient are ignored. ``norm_type`` is 2 (default),
    any p >= 1, or ``inf``. ``sharded``: the params are this rank's distributed-optimizer
    shards (module docstring).
    """
    return _global_norm(params, state, norm_type, grad_of, sharded)


def get_param_norm(params, state, norm_type=2, sharded=False):
    """The norm of all parameters of the whole model (Megatron's ``params norm``), counting
    each parameter once whatever the layout; the same float on every rank. ``sharded``:
    the params are FSDP's (each rank holds its rows of each)."""
    return _global_norm(params, state, norm_type,
                        lambda param: local_tensor(param).detach(), sharded)


def count_zeros(params, state, sharded=False):
    """The number of zero entries in all gradients of the whole model (Megatron's ``num
    zeros``), each parameter counted once whatever the layout; the same int on every rank."""
    dense, expert = _owned(params, state, grad_of)

    def local(tensors):  # [1], fp64: exact for any count a model can hold; no host sync
        zeros = torch.zeros(1, dtype=torch.float64, device=state.device)
        for t in tensors:
            zeros += (t == 0).sum()
        return zeros

    both = _reduce_over_model(local(dense), local(expert), state, dist.ReduceOp.SUM, sharded)
    return int(both.sum().item())


def _owned(params, state, tensor_of):
    """(dense, expert) lists of ``tensor_of(param)`` for the params this rank counts."""
    seen, dense, expert = set(), [], []
    for param in params:
        tensor = tensor_of(param)
        if tensor is None or id(param) in seen or not counted_here(param, state):
            continue
        seen.add(id(param))
        (expert if getattr(param, "is_expert", False) else dense).append(tensor)
    return dense, expert


def _reduce_over_model(dense_part, expert_part, state, op, sharded):
    """Both [1] parts reduced over the groups the parameters differ along (module
    docstring); returns them as one [2] tensor (dense, expert), the same on every rank."""
    if sharded:  # one optimizer instance holds every shard once
        _all_reduce(dense_part, state, optimizer_groups(state, False)[0], op)
        _all_reduce(expert_part, state, optimizer_groups(state, True)[0], op)
    _all_reduce(expert_part, state, "ep", op)
    _all_reduce(expert_part, state, "etp", op)
    _all_reduce(dense_part, state, "tp", op)
    both = torch.cat([dense_part, expert_part])  # [2]: dense, expert
    _all_reduce(both, state, "pp", op)
    return both


def _global_norm(params, state, norm_type, tensor_of, sharded=False):
    """The ``norm_type`` norm of ``tensor_of(param)`` over the whole model (None: skipped)."""
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type >= 1.0):
        raise ValueError(f"norm_type ({norm_type}) must be >= 1 or inf; use 2 for the L2 norm")
    dense, expert = _owned(params, state, tensor_of)

    def local(tensors):
        # Accumulate in fp32 whatever the dtype: bf16 squares overflow and lose bits.
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=state.device)
        norms = torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=torch.float32)
                             for t in tensors]).to(state.device)  # FSDP2's host rows: here
        return norms.max() if norm_type == math.inf else norms.pow(norm_type).sum()

    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    both = _reduce_over_model(local(dense).reshape(1), local(expert).reshape(1), state, op,
                              sharded)
    if norm_type == math.inf:
        return both.max().item()
    return both.sum().pow(1.0 / norm_type).item()


def clip_grad_norm(params, max_norm, state, norm_type=2, total_norm=None, sharded=False):
    """Scale all gradients in place so their global norm is at most ``max_norm``.

    Returns the global norm before clipping (computed with :func:`get_grad_norm` unless
    ``total_norm`` is given). Uses torch's ``max_norm / (norm + 1e-6)`` coefficient.
    ``sharded``: as in :func:`get_grad_norm`.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm ({max_norm}) must be > 0; pass --clip-grad 0 to disable clipping "
                         f"instead of calling clip_grad_norm")
    params = list(params)
    if total_norm is None:
        total_norm = get_grad_norm(params, state, norm_type, sharded)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        seen = set()
        for param in params:
            grad = grad_of(param)
            if grad is not None and id(param) not in seen:
                seen.add(id(param))
                grad.mul_(clip_coeff)
    return total_norm
