"""Optimizer side of training: loss scaling, global-norm clipping, mixed-precision AdamW and Muon, the distributed (ZeRO-1) optimizer, memory
accounting and the learning-rate schedule; factory.py builds them from the run's sections."""
from megatron_cp.optimizer.clip_grads import clip_grad_norm, get_grad_norm, grad_of
from megatron_cp.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_cp.optimizer.factory import build_optimizer, build_scheduler
from megatron_cp.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_cp.optimizer.inner import build_adamw
from megatron_cp.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron_cp.optimizer.memory import expected_bytes_per_param, memory_breakdown
from megatron_cp.optimizer.optimizer import (GradNormNotFinite, MixedPrecisionOptimizer,
                                             get_param_groups)

__all__ = [
    "ConstantGradScaler", "DistributedOptimizer", "DynamicGradScaler",
    "GradNormNotFinite", "MixedPrecisionOptimizer", "expected_bytes_per_param", "memory_breakdown",
    "OptimizerParamScheduler",
    "build_adamw", "build_optimizer", "build_scheduler", "clip_grad_norm",
    "get_grad_norm", "get_param_groups",
    "grad_of",
]
