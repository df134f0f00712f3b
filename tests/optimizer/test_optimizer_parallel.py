"""Gradient clipping, DDP buckets and the end-of-step grad fix-ups on gloo workers.

Every check compares against a single-process reference built from the same full
(unsharded) tensors: torch's clip_grad_norm_ on the full grads, and the full-batch
gradient of a tiny model.
"""
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.optimizer import MixedPrecisionOptimizer, clip_grad_norm, get_grad_norm
from megatron_cp.distributed.data_parallel import DistributedDataParallel, finalize_model_grads


def _param(full_value, grad, **attrs):
    p = nn.Parameter(full_value.clone())
    p.grad = grad.clone()
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


def _shard(t, rank, size):
    return t.chunk(size, dim=0)[rank]


def _dense_set(gen):
    """Full tensors of one pipeline stage's dense params: (value, grad, attrs)."""
    def t(*shape):
        return torch.randn(*shape, generator=gen)
    return [(t(8, 3), t(8, 3) * 3, {"tensor_model_parallel": True}),   # column-parallel weight
            (t(4, 6), t(4, 6), {"tensor_model_parallel": True}),       # row-parallel weight
            (t(5), t(5), {"sequence_parallel": True}),                 # norm weight (replicated)
            (t(3), t(3) * 2, {})]                                      # replicated bias


def _local_params(full_set, state, tp_name="tp"):
    rank, size = state.rank(tp_name), state.size(tp_name)
    out = []
    for value, grad, attrs in full_set:
        if attrs.get("tensor_model_parallel"):
            value, grad = _shard(value, rank, size), _shard(grad, rank, size)
        out.append(_param(value, grad, **attrs))
    return out


def _clip_and_compare(state, local, full_sets, max_norm):
    """Clip ``local`` with the library and the flattened ``full_sets`` with torch; compare."""
    full = []
    for value, grad, _ in full_sets:
        p = nn.Parameter(value.clone())
        p.grad = grad.clone()
        full.append(p)
    expected_inf = torch.nn.utils.clip_grad_norm_(full, 1e9, norm_type=math.inf).item()
    expected = torch.nn.utils.clip_grad_norm_(full, max_norm).item()
    assert math.isclose(get_grad_norm(local, state, norm_type=math.inf), expected_inf, rel_tol=1e-6)
    assert expected > max_norm  # clipping really happens
    norm = clip_grad_norm(local, max_norm, state)
    assert math.isclose(norm, expected, rel_tol=1e-5), (norm, expected)
    return [p.grad for p in full]


def _clip_and_finalize_worker(rank, world_size):
    gen = torch.Generator().manual_seed(0)
    stage_sets = [_dense_set(gen), _dense_set(gen)]
    embedding = (torch.randn(10, 4, generator=gen), torch.randn(10, 4, generator=gen),
                 {"tensor_model_parallel": True, "shared_embedding": True})
    experts = [(torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen) * 4,
                {"is_expert": True}) for _ in range(2)]

    # TP=2 x PP=2: sharded, replicated and tied-embedding params, counted once each.
    state = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    pp_rank, tp_rank = state.rank("pp"), state.rank("tp")
    full_set = stage_sets[pp_rank] + [embedding]
    local = _local_params(full_set, state)
    clipped = _clip_and_compare(state, local, stage_sets[0] + stage_sets[1] + [embedding], 1.0)
    clipped_here = clipped[4 * pp_rank:4 * pp_rank + 4] + [clipped[-1]]
    for p, full_grad, (_, _, attrs) in zip(local, clipped_here, full_set):
        expect = _shard(full_grad, tp_rank, 2) if attrs.get("tensor_model_parallel") else full_grad
        assert_close(p.grad, expect)

    # finalize: SP grads summed over TP, tied embedding grads summed over first + last stage.
    chunk = nn.Module()
    chunk.norm = _param(torch.zeros(5), torch.full((5,), float(rank + 1)), sequence_parallel=True)
    chunk.emb = _param(torch.zeros(2), torch.full((2,), float(10 * (rank + 1))), shared_embedding=True)
    chunk.other = _param(torch.zeros(2), torch.full((2,), float(rank)))
    finalize_model_grads([chunk], state)
    tp_peers = state.group_ranks("tp")
    emb_peers = state.group_ranks("embedding")
    assert_close(chunk.norm.grad, torch.full((5,), float(sum(r + 1 for r in tp_peers))))
    assert_close(chunk.emb.grad, torch.full((2,), float(sum(10 * (r + 1) for r in emb_peers))))
    assert_close(chunk.other.grad, torch.full((2,), float(rank)))

    # TP=2, DP=2, EP=2: dense replicated over DP, one expert per EP rank.
    state = initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    local = _local_params(stage_sets[0], state)
    local += _local_params([experts[state.rank("ep")]], state, tp_name="etp")
    clipped = _clip_and_compare(state, local, stage_sets[0] + experts, 2.0)
    assert_close(local[-1].grad, clipped[4 + state.rank("ep")])
    return True


