"""The optimizer of FSDP2's shards (:mod:`megatron_cp.distributed.fsdp`, ``--use-torch-fsdp2``
and Megatron-FSDP's sharding strategies): AdamW over each rank's fp32 rows of every parameter,
which are their own main params. With ``--fp8-param-gather`` it also sets, after each update,
the scale with which each FP8 linear's weight is gathered (:mod:`megatron_cp.distributed.fsdp_fp8`)."""
import torch

from megatron_cp.distributed.fsdp import FLAG
from megatron_cp.distributed.fsdp_fp8 import Fp8Master
from megatron_cp.distributed.shards import local_shard, local_tensor
from megatron_cp.fp8.params import weight_scales
from megatron_cp.optimizer.inner import build_inner, param_state
from megatron_cp.optimizer.offload import offload_shards, offload_transfers
from megatron_cp.optimizer.precision import build_precision_aware
from megatron_cp.optimizer.optimizer import _PARAM_ATTRS, MixedPrecisionOptimizer, ParamShard


class _Shard:
    """This rank's rows of ``model`` (flat ``[start, stop)``): fp32, its own main param."""

    def __init__(self, model):
        self.model = model
        self.main, self.start, self.stop = local_shard(model)
        self.local = self.main  # the model's rows; ``main`` moves to the host when offloaded
        self.host_grad = None
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
                 check_for_nan_in_grad=False, muon=None, model_chunks=(), precision=None,
                 offload=None):
        self._chunks = list(model_chunks)  # their gathered params are stale after a step
        if muon is not None:
            raise ValueError(f"{FLAG} shards every matrix, and Muon orthogonalizes whole "
                             f"matrices: use --optimizer adam, or drop {FLAG}")
        groups = self._setup(model_params, state, clip_grad, params_dtype, grad_scaler)
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self._pairs = []  # the base class's (model, main) pairs: none, the shards replace them
        self._shards, per_group = [], []
        for group in groups:
            per_group.append([])
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
                    per_group[-1].append(shard)
        # FSDP2's CPUOffloadPolicy (offload fraction 1) holds the rows on the host already
        device = torch.device("cpu") if any(getattr(c, "offload_params", False)
                                            for c in self._chunks) else state.device
        if offload is not None and offload.fraction < 1.0:
            offload_shards(self._shards, offload, proxy=lambda shard: shard.local)
        else:
            offload = None
        inner_groups = [{**group, "params": [s.main for s in shards]}
                        for group, shards in zip(groups, per_group)]
        if precision is None:
            self.optimizer = build_inner(inner_groups, lr, weight_decay, betas, eps, device,
                                         use_fused, None)
        else:
            self.optimizer = build_precision_aware(
                inner_groups, lr, weight_decay, betas, eps, device, use_fused, precision,
                offload_transfers(self._shards, offload, lambda shard: shard.local.grad),
                offload is not None and offload.overlap)
        # --fp8-param-gather: (param, its Fp8Master) of every FP8 weight, in param order
        self._fp8 = [(p, local_tensor(p)) for g in groups for p in g["params"]
                     if isinstance(local_tensor(p), Fp8Master)]
        self._set_fp8_scales()

    @torch.no_grad()
    def _set_fp8_scales(self):
        """The scale each FP8 weight's rows are gathered with until the next update (a
        collective over DP x CP and the TP groups: :func:`~megatron_cp.fp8.params.
        weight_scales`)."""
        if not self._fp8:
            return
        rows = {id(s.model): s.local for s in self._shards}
        entries = [(m._meta, rows[id(p)].to(m._compute) if id(p) in rows else None,
                    "edp" if getattr(p, "is_expert", False) else "dp_cp") for p, m in self._fp8]
        for (_, master), scale in zip(self._fp8, weight_scales(entries, self.state)):
            master._scale.copy_(scale)

    def _main_params(self):
        """The model's rows (what clipping reads; on the host part a host copy steps)."""
        return [s.local for s in self._shards]

    def _prepare_main_grads(self):
        for s in self._shards:
            s.local.grad = s.model.main_grad.view_as(s.local)

    def _release_aliased_grads(self):
        for s in self._shards:
            s.local.grad = None

    def _copy_main_to_model(self):
        """The main params are the model's shards: nothing to copy; params kept whole
        (ZeRO-2) are freed, to be gathered updated by the next forward. Rows stepped on the
        host are copied back first."""
        for s in self._shards:
            if s.main is not s.local:
                s.local.copy_(s.main)
        self._set_fp8_scales()
        for chunk in self._chunks:
            chunk.reshard_params()

    def _after_skipped_step(self):
        """FP8 weights gathered with the next step's scales (delayed scaling moved them)."""
        self._set_fp8_scales()

    def zero_grad(self, set_to_none=True):
        """Drop the shard grads (``zero_grad_buffer`` zeroes the ``main_grad``)."""
        for s in self._shards:
            s.local.grad = None

    def main_tensors(self):
        """The host copies of --optimizer-cpu-offload (the rows are their own main params,
        counted as params)."""
        return [s.main for s in self._shards if s.main is not s.local]

    @torch.no_grad()
    def after_load(self):
        """After a load: the rows stepped on the host take the loaded model rows."""
        super().after_load()
        for s in self._shards:
            if s.main is not s.local:
                s.main.copy_(s.local)
        self._set_fp8_scales()

    def reload_model_params(self):
        """The main params are the model's shards: nothing to refresh after a load but the
        params kept whole (ZeRO-2), freed to be gathered anew."""
        self.after_load()
        for chunk in self._chunks:
            chunk.reshard_params()

    def param_shards(self):
        """A :class:`ParamShard` per param: this rank's rows, in param-group order; the fp32
        masters of a bf16/fp16 model are its main params (an fp32 model has none)."""
        return [ParamShard(s.model, s.start, s.stop,
                           s.local if hasattr(s.model, "compute_dtype") else None,
                           param_state(self.optimizer, s.main)) for s in self._shards]

    def state_dict(self):
        raise ValueError(f"{FLAG} keeps the optimizer state in shards: save with --ckpt-format "
                         f"torch_dist")

    def load_state_dict(self, state_dict):
        raise ValueError(f"{FLAG} keeps the optimizer state in shards: load a --ckpt-format "
                         f"torch_dist checkpoint")
