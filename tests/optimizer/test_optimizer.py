"""Loss scalers, LR schedules, param groups and the mixed-precision optimizer.

The scaler/schedule/group tests are single-process; the optimizer tests run on two gloo
workers (DP=2): an inf on one rank must make both skip, and a bf16 run resumed from a
state dict must repeat the original steps bit for bit.
"""
import copy
import io
import math

import pytest
import torch
from torch import nn

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.optimizer import (ConstantGradScaler, DynamicGradScaler, MixedPrecisionOptimizer,
                                   OptimizerParamScheduler, get_param_groups)
from megatron_cp.distributed.data_parallel import DistributedDataParallel, finalize_model_grads


def test_dynamic_scaler_hysteresis_backoff_and_growth():
    scaler = DynamicGradScaler(initial_scale=16.0, min_scale=2.0, growth_interval=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 16.0  # first bad step only uses up hysteresis
    scaler.update(True)
    assert scaler.scale == 8.0
    scaler.update(True)  # hysteresis stays exhausted: every further bad step backs off
    assert scaler.scale == 4.0
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 2.0  # clamped at min_scale
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 2.0
    scaler.update(False)
    assert scaler.scale == 4.0  # grew after growth_interval good steps; hysteresis refilled
    scaler.update(False)
    scaler.update(True)  # resets the growth counter, hysteresis 2 -> 1
    assert scaler.scale == 4.0
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 4.0
    resumed = DynamicGradScaler(initial_scale=16.0, min_scale=2.0, growth_interval=3, hysteresis=2)
    resumed.load_state_dict(scaler.state_dict())
    for found_inf in (False, True, True, False):
        scaler.update(found_inf)
        resumed.update(found_inf)
        assert resumed.scale == scaler.scale
    assert resumed.state_dict() == scaler.state_dict()
    assert scaler.inv_scale == 1.0 / scaler.scale


def test_scaler_validation():
    constant = ConstantGradScaler(128)
    constant.update(True)
    assert constant.scale == 128.0
    with pytest.raises(ValueError, match="loss scale"):
        ConstantGradScaler(0)
    with pytest.raises(ValueError, match="min_scale"):
        DynamicGradScaler(initial_scale=1.0, min_scale=4.0)
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicGradScaler(hysteresis=0)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicGradScaler(backoff_factor=2.0)


def _lrs(steps, **kwargs):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OptimizerParamScheduler(opt, **kwargs)
    out, done = {}, 0
    for step in steps:
        sched.step(step - done)
        done = step
        out[step] = opt.param_groups[0]["lr"]
    return out


def test_lr_schedules_against_hand_computed_values():
    linear = _lrs([0, 1, 2, 3, 6, 7], max_lr=1.0, min_lr=0.1, lr_warmup_steps=2,
                  lr_decay_steps=6, lr_decay_style="linear")
    expected = {0: 0.0, 1: 0.5, 2: 1.0, 3: 0.1 + 0.75 * 0.9, 6: 0.1, 7: 0.1}
    assert linear == pytest.approx(expected)
    cosine = _lrs([3, 4, 6, 9], max_lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_steps=6,
                  lr_decay_style="cosine")
    c3 = 0.5 * (math.cos(math.pi * 0.25) + 1.0)
    assert cosine == pytest.approx({3: 0.1 + 0.9 * c3, 4: 0.55, 6: 0.1, 9: 0.1})
    inv = _lrs([2, 4, 9, 16, 101], max_lr=1.0, min_lr=0.05, lr_warmup_steps=4,
               lr_decay_steps=100, lr_decay_style="inverse-square-root")
    assert inv == pytest.approx({2: 0.5, 4: 1.0, 9: 2.0 / 3.0, 16: 0.5, 101: 0.05})
    constant = _lrs([1, 5, 500], max_lr=0.3, lr_warmup_steps=2, lr_decay_style="constant",
                    init_lr=0.1)
    assert constant == pytest.approx({1: 0.2, 5: 0.3, 500: 0.3})


def test_scheduler_mults_weight_decay_and_state_dict():
    groups = [{"params": [nn.Parameter(torch.zeros(2, 2))], "wd_mult": 1.0, "lr_mult": 0.5},
              {"params": [nn.Parameter(torch.zeros(2))], "wd_mult": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1.0, weight_decay=0.0)
    kwargs = dict(max_lr=2.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                  lr_decay_style="linear", start_wd=0.0, end_wd=0.1, wd_incr_steps=10,
                  wd_incr_style="linear")
    sched = OptimizerParamScheduler(opt, **kwargs)
    sched.step(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    assert opt.param_groups[1]["lr"] == pytest.approx(1.0)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.05)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    saved = sched.state_dict()
    opt2 = torch.optim.AdamW(copy.deepcopy(groups), lr=1.0)
    resumed = OptimizerParamScheduler(opt2, **kwargs)
    resumed.load_state_dict(saved)
    assert resumed.num_steps == 5 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    other = OptimizerParamScheduler(opt2, **{**kwargs, "max_lr": 3.0})
    with pytest.raises(ValueError, match="max_lr"):
        other.load_state_dict(saved)
    with pytest.raises(ValueError, match="lr_decay_style"):
        OptimizerParamScheduler(opt, max_lr=1.0, lr_decay_steps=5, lr_decay_style="step")
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        OptimizerParamScheduler(opt, max_lr=1.0, lr_warmup_steps=5, lr_decay_steps=5)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.final_norm = nn.LayerNorm(4)
        self.q_norm = nn.Linear(4, 4, bias=False)  # 2-D, but a "norm" module: no decay
        self.frozen = nn.Parameter(torch.zeros(3, 3), requires_grad=False)


def test_param_groups_no_weight_decay_on_bias_and_norm():
    block = _Block()
    groups = get_param_groups([block, block], weight_decay=0.1)  # shared chunk: no duplicates
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert no_decay["wd_mult"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(block.proj.weight)]
    assert {id(p) for p in no_decay["params"]} == {
        id(block.proj.bias), id(block.final_norm.weight), id(block.final_norm.bias),
        id(block.q_norm.weight)}


def _fp16_skip_worker(state, rank):
    torch.manual_seed(0)
    full = [torch.randn(3, 2), torch.randn(4)]
    params = [nn.Parameter(t.half()) for t in full]
    scaler = DynamicGradScaler(initial_scale=8.0, growth_interval=2, hysteresis=1)
    opt = MixedPrecisionOptimizer(params, state, lr=0.1, weight_decay=0.01, clip_grad=0.0,
                                  params_dtype=torch.float16, grad_scaler=scaler)
    mains = [m for group in opt.param_groups for m in group["params"]]
    assert all(m.dtype == torch.float32 for m in mains)
    grads = [torch.randn(3, 2), torch.randn(4)]
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = (g * scaler.scale).half()
    if rank == 1:
        params[0].grad[1, 1] = float("inf")  # only one rank overflows: both must skip
    ok, norm, zeros = opt.step()
    assert (ok, norm, zeros) == (False, None, None)
    assert opt.num_skipped_iters == 1 and scaler.scale == 4.0
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    # The next good step must equal AdamW on fp32 copies with the unscaled grads.
    ref = [nn.Parameter(p.detach().float()) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01)
    opt.zero_grad()
    for p, r, g in zip(params, ref, grads):
        p.grad = (g.half().float() * scaler.scale).half()
        r.grad = g.half().float()
    ok, norm, _ = opt.step()
    ref_opt.step()
    assert ok and norm == pytest.approx(torch.cat([r.grad.flatten() for r in ref]).norm().item())
    for p, m, r in zip(params, mains, ref):
        assert torch.equal(m, r.detach())
        assert torch.equal(p, r.detach().half())
    opt.zero_grad()
    for p, g in zip(params, grads):
        p.grad = (g * scaler.scale).half()
    assert opt.step()[0] and scaler.scale == 8.0  # two good steps in a row: the scale grows
    return opt.num_skipped_iters


def _make_bf16_model(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
    return model.to(torch.bfloat16)


def _bf16_step(model, opt, sched, rank, step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2, 3, 4, generator=g)  # [dp, tokens, h]: rank r takes x[r]
    target = torch.randn(2, 3, 3, generator=g)
    model.zero_grad_buffer()
    opt.zero_grad()
    out = model(x[rank].to(torch.bfloat16)).float()
    loss = ((out - target[rank]) ** 2).sum() / x.shape[0] / x.shape[1]  # token-weighted
    loss.backward()
    finalize_model_grads([model], opt.state)
    ok, norm, _ = opt.step()
    sched.step()
    assert ok
    return loss.item(), norm


def _build_bf16(state, seed):
    model = DistributedDataParallel(_make_bf16_model(seed), state, bucket_size_mb=1e-4,
                                    overlap_grad_reduce=True)
    opt = MixedPrecisionOptimizer(get_param_groups(model, 0.1), state, lr=1e-2, weight_decay=0.1,
                                  clip_grad=0.05, params_dtype=torch.bfloat16)
    sched = OptimizerParamScheduler(opt, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                    lr_decay_steps=6, lr_decay_style="cosine")
    return model, opt, sched


def _bf16_resume_worker(state, rank):
    model, opt, sched = _build_bf16(state, seed=0)
    for step in range(2):
        _bf16_step(model, opt, sched, rank, step)
    for p in model.parameters():
        assert p.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32
    mains = [m for group in opt.param_groups for m in group["params"]]
    assert all(m.dtype == torch.float32 for m in mains)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    original = [_bf16_step(model, opt, sched, rank, step) for step in (2, 3)]
    original_mains = [m.detach().clone() for group in opt.param_groups for m in group["params"]]
    buf.seek(0)
    saved = torch.load(buf)
    model2, opt2, sched2 = _build_bf16(state, seed=1)  # different init: everything comes from the load
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    resumed = [_bf16_step(model2, opt2, sched2, rank, step) for step in (2, 3)]
    assert resumed == original  # losses and grad norms, exactly
    resumed_mains = [m for group in opt2.param_groups for m in group["params"]]
    assert all(torch.equal(a, b) for a, b in zip(original_mains, resumed_mains))
    model_params = [p for group in get_param_groups(model2, 0.1) for p in group["params"]]
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model_params, resumed_mains))
    return [m.tolist() for m in original_mains]


def _mixed_precision_worker(rank, world_size):
    state = initialize_model_parallel()
    return _fp16_skip_worker(state, rank), _bf16_resume_worker(state, rank)


def test_fp16_skip_and_bf16_bit_exact_resume():
    """One spawn for both (spawning is most of the cost): fp16 skips agree across DP ranks,
    a bf16 run resumed from a state dict repeats the original steps bit for bit."""
    (skipped0, mains0), (skipped1, mains1) = run_workers(_mixed_precision_worker, 2, timeout=90)
    assert skipped0 == skipped1 == 1
    assert mains0 == mains1  # DP replicas stay identical
