"""The distributed optimizer (ZeRO-1, Megatron-LM's ``--use-distributed-optimizer``).

The fp32 main params and the Adam moments (Muon's momentum with ``--optimizer dist_muon``,
:class:`~megatron_cp.optimizer.muon.ShardedMuon`) are sharded over the data-parallel ranks: dense
params over DP x CP, expert params over expert-DP (with ``--num-distributed-optimizer-instances``
K, over one of K slices of those groups, each slice a full copy of the optimizer: see
:mod:`megatron_cp.distributed.buckets`). The shards are exactly the bucket shards
of :mod:`megatron_cp.distributed.buckets` -- one layout for the gradient reduce-scatter,
the optimizer state and the parameter all-gather -- so a rank's shard of a bucket may hold
the tail of one param and the head of the next. One step:

1. the gradients were reduce-scattered by :class:`DistributedDataParallel`: this rank's
   shard of every bucket holds the summed gradient (the rest of the buffer is stale);
2. unscale and inf/nan check (the world agrees), clip by the global norm, each shard
   counted once (``sharded=True``: summed over DP x CP, then over TP/PP as usual);
3. AdamW on the shard main params; the result is written into this rank's shard of the
   flat parameter buffer (fp32 models: the main param *is* that view, nothing to copy);
4. every bucket's param buffer is all-gathered over its group (asynchronously with
   ``overlap_param_gather``: the next forward waits per module).

With ``--fp8-param-gather`` the FP8 linears' weights (:class:`~megatron_cp.fp8.params.Fp8Weight`)
keep their bytes in uint8 param buffers: stage 3 quantizes each master shard
into them (Megatron-LM's ``quantize_param_shard``; the scales: :func:`~megatron_cp.fp8.params.
weight_scales`) and stage 4 gathers one byte per element. A skipped step casts too, so the
FP8 weights always carry the scales of the step about to run.

Memory per rank, per parameter: bf16/fp16 params 2 + fp32 grads 4 + (fp32 main 4 + Adam 8)
/ d bytes = 6 + 12/d; fp32 params 4 + grads 4 + Adam 8/d = 8 + 8/d
(:mod:`megatron_cp.optimizer.memory` measures it).

``state_dict`` gathers the shards into the plain :class:`MixedPrecisionOptimizer` format,
so ``--ckpt-format torch`` checkpoints are the same with or without this optimizer;
``--ckpt-format torch_dist`` saves the shards directly (:meth:`param_shards`).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_cp.distributed import compat as dist_compat
from megatron_cp.fp8.params import fp8_weights, weight_scales
from megatron_cp.fp8.scaling import quantize
from megatron_cp.optimizer.inner import (ADAM_KINDS, MUON_KINDS, adam_step, build_inner,
                                         param_state, set_adam_step, torch_optimizers)
from megatron_cp.optimizer.muon import Orthogonalizer, ShardedMuon, sharding_plan
from megatron_cp.optimizer.offload import offload_shards, offload_transfers
from megatron_cp.optimizer.precision import build_precision_aware
from megatron_cp.optimizer.optimizer import (_PARAM_ATTRS, MixedPrecisionOptimizer, ParamShard,
                                             check_saved_groups, muon_settings)


@dataclass
class _Shard:
    """Flat elements [start, stop) of ``model`` owned here: views into the DDP buffers."""
    model: torch.Tensor
    bucket: object
    start: int  # in the param's flat coordinates
    stop: int
    main: torch.Tensor  # [stop - start] fp32; the param-buffer view itself for fp32 params
    grad_view: torch.Tensor  # [stop - start] view of the gradient buffer
    param_view: torch.Tensor  # [stop - start] view of the parameter buffer
    host_grad: torch.Tensor | None = None  # offloaded: main is on the host, this its grad copy


class DistributedOptimizer(MixedPrecisionOptimizer):
    """AdamW (and Muon) over this rank's shards; see the module docstring for one step's stages.

    ``model_params`` as for :class:`MixedPrecisionOptimizer` (param groups from
    :func:`get_param_groups`); ``model_chunks`` are the
    :class:`DistributedDataParallel` wrappers built with ``use_distributed_optimizer=True``
    that hold those params.
    """

    shards_grads = True

    def __init__(self, model_params, model_chunks, state, lr, weight_decay=0.0,
                 betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0, params_dtype=torch.float32,
                 grad_scaler=None, use_fused=None, check_for_nan_in_grad=False, muon=None,
                 precision=None, offload=None):
        groups = self._setup(model_params, state, clip_grad, params_dtype, grad_scaler)
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self.model_chunks = list(model_chunks)
        location = {}
        for chunk in self.model_chunks:
            if not getattr(chunk, "use_distributed_optimizer", False):
                raise ValueError("DistributedOptimizer needs the model chunks wrapped in "
                                 "DistributedDataParallel(..., use_distributed_optimizer=True)")
            for bucket in chunk.buckets:
                for p in bucket.params:
                    location[id(p)] = bucket
        self._pairs = []  # the base class's (model, main) pairs: none, the shards replace them
        self._groups = groups
        self._shards = []
        per_group = []
        # --main-params-dtype fp16: the inner Adam steps the param views, masters in its state
        masters_in_state = precision is not None and precision[2] is not None
        self._masters_in_state = masters_in_state
        # --fp8-param-gather: the FP8 weights, their masters from the pending high precision
        self._fp8 = fp8_weights(self.model_chunks)
        if self._fp8 and (masters_in_state or offload is not None):
            raise ValueError("fp8_param_gather with main_params_dtype fp16 or "
                             "optimizer_cpu_offload is not built; drop one")
        initial = {id(p): p.take_pending() for p, _ in self._fp8}
        for group in groups:
            per_group.append([])
            for param in group["params"]:
                if id(param) not in location:
                    raise ValueError(f"a parameter of shape {tuple(param.shape)} is in no "
                                     f"DistributedDataParallel buffer; pass the param groups of "
                                     f"the wrapped model chunks")
                if param.dtype not in (torch.float32, params_dtype):
                    raise ValueError(f"a parameter has dtype {param.dtype} but params_dtype is "
                                     f"{params_dtype}; cast the model to params_dtype")
                shard = self._make_shard(param, location[id(param)], masters_in_state,
                                         initial.get(id(param)))
                if shard is not None:
                    self._shards.append(shard)
                    per_group[-1].append(shard)
        if offload is not None:
            offload_shards(self._shards, offload, proxy=lambda shard: shard.param_view)
        inner_groups = [{**group, "params": [s.main for s in shards]}
                        for group, shards in zip(groups, per_group)]

        def make_muon(groups):
            mains = {id(m) for g in groups for m in g["params"]}
            params = [p for g in self._groups if g.get("optimizer") == "muon" for p in g["params"]]
            return ShardedMuon(groups, Orthogonalizer(muon, state),
                               [s for s in self._shards if id(s.main) in mains],
                               sharding_plan(self.model_chunks, params), lr=lr,
                               weight_decay=weight_decay, **muon_settings(muon))
        if precision is None:
            self.optimizer = build_inner(inner_groups, lr, weight_decay, betas, eps,
                                         state.device, use_fused, make_muon)
        else:
            self.optimizer = build_precision_aware(
                inner_groups, lr, weight_decay, betas, eps, state.device, use_fused, precision,
                offload_transfers(self._shards, offload), offload is not None and offload.overlap)
        self._bucket_of = location
        if self._fp8:  # the FP8 weights from their masters, gathered
            self._cast_fp8()
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)

    @staticmethod
    def _make_shard(param, bucket, masters_in_state=False, initial=None):
        """This rank's :class:`_Shard` of ``param`` (None: it owns none of it); ``initial``:
        an FP8 weight's high-precision value, which its fp32 master starts from."""
        lo, hi = bucket.offsets[id(param)]
        first, last = bucket.shard_range()
        a, b = max(lo, first), min(hi, last)
        if a >= b:
            return None  # no element of this param in this rank's shard
        param_view = bucket.param_data[a:b]  # [b - a]; uint8 bytes of an FP8 weight
        grad_view = bucket.grad_data[a:b]
        if initial is not None:
            main = initial.reshape(-1)[a - lo:b - lo].float()  # [b - a]
        elif param.dtype == torch.float32 or masters_in_state:
            main = param_view
        else:
            main = param_view.detach().float()
        for attr in _PARAM_ATTRS:
            if hasattr(param, attr):
                setattr(main, attr, getattr(param, attr))
        return _Shard(param, bucket, a - lo, b - lo, main, grad_view, param_view)

    # ----- the step's stages (the base class's step() drives them) -----------------------
    def _main_params(self):
        """What clipping reads: the main params, or for those on the host the device param
        views carrying the gradient as ``main_grad``."""
        return [s.param_view if s.host_grad is not None else s.main for s in self._shards]

    def _prepare_main_grads(self):
        for s in self._shards:
            if s.host_grad is not None or self._masters_in_state:
                s.param_view.main_grad = s.grad_view  # the host copies it after clipping
            else:
                s.main.grad = s.grad_view if s.grad_view.dtype == torch.float32 \
                    else s.grad_view.float()

    def _release_aliased_grads(self):
        for s in self._shards:
            s.main.grad = None

    @torch.no_grad()
    def _copy_main_to_model(self):
        self.finish_param_sync()  # no gather may still be writing the param buffers
        for s in self._shards:
            if s.main is not s.param_view and not self._is_fp8(s):
                s.param_view.copy_(s.main)
        self._cast_fp8()
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    def _after_skipped_step(self):
        """The FP8 weights take the scales of the next step (delayed scaling moved them)."""
        if self._fp8:
            self._copy_main_to_model()

    @staticmethod
    def _is_fp8(shard):
        return getattr(shard.model, "fp8_storage", False)

    @torch.no_grad()
    def _cast_fp8(self):
        """Quantize every master shard of an FP8 weight into its param buffer's bytes, with
        the scale of the whole weight, and give every FP8 weight that scale (a collective
        over the sharding groups and TP groups; the bytes are gathered after)."""
        if not self._fp8:
            return
        shard_of = {id(s.model): s for s in self._shards if self._is_fp8(s)}
        rounded = {key: s.main.to(s.model.dtype) for key, s in shard_of.items()}  # [k]
        entries = [(meta, rounded.get(id(p)), self._bucket_of[id(p)].group_name)
                   for p, meta in self._fp8]
        for (param, meta), scale in zip(self._fp8, weight_scales(entries, self.state)):
            shard = shard_of.get(id(param))
            if shard is not None:  # its bytes in the param buffer
                shard.param_view.view(meta.fwd_dtype).copy_(
                    quantize(rounded[id(param)], scale, meta.fwd_dtype))
            param._scale.copy_(scale)

    def finish_param_sync(self):
        """Wait for the parameter all-gathers still running (``overlap_param_gather``)."""
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    def zero_grad(self, set_to_none=True):
        """Drop the shard grads (the DDP buffer is zeroed by ``zero_grad_buffer``)."""
        for s in self._shards:
            s.main.grad = None

    @torch.no_grad()
    def reload_model_params(self):
        """Refresh the fp32 main shards from the model params (after loading weights only)."""
        self.finish_param_sync()
        for s in self._shards:
            if self._is_fp8(s):  # the loaded high-precision weights (Fp8Weight.take_pending)
                s.main.copy_(s.model.take_pending().reshape(-1)[s.start:s.stop])
            elif s.main is not s.param_view:
                s.main.copy_(s.param_view)
        for param, _ in self._fp8:
            param.take_pending()  # also where this rank owns no shard
        for opt in torch_optimizers(self.optimizer):
            if hasattr(opt, "reload_masters"):
                opt.reload_masters()
        if self._fp8:
            self._cast_fp8()
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)

    def param_shards(self):
        """A :class:`ParamShard` per shard of this rank, in param-group order (an fp32 model's
        params are their own main params, on the host too; fp16 masters kept in the state
        appear as fp32 copies, which :meth:`after_load` stores back)."""
        return [ParamShard(s.model, s.start, s.stop, self._main_of(s),
                           param_state(self.optimizer, s.main)) for s in self._shards]

    def _main_of(self, s):
        if s.model.dtype == torch.float32:
            return None
        return self.optimizer.unscaled_master(s.main) if self._masters_in_state else s.main

    def main_tensors(self):
        """The main params apart from the param buffer: fp32 copies of a bf16/fp16 model's
        shards, the host copies of --optimizer-cpu-offload, the fp16 masters in the state."""
        return [s.main for s in self._shards if s.main is not s.param_view] + \
            [st["master_param"] for opt in torch_optimizers(self.optimizer)
             for st in opt.state.values() if "master_param" in st]

    @torch.no_grad()
    def after_load(self):
        """After a load: masters kept in the state take the loaded params' values (those
        loaded as main params then take theirs, in the base class), and an fp32 model's
        params on the host take the loaded values."""
        for opt in torch_optimizers(self.optimizer):
            if hasattr(opt, "reload_masters"):
                opt.reload_masters()
        super().after_load()
        for s in self._shards:
            if s.host_grad is not None and s.model.dtype == torch.float32:
                s.main.copy_(s.param_view)
        # the model's weights from the loaded masters (FP8 weights: cast), gathered: a
        # checkpoint's weights may be another rounding of them (an --fp8-param-gather run's
        # are its FP8 weights dequantized)
        rewritten = [s for s in self._shards if s.main is not s.param_view and
                     not self._is_fp8(s) and s.host_grad is None]
        for param, _ in self._fp8:
            param._pending = None  # a load's model weights: the masters came with it
        if rewritten or self._fp8:
            self.finish_param_sync()
            for s in rewritten:
                s.param_view.copy_(s.main)
            self._cast_fp8()
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)

    # ----- the plain (unsharded) format, for --ckpt-format torch --------------------------
    def _model_order(self):
        return [p for group in self._groups for p in group["params"]]

    def _kinds_of(self):
        """{id(model param): the state kinds its optimizer keeps}, whether or not this rank
        holds a shard of it."""
        return {id(p): MUON_KINDS if group.get("optimizer") == "muon" else ADAM_KINDS
                for group in self._groups for p in group["params"]}

    def _gather_full(self, kind):
        """{id(model param): full fp32 tensor} of ``kind`` (main, or a state kind: zeros for
        the params without it), all-gathered bucket by bucket over each bucket's group."""
        shards_of = {}
        for shard in self.param_shards():
            shards_of.setdefault(id(shard.model_param), shard)
        full = {}
        for chunk in self.model_chunks:
            for bucket in chunk.buckets:
                flat = torch.zeros(bucket.grad_data.numel(), dtype=torch.float32,
                                   device=bucket.grad_data.device)  # [n]
                for p in bucket.params:
                    shard = shards_of.get(id(p))
                    if shard is not None:
                        lo = bucket.offsets[id(p)][0]
                        value = shard.main if kind == "main" else shard.state.get(kind)
                        if value is not None:  # None: an fp32 param is its own main param
                            flat[lo + shard.start:lo + shard.stop].copy_(value)
                first, last = bucket.shard_range()
                if bucket.group_size > 1:
                    dist_compat.all_gather_flat(flat, flat[first:last].clone(), group=bucket.group)
                for p in bucket.params:
                    lo, hi = bucket.offsets[id(p)]
                    full[id(p)] = flat[lo:hi].view(p.shape)
        return full

    def state_dict(self):
        """The state in :class:`MixedPrecisionOptimizer`'s format (full tensors per param);
        a collective over every data-parallel group: call it on every rank."""
        self.finish_param_sync()
        order = self._model_order()
        step = torch.tensor([adam_step(self.optimizer)], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a rank may own no shard at all
        kinds_of = self._kinds_of()
        full = {kind: self._gather_full(kind) for kind in dict.fromkeys(
            k for kinds in kinds_of.values() for k in kinds)}
        half = [p for p in order if p.dtype != torch.float32]
        mains = self._gather_full("main") if half else {}
        state = {}
        if step.item() > 0:  # Adam steps along with Muon (norms, biases are always Adam's)
            for i, p in enumerate(order):
                state[i] = {kind: full[kind][id(p)] for kind in kinds_of[id(p)]}
                if kinds_of[id(p)] == ADAM_KINDS:
                    state[i]["step"] = torch.tensor(step.item(), dtype=torch.float32)
        groups, index = [], 0
        for outer, inner in zip(self._groups, self.optimizer.param_groups):
            count = len(outer["params"])
            hyper = {k: v for k, v in inner.items() if k != "params"}
            groups.append({**hyper, "params": list(range(index, index + count))})
            index += count
        return {"optimizer": {"state": state, "param_groups": groups},
                "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
                "main_params": [mains[id(p)] for p in half],
                "num_skipped_iters": self.num_skipped_iters}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Restore the plain format (from this optimizer or from MixedPrecisionOptimizer):
        each rank keeps its shards; the model params are refreshed from the main params."""
        saved = state_dict["optimizer"]
        order = self._model_order()
        check_saved_groups(saved["param_groups"], self._groups)
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        index_of = {id(p): i for i, p in enumerate(order)}
        half = [p for p in order if p.dtype != torch.float32]
        if len(state_dict["main_params"]) != len(half):
            raise ValueError(f"checkpoint has {len(state_dict['main_params'])} fp32 main params but "
                             f"this optimizer has {len(half)}; load a checkpoint saved with the "
                             f"same model and params_dtype")
        main_of = {id(p): value for p, value in zip(half, state_dict["main_params"])}
        step = 0.0
        for s, shard in zip(self._shards, self.param_shards()):
            per_param = saved["state"].get(index_of[id(s.model)])
            if per_param is not None:
                for kind, value in shard.state.items():
                    value.copy_(per_param[kind].reshape(-1)[s.start:s.stop])
                step = float(per_param.get("step", step))
            if id(s.model) in main_of:
                shard.main.copy_(main_of[id(s.model)].reshape(-1)[s.start:s.stop])
                if not self._is_fp8(s):
                    s.param_view.copy_(shard.main)
        set_adam_step(self.optimizer, step)
        self.after_load()  # FP8 weights: cast from the loaded masters
        saved_scaler = state_dict.get("grad_scaler")
        if self.grad_scaler is not None and saved_scaler is not None:
            self.grad_scaler.load_state_dict(saved_scaler)
        self.num_skipped_iters = int(state_dict.get("num_skipped_iters", 0))
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)
