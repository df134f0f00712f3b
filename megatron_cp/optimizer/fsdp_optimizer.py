"""The optimizer of FSDP2's shards (:mod:`megatron_cp.distributed.fsdp`, ``--use-torch-fsdp2``
and Megatron-FSDP's sharding strategies): AdamW over each rank's fp32 rows of every parameter,
which are their own main params."""
import torch

from megatron_cp.distributed.fsdp import FLAG
from megatron_cp.distributed.shards import local_shard
from megatron_cp.optimizer.inner import build_inner, param_state
from megatron_cp.optimizer.optimizer import _PARAM_ATTRS, MixedPrecisionOptimizer, ParamShard


class _Shard:
    """This rank's rows of ``model`` (flat ``[start, stop)``): fp32, its own main param."""

    def __init__(self, model):
        self.model = model
        self.main, self.start, self.stop = local_shard(model)
        for attr in _PARAM_ATTRS:
            if hasattr(model, attr):
                setattr(self.main, attr, getattr(model, attr))


class FullyShardedOptimizer(MixedPrecisionOptimizer):
    """AdamW over this rank's FSDP shards, which are fp32 and their own main params (a
    bf16/fp16 model computes with them rounded, :mod:`megatron_cp.distributed.fsdp`); the step's stages are
    :class:`MixedPrecisionOptimizer`'s, on the shards.

    Muon orthogonalizes whole matrices, which FSDP holds only in pieces: not built here
    (as in Megatron-LM). The optimizer state lives in the shards, so checkpoints are
    written by ``--ckpt-format torch_dist`` (:meth:`param_shards`), not as one file.
    """

    shards_grads = True

    def __init__(self, model_params, state, lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                 clip_grad=1.0, params_dtype=torch.float32, grad_scaler=None, use_fused=None,
                 check_for_nan_in_grad=False, muon=None, model_chunks=()):
        self._chunks = list(model_chunks)  # their gathered params are stale after a step
        if muon is not None:
            raise ValueError(f"{FLAG} shards every matrix, and Muon orthogonalizes whole "
                             f"matrices: use --optimizer adam, or drop {FLAG}")
        groups = self._setup(model_params, state, clip_grad, params_dtype, grad_scaler)
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self._pairs = []  # the base class's (model, main) pairs: none, the shards replace them
        self._shards, inner_groups = [], []
        for group in groups:
            mains = []
            for param in group["params"]:
                if not hasattr(param, "main_grad"):
                    raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in a "
                                     f"TorchFullyShardedDataParallel wrapper; pass the param "
                                     f"groups of the wrapped model")
                if param.dtype != torch.float32:
                    raise ValueError(f"a parameter has dtype {param.dtype}: {FLAG} keeps fp32 "
                                     f"shards; wrap the model in TorchFullyShardedDataParallel")
                shard = _Shard(param)
                if shard.stop > shard.start:  # a param of fewer rows than ranks: none here
                    self._shards.append(shard)
                    mains.append(shard.main)
            inner_groups.append({**group, "params": mains})
        self.optimizer = build_inner(inner_groups, lr, weight_decay, betas, eps, state.device,
                                     use_fused, None)

    def _main_params(self):
        return [s.main for s in self._shards]

    def _prepare_main_grads(self):
        for s in self._shards:
            s.main.grad = s.model.main_grad.view_as(s.main)

    def _release_aliased_grads(self):
        for s in self._shards:
            s.main.grad = None

    def _copy_main_to_model(self):
        """The main params are the model's shards: nothing to copy; params kept whole
        (ZeRO-2) are freed, to be gathered updated by the next forward."""
        for chunk in self._chunks:
            chunk.reshard_params()

    def zero_grad(self, set_to_none=True):
        """Drop the shard grads (``zero_grad_buffer`` zeroes the ``main_grad``)."""
        for s in self._shards:
            s.main.grad = None

    def reload_model_params(self):
        """The main params are the model's shards: nothing to refresh after a load but the
        params kept whole (ZeRO-2), freed to be gathered anew."""
        for chunk in self._chunks:
            chunk.reshard_params()

    def param_shards(self):
        """A :class:`ParamShard` per param: this rank's rows, in param-group order; the fp32
        masters of a bf16/fp16 model are its main params (an fp32 model has none)."""
        return [ParamShard(s.model, s.start, s.stop,
                           s.main if hasattr(s.model, "compute_dtype") else None,
                           param_state(self.optimizer, s.main)) for s in self._shards]

    def state_dict(self):
        raise ValueError(f"{FLAG} keeps the optimizer state in shards: save with --ckpt-format "
                         f"torch_dist")

    def load_state_dict(self, state_dict):
        raise ValueError(f"{FLAG} keeps the optimizer state in shards: load a --ckpt-format "
                         f"torch_dist checkpoint")
