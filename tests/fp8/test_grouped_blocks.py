"""The routed experts' grouped GEMMs under the block recipes (megatron_cp/fp8/grouped_blocks.py)
against per-expert dense block GEMMs (megatron_cp/fp8/linear.py's, one linear per (expert,
microbatch class) run): output, dx and each expert's dW (the sum of its runs') bitwise, with
partial blocks; routing padding's rows leave every result as without them. And the source
orders accepted as one process's token order, and the dispatcher's row order for a given
order of the sources.
"""
from types import SimpleNamespace

import pytest
import torch

from fp8_reference import make_meta
from megatron_cp.fp8.grouped import ExpertRows, GroupedFp8Meta, grouped_fp8_linear
from megatron_cp.fp8.grouped_blocks import check_source_order
from megatron_cp.fp8.linear import fp8_linear
from megatron_cp.moe.dispatcher import chunk_order

RUNS = [(0, 0, 150), (0, 1, 7), (1, 1, 40), (2, 0, 1), (2, 1, 129)]  # (expert, class, rows)


def _grouped(recipe, wgrad, x, w, g, rows):
    config = SimpleNamespace(fp8="hybrid", fp8_recipe=recipe, fp8_wgrad=wgrad, wgrad_in_fp8=wgrad, fp8_margin=0,
                             fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent")
    meta = GroupedFp8Meta(config, 5, slice(1, 4), (None, None), 2).train()
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_fp8_linear(x, w, meta, rows)
    out.backward(g)
    return out, x.grad, w.grad, meta


def _dense(recipe, wgrad, x, w, g, runs):
    outs, dxs, dw = [], [], torch.zeros_like(w)
    start = 0
    for e, _, n in runs:
        xe = x[start:start + n].clone().requires_grad_()
        we = w[e].clone().requires_grad_()
        out = fp8_linear(xe, we, None, make_meta("hybrid", recipe, wgrad))
        out.backward(g[start:start + n])
        outs.append(out)
        dxs.append(xe.grad)
        dw[e] += we.grad
        start += n
    return torch.cat(outs), torch.cat(dxs), dw


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("wgrad", [True, False])
def test_grouped_block_gemms_equal_per_expert_dense_block_gemms(recipe, wgrad):
    gen = torch.Generator().manual_seed(3)
    rows = sum(n for _, _, n in RUNS)
    x = torch.randn(rows, 200, generator=gen)  # k = 200: a partial block
    w = torch.randn(3, 72, 200, generator=gen) * 0.05
    g = torch.randn(rows, 72, generator=gen)
    out, dx, dw, meta = _grouped(recipe, wgrad, x, w, g, ExpertRows([157, 40, 130], RUNS))
    ref_out, ref_dx, ref_dw = _dense(recipe, wgrad, x, w, g, RUNS)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw)
    assert torch.isinf(meta.step_amax[[0, 4]]).all()  # other ranks' experts
    assert torch.isfinite(meta.step_amax[1:4]).all()
    # routing padding: extra rows (output gradient 0) inside runs change nothing
    pad = torch.zeros(rows + 3, dtype=torch.bool)
    pad[[5, 250, 300]] = True
    x_p, g_p = torch.zeros(rows + 3, 200), torch.zeros(rows + 3, 72)
    x_p[~pad], g_p[~pad] = x, g
    x_p[pad] = 50.0  # would change every block they shared
    runs_p = [(0, 0, 151), (0, 1, 7), (1, 1, 40), (2, 0, 1), (2, 1, 131)]
    out_p, dx_p, dw_p, _ = _grouped(recipe, wgrad, x_p, w, g_p,
                                    ExpertRows([158, 40, 132], runs_p, real=~pad))
    assert torch.equal(out_p[~pad], out) and torch.equal(dx_p[~pad], dx)
    assert torch.equal(dw_p, dw)


def test_source_orders_of_one_process_token_order():
    check_source_order([0, 1], [0, 0])  # EP over DP: one source per microbatch
    check_source_order([0, 0], [0, 1])  # EP over TP + SP: pieces in order
    check_source_order([0, 0, 1, 1], [0, 1, 0, 1])  # EP x TP + SP beside DP
    for classes, pieces in (([0, 0], [1, 0]), ([0, 1, 0], [0, 0, 1]), ([0, 0], [0, 0])):
        with pytest.raises(ValueError, match="does not give one process's token order"):
            check_source_order(classes, pieces)


def test_chunk_order_lays_the_sources_out_in_the_order_given():
    counts = torch.tensor([[2, 1], [0, 3], [1, 1]])  # [sources, experts], rows source-major
    assert chunk_order(counts).tolist() == [0, 1, 6, 2, 3, 4, 5, 7]
    assert chunk_order(counts, [2, 0, 1]).tolist() == [6, 0, 1, 7, 2, 3, 4, 5]
