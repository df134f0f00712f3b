"""FP8 scales and payloads (megatron_cp/fp8/scaling.py, Fp8Meta) bit for bit against the
reference of tests/fp8/fp8_reference.py, written from the formulas alone (tensorwise and
delayed scales; the saturating, nearest-even cast by the format's value table).

Every payload the linear quantizes (input, weight, output gradient) is recorded from the
autograd function itself and compared as uint8. Also: the refusals of config/fp8.py, one
line naming the flag."""
import math

import pytest
import torch

from fp8_reference import (E4M3, E5M2, FORMATS, value_table, assert_cast_exact, fp8_max,
                           make_meta, reference_cast, reference_current_scale,
                           reference_delayed_scale, run_linear, tensors)
from megatron_cp.fp8.linear import GRAD_OUTPUT, INPUT, WEIGHT
from training_utils import assert_refused


# ----------------------------------------------------------------------------- tests
def test_reference_cast_matches_thevalue_table_on_every_code():
    """The reference itself: every finite float8 value casts to its own code, and values
    halfway between neighbours go to the even code."""
    for dtype in (E4M3, E5M2):
        values, codes = value_table(dtype)
        one = torch.ones(())
        assert torch.equal(reference_cast(values.float(), one, dtype), codes)
        assert torch.equal(reference_cast(-values.float(), one, dtype), codes | 0x80)
        mids = ((values[1:] + values[:-1]) / 2).float()  # exact in fp32 for these formats
        expect = torch.where(codes[1:] % 2 == 0, codes[1:], codes[:-1])
        assert torch.equal(reference_cast(mids, one, dtype), expect)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_tensorwise_scales_and_payloads_are_exact(fmt):
    """Each tensor's scale from its own amax, every cast bitwise the reference's, with
    saturation-free scaling (amax maps to fp8_max), subnormals and an all-zero gradient."""
    meta = make_meta(fmt, "tensorwise")
    for seed, x_scale, g_scale in ((0, 1.0, 1.0), (1, 1e3, 1e-6), (2, 1e-30, 0.0)):
        x, w, g = tensors(seed=seed, x_scale=x_scale, g_scale=g_scale)
        _, _, _, casts = run_linear(meta, x, w, g)
        for role, tensor in ((INPUT, x), (WEIGHT, w), (GRAD_OUTPUT, g)):
            src, scale, dtype, _ = casts[role]
            assert torch.equal(src, tensor)
            amax = tensor.abs().max().item()
            assert torch.equal(scale, reference_current_scale(amax, dtype)), (role, amax)
            assert_cast_exact(casts[role])
        if g_scale == 0.0:  # an all-zero tensor: scale fp8_max / 1e-12, payload all (signed) zeros
            assert casts[GRAD_OUTPUT][3].float().eq(0).all()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_cast_saturates_and_rounds_to_nearest_even(fmt):
    """Under a fixed scale: values beyond fp8_max (and inf) saturate, NaN stays NaN, -0 and
    underflows keep their sign, ties go to even; compared over a sweep of magnitudes."""
    from megatron_cp.fp8 import quantize
    for dtype in FORMATS[fmt]:
        big = fp8_max(dtype)
        x = torch.cat([torch.logspace(-12, 7, 4001), torch.tensor([big, big * 1.01, 1e30,
                       math.inf, 0.0, -0.0, 1e-45])])
        x = torch.cat([x, -x])
        for scale in (1.0, 0.37, 3.0e5):
            s = torch.tensor(scale, dtype=torch.float32)
            q = quantize(x, s, dtype)
            assert torch.equal(q.view(torch.uint8), reference_cast(x, s, dtype))
        sat = quantize(torch.tensor([math.inf, -math.inf, 1e30]), torch.ones(()), dtype).float()
        assert sat.tolist() == [big, -big, big]
        assert torch.isnan(quantize(torch.tensor([math.nan]), torch.ones(()), dtype).float()).all()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_delayed_history_over_steps(fmt, algo):
    """Delayed scaling with a 3-step history and margin 1 over several steps: each step's
    casts use the scale the previous update() left (1 at the start), the history holds the
    step's amaxes newest first, and a step whose amax is 0, inf or NaN keeps the old scale."""
    meta = make_meta(fmt, "delayed", margin=1, history=3, algo=algo)
    history = {role: [0.0, 0.0, 0.0] for role in (INPUT, WEIGHT, GRAD_OUTPUT)}
    scales = {role: torch.ones((), dtype=torch.float32) for role in history}
    steps = [(0, 1.0, 1.0), (1, 4.0, 1e-3), (2, 0.25, 1e2), (3, 0.0, 1.0), (4, 2.0, 0.0),
             (5, 1.0, math.inf), (6, 0.5, math.nan), (7, 3.0, 1.0)]
    for seed, x_scale, g_scale in steps:
        x, w, g = tensors(seed=seed, x_scale=x_scale, g_scale=1.0)
        if not math.isfinite(g_scale):
            g[0, 0] = g_scale  # one inf / NaN element: the step's amax is not finite
        else:
            g = g * g_scale
        _, _, _, casts = run_linear(meta, x, w, g)
        for role, tensor in ((INPUT, x), (WEIGHT, w), (GRAD_OUTPUT, g)):
            assert torch.equal(casts[role][1], scales[role]), (seed, role)
            if torch.isfinite(tensor).all():
                assert_cast_exact(casts[role])
            amax = tensor.abs().max().item()
            history[role] = [amax] + history[role][:-1]
            scales[role] = reference_delayed_scale(history[role], scales[role],
                                                   meta.dtype(role), 1, algo)
        meta.end_step()
        for role in history:
            got = meta.amax_history[role]
            want = torch.tensor(history[role], dtype=torch.float32)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got[~got.isnan()], want[~want.isnan()]), (seed, role)
            assert torch.equal(meta.scale[role], scales[role]), (seed, role, algo)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_delayed_update_keeps_the_scale_where_amax_is_not_usable(fmt):
    """update() alone: a fresh amax sets fp8_max / amax / 2**margin (margin 2), then 0, inf
    and NaN each keep the previous scale (most_recent, history 1), and so does an amax so
    small (a subnormal) that the scale would overflow fp32."""
    meta = make_meta(fmt, "delayed", margin=2)
    for amax in (3.5, 0.0, math.inf, math.nan, 1e-20, 1e-39, 7e4):
        previous = meta.scale.clone()
        meta.step_amax.fill_(amax)
        amax = meta.step_amax[0].item()  # as the fp32 buffer holds it
        meta.update()
        for role in (INPUT, WEIGHT, GRAD_OUTPUT):
            want = reference_delayed_scale([amax], previous[role], meta.dtype(role), 2,
                                           "most_recent")
            assert torch.equal(meta.scale[role], want), (amax, role)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_no_fp8_wgrad_keeps_the_weight_gradient_in_high_precision(recipe):
    """--no-fp8-wgrad: dW = dy^T x in the input's precision (bitwise the plain matmul), the
    output and dx unchanged from the FP8-wgrad run."""
    x, w, g = tensors(seed=3)
    out8, dx8, dw8, _ = run_linear(make_meta("hybrid", recipe), x, w, g)
    out, dx, dw, _ = run_linear(make_meta("hybrid", recipe, wgrad=False), x, w, g)
    assert torch.equal(dw, g.t() @ x) and not torch.equal(dw, dw8)
    assert torch.equal(out, out8) and torch.equal(dx, dx8)


BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --mock-data --vocab-size 200 "
        "--train-iters 2 --fp8-format hybrid ")


@pytest.mark.parametrize("extra,line,world", [
    ("--fp8-recipe custom", "--fp8-recipe custom: a custom quantizer", 1),
    ("--first-last-layers-bf16", "--first-last-layers-bf16 (True) is not supported with "
                                 "--fp8-recipe 'delayed'", 1),
    ("--fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-start-in-bf16 3 "
     "--pipeline-model-parallel-size 2", "--num-layers-at-start-in-bf16 (3) must be between 0 "
                                         "and the number of layers per pipeline stage (2)", 2),
    ("--fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-end-in-bf16 -1",
     "--num-layers-at-end-in-bf16 (-1) must be between 0", 1),
    ("--fp8-amax-history-len 0", "--fp8-amax-history-len (0) must be >= 1", 1),
    ("--fp8-recipe mxfp8 --fp8-output-proj --tiled-logits-chunk-size 8",
     "--fp8-output-proj (True) with --tiled-logits-chunk-size (8): the tiled output layer", 1),
    ("--fp8-recipe blockwise --fp8-output-proj", "--fp8-output-proj (True) needs --fp8-format "
                                                 "with --fp8-recipe 'mxfp8'", 1),
    ("--fp8-recipe tensorwise --tp-comm-overlap --tensor-model-parallel-size 2 "
     "--sequence-parallel", "fp8 with --tp-comm-overlap (True)", 2),
])
def test_refusals_are_one_line_naming_the_flag(extra, line, world):
    assert_refused(BASE + extra, line, world_size=world)
