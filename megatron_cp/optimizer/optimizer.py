"""AdamW with fp32 main params for bf16/fp16 models, loss-scale handling and clipping.

``MixedPrecisionOptimizer`` keeps an fp32 copy ("main param") of every bf16/fp16 model
param and steps AdamW on those; fp32 model params are stepped directly, with no copy. One
``step()`` does: gradients -> fp32 main grads (``param.main_grad`` from
:class:`~megatron_cp.distributed.data_parallel.DistributedDataParallel` when present, else
``param.grad``), unscale and inf/nan check (when a grad scaler is set), global-norm
clipping, AdamW, and the copy of the main params back into the model params.

Without a grad scaler, ``check_for_nan_in_grad`` makes a non-finite gradient norm (the one
clipping computes anyway, identical on every rank) raise :class:`GradNormNotFinite` before
the update, on every rank at once; with a grad scaler an overflow is a skipped step instead.

Skipping on inf/nan must be agreed by every rank or the replicas diverge. ``found_inf`` is
reduced (MAX) over the whole world: reducing over ``mp`` would suffice for dense grads
(identical across DP x CP after the reduction) but expert grads differ across EP ranks,
which can lie outside the ``mp`` group, and one scalar per step costs nothing.

The inner torch optimizer is AdamW, or with ``muon`` Muon for the matrices chained with
AdamW (:mod:`megatron_cp.optimizer.inner`).

:meth:`MixedPrecisionOptimizer.param_shards` describes the optimizer state per model param
as flat ranges (the whole param here, a shard with the distributed optimizer), which is
what the layout-free checkpoint (``megatron_cp/checkpoint``) saves and loads.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_cp.resilience.faults import ranks_where
from megatron_cp.optimizer.clip_grads import clip_grad_norm, count_zeros, get_grad_norm, grad_of
from megatron_cp.optimizer.grad_scaler import DynamicGradScaler
from megatron_cp.optimizer.inner import (ADAM_KINDS, MUON_KINDS, build_inner, param_state,
                                         torch_optimizers)
from megatron_cp.optimizer.muon import Muon, Orthogonalizer

# Attributes that get_grad_norm and Muon read; main params carry them like their model params.
_PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride",
                "sequence_parallel", "is_expert", "shared_embedding", "qkv_split_shapes")
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _as_chunks(model):
    return list(model) if isinstance(model, (list, tuple)) else [model]


def no_weight_decay(name, ndim, apply_wd_to_qk_layernorm=False):
    """True for params that get no weight decay: 1-D params (biases, norm weights), names
    ending in ``bias``, and params of modules whose name ends in ``norm``; with
    ``apply_wd_to_qk_layernorm`` (Megatron-LM's flag) the QK norms' params are decayed."""
    module_name = name.rsplit(".", 1)[0] if "." in name else ""
    if apply_wd_to_qk_layernorm and module_name.endswith(("q_layernorm", "k_layernorm")):
        return False
    return ndim == 1 or name.endswith("bias") or module_name.endswith("norm")


def muon_settings(config):
    """Muon's keyword arguments (momentum, Nesterov) from the OptimizerConfig ``config``."""
    return dict(momentum=config.muon_momentum, nesterov=config.muon_nesterov)


def check_saved_groups(saved, groups):
    """Raise ValueError unless the saved param groups have the sizes of ``groups``."""
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in groups]:
        raise ValueError("the checkpoint's optimizer has other parameter groups than this run "
                         "(another model, --optimizer or --decoupled-lr?); resume with the "
                         "checkpoint's flags, or pass --no-load-optim")


class GradNormNotFinite(FloatingPointError):
    """The global gradient norm is NaN or inf (raised on every rank, before the update).

    ``grad_norm`` is the norm; ``ranks`` the global ranks whose own gradients (or shards)
    hold a NaN or inf."""

    def __init__(self, grad_norm, ranks):
        super().__init__(f"gradient norm {grad_norm} (non-finite gradients on ranks {ranks})")
        self.grad_norm, self.ranks = grad_norm, ranks


@dataclass
class ParamShard:
    """The flat elements ``[start, stop)`` of ``model_param`` that this rank's optimizer owns.

    ``main`` (fp32; None when the model param is its own fp32 main param) and the values of
    ``state`` (``{kind: tensor}``: Adam's ``exp_avg`` and ``exp_avg_sq``, or Muon's
    ``momentum_buffer``) are 1-D views of length ``stop - start`` of the live optimizer state.
    """
    model_param: torch.Tensor
    start: int
    stop: int
    main: torch.Tensor | None
    state: dict