def test_clip_grad_norm_and_finalize_tp_pp_ep():
    assert run_workers(_clip_and_finalize_worker, 4, timeout=90) == [True] * 4


class _TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.expert = nn.Linear(6, 6)
        for p in self.expert.parameters():
            p.is_expert = True
        self.out = nn.Linear(6, 2)

    def forward(self, x):  # [tokens, 4] -> [tokens, 2]
        return self.out(torch.tanh(self.expert(torch.tanh(self.inp(x)))))


def _token_loss(model, x, y, num_global_tokens):
    # each rank's loss carries the global normalization, so DP grads are SUMmed
    return ((model(x) - y) ** 2).sum() / num_global_tokens


def _ddp_worker(rank, world_size):
    # DP=2 with EP=2: dense grads are summed over both ranks, expert grads (edp=1) stay local.
    state = initialize_model_parallel(expert_model_parallel_size=2)
    assert state.size("dp_cp") == 2 and state.size("edp") == 1

    def fresh():  # not copy.deepcopy: it drops attributes such as is_expert from Parameters
        torch.manual_seed(0)
        return _TinyMoE()

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 2, 3, 4, generator=gen), torch.randn(2, 2, 3, 2, generator=gen)  # [dp, mb, tok, h]
    num_tokens = 2 * 2 * 3
    ref = fresh()
    _token_loss(ref, x.reshape(-1, 4), y.reshape(-1, 2), num_tokens).backward()  # the full batch
    ref_local = fresh()
    _token_loss(ref_local, x[rank].reshape(-1, 4), y[rank].reshape(-1, 2), num_tokens).backward()
    local_grads = {n: p.grad for n, p in ref_local.named_parameters()}
    expected = {n: local_grads[n] if getattr(p, "is_expert", False) else p.grad
                for n, p in ref.named_parameters()}
    assert sum(getattr(p, "is_expert", False) for p in ref.parameters()) == 2
    for overlap in (False, True):
        for bucket_size_mb in (None, 2e-5):  # one bucket per buffer / one param per bucket
            model = DistributedDataParallel(fresh(), state, bucket_size_mb=bucket_size_mb,
                                            overlap_grad_reduce=overlap)
            if bucket_size_mb is not None:
                assert len(model.buckets) > 2
            launched_before_inp = []  # buckets already launched when backward reaches `inp`
            model.module.inp.register_full_backward_pre_hook(
                lambda *_: launched_before_inp.append(model._next_launch))
            for _ in range(2):  # two iterations: the buffer and bucket state reset properly
                model.zero_grad_buffer()
                with model.no_sync():
                    _token_loss(model, x[rank, 0], y[rank, 0], num_tokens).backward()
                assert model._next_launch == 0  # nothing reduced inside no_sync
                _token_loss(model, x[rank, 1], y[rank, 1], num_tokens).backward()
                assert model._next_launch == (len(model.buckets) if overlap else 0)
                if overlap and bucket_size_mb is not None:
                    assert launched_before_inp[-1] > 0  # communication overlapped backward
                finalize_model_grads([model], state)
                for name, p in model.module.named_parameters():
                    assert p.grad is None and p.main_grad.dtype == torch.float32
                    assert_close(p.main_grad, expected[name], msg=f"{name} overlap={overlap}")

    # fp32 optimizer on the DDP buffers: steps with main_grad, no copies, like AdamW on the reference.
    opt = MixedPrecisionOptimizer(model.parameters(), state, lr=0.1, weight_decay=0.0, clip_grad=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.0)
    for name, p in ref.named_parameters():
        p.grad = expected[name].clone()
    assert opt.step()[0]
    ref_opt.step()
    for p, q in zip(model.module.parameters(), ref.parameters()):
        assert_close(p, q)
        assert p.grad is None  # the alias of main_grad does not outlive the step
    with pytest.raises(ValueError, match="no_sync"):  # two synced backwards without finishing
        for _ in range(2):
            _token_loss(model, x[rank, 1], y[rank, 1], num_tokens).backward()
    return True


def test_ddp_bucket_reduce_matches_full_batch():
    assert run_workers(_ddp_worker, 2, timeout=90) == [True, True]
