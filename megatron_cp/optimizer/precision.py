"""AdamW whose moments are stored in a lower dtype between steps (Megatron-LM's
``--use-precision-aware-optimizer`` with ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``).

Megatron-LM hands these dtypes to Transformer Engine's FusedAdam, which keeps ``exp_avg`` and
``exp_avg_sq`` in the given dtype and computes every update in fp32: each moment is read into
fp32, the AdamW update runs in fp32, and the new moment is rounded back to its storage dtype
(bf16: a plain round to nearest). :class:`PrecisionAwareAdamW` does the same one param at a
time, through torch's own AdamW arithmetic, so with fp32 moments it is torch's AdamW bit for
bit. The main params stay fp32 (their lower dtypes are refused by the config).
"""
import torch
from torch.optim import adamw as torch_adamw

from megatron_cp.optimizer.inner import ADAM_KINDS, build_adamw
from megatron_cp.optimizer.offload import HybridDeviceAdamW


class PrecisionAwareAdamW(torch.optim.AdamW):
    """torch's AdamW with ``exp_avg`` stored in ``exp_avg_dtype`` and ``exp_avg_sq`` in
    ``exp_avg_sq_dtype`` (module docstring); plain (non-fused, one tensor at a time) arithmetic
    on every device."""

    def __init__(self, params, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 **kwargs):
        super().__init__(params, foreach=False, **kwargs)
        self.state_dtypes = dict(zip(ADAM_KINDS, (exp_avg_dtype, exp_avg_sq_dtype)))

    def initialize_state(self, param):
        """Create ``param``'s step counter and zero moments in their storage dtypes."""
        state = self.state[param]
        state["step"] = torch.zeros((), dtype=torch.float32)
        for kind, dtype in self.state_dtypes.items():
            state[kind] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every param with a gradient, each in fp32 (module docstring)."""
        assert closure is None, "no closure: the loss comes from the schedule"
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if "step" not in self.state[param]:
                    self.initialize_state(param)
                state = self.state[param]
                moments = [state[kind].float() for kind in ADAM_KINDS]  # fp32 (copies if lower)
                torch_adamw.adamw([param], [param.grad.float()], moments[:1], moments[1:], [],
                                  [state["step"]], foreach=False, amsgrad=False, beta1=beta1,
                                  beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                                  eps=group["eps"], maximize=False)
                for kind, value in zip(ADAM_KINDS, moments):
                    if value is not state[kind]:
                        state[kind].copy_(value)  # rounded to the storage dtype

    def load_state_dict(self, state_dict):
        """torch's load casts the moments to the params' dtype: cast them back."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for kind, dtype in self.state_dtypes.items():
                if kind in state and state[kind].dtype != dtype:
                    state[kind] = state[kind].to(dtype)


def build_precision_aware(groups, lr, weight_decay, betas, eps, device, use_fused, dtypes,
                          transfers=None, overlap=False):
    """The inner Adam of the precision-aware optimizer over ``groups``: with ``transfers``
    (the offloaded params', :func:`~megatron_cp.optimizer.offload.offload_transfers`) the
    hybrid device/host AdamW, else torch's AdamW when ``dtypes`` (``(exp_avg dtype,
    exp_avg_sq dtype)``) are fp32, else :class:`PrecisionAwareAdamW`. ``overlap``: the
    host copies on a side stream (--overlap-cpu-optimizer-d2h-h2d)."""
    if transfers is not None:
        return HybridDeviceAdamW(groups, transfers, lr, weight_decay, betas, eps, device,
                                 use_fused, overlap)
    if all(dtype == torch.float32 for dtype in dtypes):
        return build_adamw(groups, lr, weight_decay, betas, eps, device, use_fused)
    exp_avg_dtype, exp_avg_sq_dtype = dtypes
    return PrecisionAwareAdamW(groups, exp_avg_dtype=exp_avg_dtype,
                               exp_avg_sq_dtype=exp_avg_sq_dtype, lr=lr,
                               weight_decay=weight_decay, betas=tuple(betas), eps=eps)