def group_key(name, ndim, expert=False, embedding_or_output=False, decoupled_lr=False,
              muon=False, apply_wd_to_qk_layernorm=False, mup_hidden=False):
    """The param group of param ``name`` (``ndim`` dims; a routed ``expert``'s stacked
    weights; the word embedding or output layer): ``(optimizer, wd_mult, is_decoupled_lr,
    is_mup_hidden)``. ``mup_hidden``: muP scales this run's hidden params and this one is
    not of the embedding class; Adam's matrices among them are ``is_mup_hidden``
    (:func:`mup_group_overrides`).

    Muon takes Megatron-LM's 2-D weights (a routed expert's own ``[out, in]``, its weights
    being stacked ``[E, out, in]``) but not the embedding or output layer; no weight decay
    for 1-D params, names ending in ``bias`` and modules whose name ends in ``norm``, except
    the QK norms' with ``apply_wd_to_qk_layernorm`` (:func:`no_weight_decay`)."""
    matrix = ndim - (1 if expert else 0) == 2 and not embedding_or_output
    optimizer = "muon" if muon and matrix else "adam"
    return (optimizer, 0.0 if no_weight_decay(name, ndim, apply_wd_to_qk_layernorm) else 1.0,
            bool(decoupled_lr and embedding_or_output),
            bool(mup_hidden and optimizer == "adam" and ndim >= 2))


def mup_group_overrides(width_mult, lr, min_lr, adam_eps, optimizer="adam"):
    """Megatron-LM's muP settings of the ``is_mup_hidden`` groups: ``max_lr`` and ``min_lr``
    (the ends of their schedule) divided by ``width_mult``, and Adam's ``eps`` too (not
    with Muon, whose matrices are its own); None when ``width_mult`` is 1 (nothing
    scales). Vector-like params (1-D, the embeddings, the output layer) keep the base
    values."""
    if width_mult == 1.0:
        return None
    overrides = {"max_lr": lr / width_mult, "min_lr": min_lr / width_mult}
    if "adam" in optimizer:
        overrides["eps"] = adam_eps / width_mult
    return overrides


def group_order(key):
    """The order of the groups: Muon's first, then the decoupled ones last, decay first."""
    return key[0] != "muon", key[2], -key[1]


def get_param_groups(model, weight_decay, decoupled_lr=False, muon=False,
                     apply_wd_to_qk_layernorm=False, mup=None):
    """Split trainable params into groups by optimizer, weight decay and learning rate
    (:func:`group_key`, in :func:`group_order`).

    With ``decoupled_lr`` the params marked ``is_embedding_or_output_parameter`` form groups
    of their own (``is_decoupled_lr``: the LR scheduler gives them --decoupled-lr); with
    ``muon`` the matrices form ``optimizer: "muon"`` groups. ``model`` is a module or a list
    of model chunks. Groups carry ``wd_mult`` (1 or 0) and ``lr_mult`` for the LR scheduler;
    empty groups are left out. ``mup``: the overrides of :func:`mup_group_overrides` (None:
    no muP scaling), which the ``is_mup_hidden`` groups take: Adam's matrices that are not
    marked ``is_embedding_parameter`` (the embeddings and output layer, Megatron-LM's mark).
    """
    by_key, seen = {}, set()
    for chunk in _as_chunks(model):
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            key = group_key(name, param.dim(), getattr(param, "is_expert", False),
                            getattr(param, "is_embedding_or_output_parameter", False),
                            decoupled_lr, muon, apply_wd_to_qk_layernorm,
                            mup is not None and not _embedding_class(param))
            by_key.setdefault(key, []).append(param)
    return [{"params": by_key[key], "weight_decay": weight_decay * key[1], "wd_mult": key[1],
             "lr_mult": 1.0, "optimizer": key[0], "is_decoupled_lr": key[2],
             "is_mup_hidden": key[3], **(mup if key[3] else {})}
            for key in sorted(by_key, key=group_order)]


def _embedding_class(param):
    """Megatron-LM's muP embedding class: the embedding's and output layer's params (and the
    last stage's copy of a tied embedding)."""
    return getattr(param, "is_embedding_parameter", False) or \
        getattr(param, "shared_embedding", False)


