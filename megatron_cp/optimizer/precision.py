"""AdamW whose moments are stored in a lower dtype between steps (Megatron-LM's
``--use-precision-aware-optimizer`` with ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``).

Megatron-LM hands these dtypes to Transformer Engine's FusedAdam, which keeps ``exp_avg`` and
``exp_avg_sq`` in the given dtype and computes every update in fp32: each moment is read into
fp32, the AdamW update runs in fp32, and the new moment is rounded back to its storage dtype
(bf16: a plain round to nearest). :class:`PrecisionAwareAdamW` does the same one param at a
time, through torch's own AdamW arithmetic, so with fp32 moments it is torch's AdamW bit for
bit. With ``--main-params-dtype fp16`` the optimizer's params are the model's own (shards)
and their masters live in the state in fp16, scaled per tensor as Transformer Engine keeps
them; each step reads a master into fp32, updates it, writes the model param from it and
stores it back.
"""
import torch
from torch.optim import adamw as torch_adamw

from megatron_cp.distributed.data_parallel import grad_of
from megatron_cp.optimizer.inner import ADAM_KINDS, build_adamw
from megatron_cp.optimizer.offload import HybridDeviceAdamW


MASTER = "master_param"  # Transformer Engine's name of the master copy in the state
# fp16 state is stored scaled so that its largest entry sits at half fp16's range
# (Transformer Engine's FusedAdam: amax / scale = 65504 / 2)
FP16_RANGE = torch.finfo(torch.float16).max / 2.0


class PrecisionAwareAdamW(torch.optim.AdamW):
    """torch's AdamW with ``exp_avg`` stored in ``exp_avg_dtype`` and ``exp_avg_sq`` in
    ``exp_avg_sq_dtype`` (module docstring); plain (non-fused, one tensor at a time) arithmetic
    on every device. fp16 moments are stored divided by a per-tensor fp32 scale
    (``<kind>_scale``) as Transformer Engine keeps them; :meth:`unscaled_state` gives their
    values for checkpoints and :meth:`absorb_loaded` stores what a load wrote into them."""

    def __init__(self, params, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 master_dtype=None, **kwargs):
        super().__init__(params, foreach=False, **kwargs)
        self.state_dtypes = dict(zip(ADAM_KINDS, (exp_avg_dtype, exp_avg_sq_dtype)))
        self.master_dtype = master_dtype  # fp16: the params' masters live in the state
        self._unscaled = {}  # param: {kind: fp32 values handed out by unscaled_state}

    def initialize_state(self, param):
        """Create ``param``'s step counter and zero moments in their storage dtypes."""
        state = self.state[param]
        state["step"] = torch.zeros((), dtype=torch.float32)
        for kind, dtype in self.state_dtypes.items():
            state[kind] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            if dtype == torch.float16:
                state[f"{kind}_scale"] = torch.ones(1, dtype=torch.float32, device=param.device)
        if self.master_dtype is not None:
            self._init_master(param)

    def _init_master(self, param):
        """The master copy of ``param`` in ``master_dtype`` (fp16: scaled per tensor)."""
        state = self.state[param]
        state[MASTER] = torch.empty_like(param, dtype=self.master_dtype)
        state[f"{MASTER}_scale"] = torch.ones(1, dtype=torch.float32, device=param.device)
        self._write(state, MASTER, param.detach().float().clone())

    @torch.no_grad()
    def reload_masters(self):
        """Masters kept in the state take the params' values (after loading weights)."""
        for group in self.param_groups:
            for param in group["params"]:
                if MASTER in self.state[param]:
                    self._write(self.state[param], MASTER, param.detach().float().clone())

    def unscaled_master(self, param):
        """An fp32 copy of ``param``'s master (checkpoints read it; a load's values are
        stored back by :meth:`absorb_loaded`)."""
        if "step" not in self.state[param]:
            self.initialize_state(param)
        values = self._read(self.state[param], MASTER)
        self._unscaled.setdefault(param, {})[MASTER] = values
        return values

    def _read(self, state, kind):
        """The fp32 values of a moment (the stored tensor itself when it is fp32)."""
        stored = state[kind]
        if stored.dtype == torch.float16:
            return stored.float().mul_(state[f"{kind}_scale"])
        return stored.float()

    @staticmethod
    def _write(state, kind, values):
        """Round fp32 ``values`` into the moment's storage (fp16: rescaled first)."""
        stored = state[kind]
        if values is stored:
            return
        if stored.dtype == torch.float16:
            scale = state[f"{kind}_scale"]
            torch.div(values.abs().max().reshape(1), FP16_RANGE, out=scale)
            values = values * torch.where(scale > 0, scale.reciprocal(), 0.0)
        stored.copy_(values)  # round to nearest in the storage dtype

    def unscaled_state(self, param):
        """``{kind: tensor}`` holding the moments' values: the stored tensors, or for fp16
        ones fp32 copies, which :meth:`absorb_loaded` stores back after a checkpoint load."""
        if "step" not in self.state[param]:
            self.initialize_state(param)
        state, out = self.state[param], {}
        for kind in ADAM_KINDS:
            if state[kind].dtype == torch.float16:
                out[kind] = self._unscaled.setdefault(param, {})[kind] = self._read(state, kind)
            else:
                out[kind] = state[kind]
        return out

    @torch.no_grad()
    def absorb_loaded(self):
        """Store into the fp16 moments the values a load wrote into :meth:`unscaled_state`'s
        copies."""
        for param, kinds in self._unscaled.items():
            for kind, values in kinds.items():
                self._write(self.state[param], kind, values)
        self._unscaled.clear()

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every param with a gradient, each in fp32 (module docstring)."""
        assert closure is None, "no closure: the loss comes from the schedule"
        self._unscaled.clear()  # copies handed out for a save are stale now
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                grad = grad_of(param)  # main_grad: a lower-precision param's fp32 gradient
                if grad is None:
                    continue
                if "step" not in self.state[param]:
                    self.initialize_state(param)
                state = self.state[param]
                moments = [self._read(state, kind) for kind in ADAM_KINDS]  # fp32
                master = self._read(state, MASTER) if MASTER in state else param
                torch_adamw.adamw([master], [grad.float()], moments[:1], moments[1:], [],
                                  [state["step"]], foreach=False, amsgrad=False, beta1=beta1,
                                  beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                                  eps=group["eps"], maximize=False)
                for kind, values in zip(ADAM_KINDS, moments):
                    self._write(state, kind, values)
                if master is not param:
                    param.copy_(master)  # the model param from the fp32 result
                    self._write(state, MASTER, master)

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
    exp_avg_sq dtype, master dtype or None)``) are fp32 (no master), else
    :class:`PrecisionAwareAdamW`. ``overlap``: the
    host copies on a side stream (--overlap-cpu-optimizer-d2h-h2d)."""
    if transfers is not None:
        return HybridDeviceAdamW(groups, transfers, lr, weight_decay, betas, eps, device,
                                 use_fused, overlap)
    exp_avg_dtype, exp_avg_sq_dtype, master_dtype = dtypes
    if exp_avg_dtype == exp_avg_sq_dtype == torch.float32 and master_dtype is None:
        return build_adamw(groups, lr, weight_decay, betas, eps, device, use_fused)
    return PrecisionAwareAdamW(groups, exp_avg_dtype=exp_avg_dtype,
                               exp_avg_sq_dtype=exp_avg_sq_dtype, master_dtype=master_dtype, lr=lr,
                               weight_decay=weight_decay, betas=tuple(betas), eps=eps)
