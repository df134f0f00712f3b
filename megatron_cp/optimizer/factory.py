"""The optimizer and learning-rate schedule that the parsed flags describe (Megatron-LM's
``get_megatron_optimizer`` and ``get_optimizer_param_scheduler``): the param groups, the
optimizer over them (replicated, or sharded with ``--use-distributed-optimizer`` or
``--use-torch-fsdp2``; AdamW, or Muon and AdamW with ``--optimizer muon``) and the schedule
with ``--decoupled-lr``."""
from megatron_cp.config.setting import build_config
from megatron_cp.config.optimizer import OptimizerConfig
from megatron_cp.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_cp.optimizer.fsdp import FullyShardedOptimizer, is_fully_sharded
from megatron_cp.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_cp.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron_cp.optimizer.optimizer import (MixedPrecisionOptimizer, get_param_groups,
                                             mup_group_overrides)


def grad_scaler(args):
    """fp16's loss scaler: constant with --loss-scale, else dynamic (None for fp32/bf16)."""
    if not args.fp16:
        return None
    if args.loss_scale:
        return ConstantGradScaler(args.loss_scale)
    return DynamicGradScaler(initial_scale=args.initial_loss_scale,
                             min_scale=args.min_loss_scale, growth_interval=args.loss_scale_window,
                             hysteresis=args.hysteresis)


def build_optimizer(args, models, model_chunks, state, check_for_nan_in_grad=True):
    """The optimizer over ``models``' params (``model_chunks``: their DDP wrappers)."""
    config = build_config(OptimizerConfig, args)
    mup = mup_group_overrides(args.mup_width_mult, args.lr, args.min_lr, args.adam_eps,
                              args.optimizer) if args.use_mup else None
    groups = get_param_groups(models, args.weight_decay, config.decoupled_lr is not None,
                              config.uses_muon, args.apply_wd_to_qk_layernorm,
                              mup)
    settings = dict(lr=args.lr, weight_decay=args.weight_decay,
                    betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                    clip_grad=args.clip_grad, params_dtype=args.params_dtype,
                    grad_scaler=grad_scaler(args), check_for_nan_in_grad=check_for_nan_in_grad,
                    muon=config if config.uses_muon else None)
    if args.use_distributed_optimizer:
        return DistributedOptimizer(groups, model_chunks, state, **settings)
    if is_fully_sharded(model_chunks):
        return FullyShardedOptimizer(groups, state, **settings)
    return MixedPrecisionOptimizer(groups, state, **settings)


def build_scheduler(args, optimizer):
    """The learning-rate and weight-decay schedule of ``optimizer``'s groups; it counts
    iterations, or samples under a batch-size schedule (``args.lr_counts_samples``, whose
    lengths the arguments converted)."""
    incremented = args.weight_decay_incr_style != "constant"
    return OptimizerParamScheduler(
        optimizer, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=args.lr_decay_steps, lr_decay_style=args.lr_decay_style,
        init_lr=args.lr_warmup_init, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_style=args.weight_decay_incr_style,
        wd_incr_steps=args.wd_incr_steps if incremented else None,
        use_checkpoint_values=args.use_checkpoint_opt_param_scheduler,
        override_from_arguments=args.override_opt_param_scheduler,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr)