class MixedPrecisionOptimizer:
    """AdamW (and Muon) over fp32 main params; see the module docstring for one step's stages.

    ``model_params`` is an iterable of params or of param-group dicts (as from
    :func:`get_param_groups`); ``muon``: the OptimizerConfig whose Muon settings step the
    ``optimizer: "muon"`` groups. ``params_dtype`` is the model's dtype (fp32, bf16 or fp16);
    fp16 without a ``grad_scaler`` gets a :class:`DynamicGradScaler`. ``clip_grad`` <= 0
    disables clipping (the norm is still computed and returned). ``check_for_nan_in_grad``:
    raise :class:`GradNormNotFinite` instead of stepping on a NaN/inf norm (no grad scaler).
    """

    # the grads are this rank's distributed-optimizer shards (norms sum them over DP x CP)
    shards_grads = False
    # step() also counts the gradient's zero entries (--log-num-zeros-in-grad)
    count_zeros_in_grad = False

    def __init__(self, model_params, state, lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                 clip_grad=1.0, params_dtype=torch.float32, grad_scaler=None, use_fused=None,
                 check_for_nan_in_grad=False, muon=None):
        groups = self._setup(model_params, state, clip_grad, params_dtype, grad_scaler)
        self.check_for_nan_in_grad = check_for_nan_in_grad
        self._pairs = []  # (model param, main param); the same object twice for fp32 params
        main_groups = []
        for group in groups:
            mains = []
            for param in group["params"]:
                if param.dtype == torch.float32:
                    main = param
                elif param.dtype == params_dtype:
                    main = param.detach().clone().float()
                    for attr in _PARAM_ATTRS:
                        if hasattr(param, attr):
                            setattr(main, attr, getattr(param, attr))
                else:
                    raise ValueError(f"a parameter of shape {tuple(param.shape)} has dtype {param.dtype} "
                                     f"but params_dtype is {params_dtype}; cast the model to "
                                     f"params_dtype (fp32 params are allowed too)")
                self._pairs.append((param, main))
                mains.append(main)
            main_groups.append({**group, "params": mains})

        def make_muon(groups):
            return Muon(groups, Orthogonalizer(muon, state), lr=lr, weight_decay=weight_decay,
                        **muon_settings(muon))
        self.optimizer = build_inner(main_groups, lr, weight_decay, betas, eps, state.device,
                                     use_fused, make_muon)

    def _setup(self, model_params, state, clip_grad, params_dtype, grad_scaler):
        """Check the dtype, keep the shared settings; returns the param groups (dicts)."""
        if params_dtype not in (torch.float32,) + _HALF_DTYPES:
            raise ValueError(f"params_dtype {params_dtype} is not supported; use torch.float32, "
                             f"torch.bfloat16 or torch.float16")
        if params_dtype == torch.float16 and grad_scaler is None:
            grad_scaler = DynamicGradScaler()
        self.state = state
        self.clip_grad = float(clip_grad or 0.0)
        self.grad_scaler = grad_scaler
        self.num_skipped_iters = 0
        groups = list(model_params)
        if not groups:
            raise ValueError(f"{type(self).__name__} got no parameters; pass model.parameters() "
                             f"or get_param_groups(model, weight_decay)")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        return groups

    @property
    def param_groups(self):
        """The inner optimizer's groups (over main params): what the LR scheduler edits."""
        return self.optimizer.param_groups

    def get_loss_scale(self):
        """The current loss scale (1.0 without a grad scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss):
        """``loss * scale``: what backward should be called on."""
        return loss * self.get_loss_scale() if self.grad_scaler is not None else loss

    def _main_params(self):
        return [main for _, main in self._pairs]

    def _prepare_main_grads(self):
        for model, main in self._pairs:
            grad = model.main_grad if hasattr(model, "main_grad") else model.grad
            if main is model:
                if grad is not None and grad is not model.grad:
                    model.grad = grad if grad.dtype == model.dtype else grad.to(model.dtype)
            else:
                main.grad = None if grad is None else grad.float()  # no copy for fp32 main_grad

    def _release_aliased_grads(self):
        # A .grad aliasing main_grad must not survive: the next backward would add into it twice.
        for model, main in self._pairs:
            if main is model and hasattr(model, "main_grad"):
                model.grad = None

    @torch.no_grad()
    def _unscale_and_check_for_inf(self):
        inv_scale = self.grad_scaler.inv_scale
        found = torch.zeros(1, dtype=torch.float32, device=self.state.device)
        grads = [g for g in map(grad_of, self._main_params()) if g is not None]
        for grad in grads:
            grad.mul_(inv_scale)
        if grads:
            all_finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            found.fill_(0.0 if bool(all_finite) else 1.0)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)  # the whole world agrees (module docstring)
        return bool(found.item() > 0)

    @torch.no_grad()
    def step(self):
        """One optimizer step; returns ``(update_successful, grad_norm, num_zeros)``
        (``num_zeros``: the zero entries of the unscaled, unclipped gradient when
        ``count_zeros_in_grad`` is set, else None).

        On inf/nan gradients (only checked with a grad scaler) nothing changes but the scale
        and ``num_skipped_iters``, and ``(False, None, None)`` is returned.
        """
        self._prepare_main_grads()
        try:
            if self.grad_scaler is not None:
                found_inf = self._unscale_and_check_for_inf()
                self.grad_scaler.update(found_inf)
                if found_inf:
                    self.num_skipped_iters += 1
                    self._after_skipped_step()
                    return False, None, None
            mains = self._main_params()
            num_zeros = count_zeros(mains, self.state, sharded=self.shards_grads) \
                if self.count_zeros_in_grad else None
            if self.clip_grad > 0:
                grad_norm = clip_grad_norm(mains, self.clip_grad, self.state,
                                           sharded=self.shards_grads)
            else:
                grad_norm = get_grad_norm(mains, self.state, sharded=self.shards_grads)
            if self.check_for_nan_in_grad and not math.isfinite(grad_norm):
                raise GradNormNotFinite(grad_norm, self._ranks_with_non_finite_grads())
            self.optimizer.step()
            self._copy_main_to_model()
            return True, grad_norm, num_zeros
        finally:
            self._release_aliased_grads()

    def _ranks_with_non_finite_grads(self):
        """Collective (every rank is here together: the norm is the same everywhere)."""
        grads = [g for g in map(grad_of, self._main_params()) if g is not None]
        return ranks_where(any(not bool(torch.isfinite(g).all()) for g in grads), self.state.device)

    def _after_skipped_step(self):
        """After a skipped step: nothing to do (FP8 weights: the distributed optimizer)."""

    def _copy_main_to_model(self):
        for model, main in self._pairs:
            if main is not model:
                model.copy_(main)

    def zero_grad(self, set_to_none=True):
        """Drop model and main grads (the DDP buffer is zeroed by ``zero_grad_buffer``)."""
        for model, main in self._pairs:
            for param in (model, main):
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    @torch.no_grad()
    def reload_model_params(self):
        """Refresh the fp32 main params from the model (after loading model weights only)."""
        for model, main in self._pairs:
            if main is not model:
                main.copy_(model)

    def param_shards(self):
        """A :class:`ParamShard` per model param, in param-group order: the whole param here
        (the state created as zeros before the first step)."""
        shards = []
        for model, main in self._pairs:
            state = {kind: t.view(-1) for kind, t in param_state(self.optimizer, main).items()}
            shards.append(ParamShard(model, 0, model.numel(),
                                     None if main is model else main.view(-1), state))
        return shards

    def main_tensors(self):
        """The fp32 main params this optimizer holds apart from the model's params."""
        return [main for model, main in self._pairs if main is not model]

    def state_tensors(self):
        """The per-param state tensors as stored (Adam's moments in their dtypes, Muon's
        momentum), without step counters or fp16 scales."""
        return [st[kind] for opt in torch_optimizers(self.optimizer) for st in opt.state.values()
                for kind in ADAM_KINDS + MUON_KINDS if kind in st]

    def host_grad_tensors(self):
        """The host gradient copies of --optimizer-cpu-offload (none here)."""
        return [s.host_grad for s in getattr(self, "_shards", []) if s.host_grad is not None]

    def after_load(self):
        """After a checkpoint load wrote into :meth:`param_shards`' tensors: the fp16 moments
        of the precision-aware Adam take the values loaded into their fp32 copies, and the
        main params kept on the host (--optimizer-cpu-offload) those of fp32 model params.
        The model's weights are rounded from the loaded main params again: a checkpoint's
        weights may be another rounding of them (an --fp8-param-gather run saves its FP8
        weights dequantized)."""
        for opt in torch_optimizers(self.optimizer):
            if hasattr(opt, "absorb_loaded"):
                opt.absorb_loaded()
        with torch.no_grad():
            for model, main in self._pairs:
                if main is not model:
                    model.copy_(main)

    def finish_param_sync(self):
        """Nothing is gathered after a step here (the distributed optimizer waits for its
        parameter all-gathers)."""

    def state_dict(self):
        """Inner optimizer, grad scaler, fp32 main params and skip count.

        Like torch's, the tensors are live references: serialize before the next step.
        """
        return {"optimizer": self.optimizer.state_dict(),
                "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
                "main_params": [main for model, main in self._pairs if main is not model],
                "num_skipped_iters": self.num_skipped_iters}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`; the model params are rewritten from the main params."""
        check_saved_groups(state_dict["optimizer"]["param_groups"], self.optimizer.param_groups)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        saved_scaler = state_dict.get("grad_scaler")
        if self.grad_scaler is not None and saved_scaler is not None:
            self.grad_scaler.load_state_dict(saved_scaler)
        halves = [(model, main) for model, main in self._pairs if main is not model]
        saved = state_dict["main_params"]
        if len(saved) != len(halves):
            raise ValueError(f"checkpoint has {len(saved)} fp32 main params but this optimizer has "
                             f"{len(halves)}; load a checkpoint saved with the same model and params_dtype")
        for (model, main), value in zip(halves, saved):
            main.copy_(value)
            model.copy_(main)
        self.num_skipped_iters = int(state_dict.get("num_skipped_iters", 0))
