"""The optimizer and learning-rate schedule of a run's optimizer section (Megatron-LM's
``get_megatron_optimizer`` and ``get_optimizer_param_scheduler``): the param groups, the
optimizer over them (replicated, or sharded with ``--use-distributed-optimizer`` or
``--use-torch-fsdp2``; AdamW, or Muon and AdamW with ``--optimizer muon``) and the schedule
with ``--decoupled-lr``. Each function takes the sections it reads
(:class:`~megatron_cp.config.optimizer.OptimizerConfig`, the model's
:class:`~megatron_cp.config.model.GPTConfig`, the checkpoint's
:class:`~megatron_cp.config.checkpoint.CheckpointConfig`)."""
import torch

from megatron_cp.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_cp.distributed.fsdp import is_fully_sharded
from megatron_cp.optimizer.fsdp_optimizer import FullyShardedOptimizer
from megatron_cp.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_cp.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron_cp.optimizer.offload import OffloadSettings
from megatron_cp.optimizer.optimizer import (MixedPrecisionOptimizer, get_param_groups,
                                             mup_group_overrides)


def grad_scaler(optimizer):
    """fp16's loss scaler of the optimizer section ``optimizer``: constant with --loss-scale,
    else dynamic (None for fp32/bf16)."""
    if not optimizer.fp16:
        return None
    if optimizer.loss_scale:
        return ConstantGradScaler(optimizer.loss_scale)
    return DynamicGradScaler(initial_scale=optimizer.initial_loss_scale,
                             min_scale=optimizer.min_loss_scale,
                             growth_interval=optimizer.loss_scale_window,
                             hysteresis=optimizer.hysteresis)


def build_optimizer(optimizer, model, models, model_chunks, state, check_for_nan_in_grad=True):
    """The optimizer over ``models``' params (``model_chunks``: their DDP wrappers) that the
    optimizer section ``optimizer`` (:class:`~megatron_cp.config.optimizer.OptimizerConfig`)
    describes (the precision-aware moments' dtypes and the host offload go to the sharded
    optimizers, the only ones Megatron-LM builds them for); the model section ``model``
    (:class:`~megatron_cp.config.model.GPTConfig`) gives the params' dtype and muP's width
    multiplier."""
    mup = mup_group_overrides(model.mup_width_mult, optimizer.lr, optimizer.min_lr,
                              optimizer.adam_eps, optimizer.optimizer) if model.use_mup else None
    groups = get_param_groups(models, optimizer.weight_decay, optimizer.decoupled_lr is not None,
                              optimizer.uses_muon, optimizer.apply_wd_to_qk_layernorm, mup)
    settings = dict(lr=optimizer.lr, weight_decay=optimizer.weight_decay,
                    betas=(optimizer.adam_beta1, optimizer.adam_beta2), eps=optimizer.adam_eps,
                    clip_grad=optimizer.clip_grad, params_dtype=model.params_dtype,
                    grad_scaler=grad_scaler(optimizer),
                    check_for_nan_in_grad=check_for_nan_in_grad,
                    muon=optimizer if optimizer.uses_muon else None)
    master = optimizer.state_dtype("main_params_dtype")
    sharded = dict(offload=OffloadSettings.from_config(optimizer), precision=(
        optimizer.state_dtype("exp_avg_dtype"), optimizer.state_dtype("exp_avg_sq_dtype"),
        None if master == torch.float32 else master)
        if optimizer.use_precision_aware_optimizer else None)
    if optimizer.use_distributed_optimizer:
        return DistributedOptimizer(groups, model_chunks, state, **settings, **sharded)
    if is_fully_sharded(model_chunks):
        return FullyShardedOptimizer(groups, state, model_chunks=model_chunks, **settings,
                                     **sharded)
    return MixedPrecisionOptimizer(groups, state, **settings)


def build_scheduler(optimizer, checkpoint, param_optimizer):
    """The learning-rate and weight-decay schedule of ``param_optimizer``'s groups, as the
    optimizer section ``optimizer`` (:class:`~megatron_cp.config.optimizer.OptimizerConfig`)
    gives it; it counts iterations, or samples under a batch-size schedule
    (``optimizer.lr_counts_samples``, whose lengths the command line's checks converted).
    The checkpoint section ``checkpoint``
    (:class:`~megatron_cp.config.checkpoint.CheckpointConfig`) says whether a resumed
    schedule keeps its saved values or takes these."""
    incremented = optimizer.weight_decay_incr_style != "constant"
    return OptimizerParamScheduler(
        param_optimizer, max_lr=optimizer.lr, min_lr=optimizer.min_lr,
        lr_warmup_steps=optimizer.lr_warmup_steps, lr_decay_steps=optimizer.lr_decay_steps,
        lr_decay_style=optimizer.lr_decay_style, init_lr=optimizer.lr_warmup_init,
        start_wd=optimizer.start_weight_decay, end_wd=optimizer.end_weight_decay,
        wd_incr_style=optimizer.weight_decay_incr_style,
        wd_incr_steps=optimizer.wd_incr_steps if incremented else None,
        use_checkpoint_values=checkpoint.use_checkpoint_opt_param_scheduler,
        override_from_arguments=checkpoint.override_opt_param_scheduler,
        decoupled_lr=optimizer.decoupled_lr, decoupled_min_lr=optimizer.decoupled_min_lr,
        wsd_decay_steps=optimizer.wsd_decay_steps,
        lr_wsd_decay_style=optimizer.lr_wsd_decay_style)
