"""--lr-decay-style WSD (warmup-stable-decay) with Megatron-LM's meaning: the rate warms up,
stays at --lr, and anneals to --min-lr over the last --lr-wsd-decay-iters (or -samples) of
the decay, in the --lr-wsd-decay-style shape. Checked against the formulas written out here
and against megatron-core's own OptimizerParamScheduler, built as Megatron-LM's
get_optimizer_param_scheduler builds it (its steps count samples)."""
import math

import pytest

from megatron_cp.cli.arguments import parse_args
from megatron_cp.config.optimizer import WSD_DECAY_STYLES
from megatron_cp.optimizer import OptimizerParamScheduler
from megatron_cp.optimizer.factory import build_scheduler
from megatron_cp.startup import run_config
from training_utils import TINY, assert_refused


class _Groups:
    """An optimizer as a scheduler sees it: one param group."""

    def __init__(self):
        self.param_groups = [{"wd_mult": 1.0}]


def _shape(style, r):
    return {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
            "exponential": 2.0 * 0.5 ** r - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[style]


def _wsd(step, style, top=1.0, bottom=0.1, warmup=2, decay=20, anneal=6):
    """The WSD rate at ``step``, written out from Megatron-LM's definition."""
    if step <= warmup:
        return top * step / warmup
    if step > decay:
        return bottom
    start = decay - anneal
    coeff = 1.0 if step <= start else _shape(style, (step - start) / anneal)
    return bottom + coeff * (top - bottom)


@pytest.mark.parametrize("style", WSD_DECAY_STYLES)
def test_wsd_curve_follows_the_formulas(style):
    opt = _Groups()
    sched = OptimizerParamScheduler(opt, max_lr=1.0, min_lr=0.1, lr_warmup_steps=2,
                                    lr_decay_steps=20, lr_decay_style="WSD",
                                    wsd_decay_steps=6, lr_wsd_decay_style=style)
    for step in range(25):
        assert opt.param_groups[0]["lr"] == pytest.approx(_wsd(step, style)), step
        sched.step()
    # stable until the annealing starts, --min-lr at its end
    assert _wsd(14, style) == 1.0 and _wsd(20, style) == pytest.approx(0.1)


def _megatron_core_scheduler(flags, global_batch_size, by_samples):
    """megatron-core's scheduler as Megatron-LM's get_optimizer_param_scheduler builds it
    from ``flags`` (lengths in samples)."""
    import megatron.core.optimizer_param_scheduler as core
    unit = 1 if by_samples else global_batch_size
    key = "samples" if by_samples else "iters"
    return core.OptimizerParamScheduler(
        _Groups(), init_lr=0.0, max_lr=flags["lr"], min_lr=flags["min_lr"],
        lr_warmup_steps=flags[f"lr_warmup_{key}"] * unit,
        lr_decay_steps=flags[f"lr_decay_{key}"] * unit, lr_decay_style="WSD",
        start_wd=0.01, end_wd=0.01, wd_incr_steps=flags[f"train_{key}"] * unit,
        wd_incr_style="constant", wsd_decay_steps=flags[f"lr_wsd_decay_{key}"] * unit,
        lr_wsd_decay_style=flags["style"])


def _ours(argv):
    run = run_config(parse_args(argv.split()))
    opt = _Groups()
    return build_scheduler(run.optimizer, run.checkpoint, opt), opt


BASE = TINY.replace(" --lr-warmup-iters 2", "") + " --lr-decay-style WSD"


@pytest.mark.parametrize("style", WSD_DECAY_STYLES)
def test_wsd_from_the_command_line_matches_megatron_core_in_iterations(style):
    flags = dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, lr_decay_iters=16, train_iters=20,
                 lr_wsd_decay_iters=6, style=style)
    ours, opt = _ours(f"{BASE} --lr-warmup-iters 2 --lr-decay-iters 16 --train-iters 20 "
                      f"--lr-wsd-decay-iters 6 --lr-wsd-decay-style {style}")
    theirs = _megatron_core_scheduler(flags, 8, by_samples=False)
    for iteration in range(22):
        assert opt.param_groups[0]["lr"] == pytest.approx(theirs.get_lr({}), rel=1e-12), iteration
        ours.step()
        theirs.step(8)  # Megatron-LM steps by the global batch size


@pytest.mark.parametrize("style", ("exponential", "cosine"))
def test_wsd_from_the_command_line_matches_megatron_core_in_samples(style):
    """--train-samples: the annealing phase in samples, 44 of them (5.5 iterations of 8)."""
    flags = dict(lr=3e-3, min_lr=3e-4, lr_warmup_samples=16, lr_decay_samples=152,
                 train_samples=160, lr_wsd_decay_samples=44, style=style)
    ours, opt = _ours(f"{BASE} --lr-warmup-samples 16 --lr-decay-samples 152 "
                      f"--train-samples 160 --lr-wsd-decay-samples 44 "
                      f"--lr-wsd-decay-style {style}")
    theirs = _megatron_core_scheduler(flags, 8, by_samples=True)
    for iteration in range(21):
        assert opt.param_groups[0]["lr"] == pytest.approx(theirs.get_lr({}), rel=1e-12), iteration
        ours.step()
        theirs.step(8)


def test_wsd_state_dict_resumes_and_a_changed_annealing_is_named():
    kwargs = dict(max_lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_steps=20,
                  lr_decay_style="WSD", wsd_decay_steps=6, lr_wsd_decay_style="linear")
    sched = OptimizerParamScheduler(_Groups(), **kwargs)
    sched.step(17)
    saved = sched.state_dict()
    assert saved["wsd_decay_steps"] == 6 and saved["lr_wsd_decay_style"] == "linear"
    resumed = OptimizerParamScheduler(_Groups(), **kwargs)
    resumed.load_state_dict(saved)
    assert resumed.get_lr() == sched.get_lr() == pytest.approx(_wsd(17, "linear"))
    changed = OptimizerParamScheduler(_Groups(), **{**kwargs, "wsd_decay_steps": 8})
    with pytest.raises(ValueError, match="--lr-wsd-decay-iters"):
        changed.load_state_dict(saved)
    # a schedule of another style saves no WSD keys (the checkpoints stay as they were)
    assert "wsd_decay_steps" not in OptimizerParamScheduler(
        _Groups(), max_lr=1.0, lr_decay_steps=5).state_dict()


def test_wsd_flags_refused_in_one_line():
    base = TINY + " --train-iters 20"
    assert_refused(base + " --lr-decay-style WSD",
                   "--lr-decay-style WSD needs --lr-wsd-decay-iters")
    assert_refused(base + " --lr-decay-style WSD --lr-wsd-decay-samples 16",
                   "--lr-wsd-decay-samples goes with --train-samples")
    assert_refused(base + " --lr-wsd-decay-iters 4", "--lr-wsd-decay-iters shapes the annealing")
    assert_refused(base + " --lr-wsd-decay-style cosine",
                   "--lr-wsd-decay-style cosine shapes the annealing")
    assert_refused(base + " --lr-decay-style WSD --lr-wsd-decay-iters -1",
                   "--lr-wsd-decay-iters (-1) must be >= 0")


def test_wsd_trains_and_resumes_exactly(tmp_path):
    """A WSD run saved inside its annealing phase resumes to the losses of a straight run
    (the checkpoint keeps the annealing length and shape)."""
    from dist_harness import run_workers
    from training_utils import train_runs

    ckpt = tmp_path / "ckpt"
    base = (BASE + " --lr-warmup-iters 1 --lr-wsd-decay-iters 3 --lr-wsd-decay-style "
                   "minus_sqrt --log-interval 1 --lr-decay-iters 6")
    straight, saved, resumed, changed = run_workers(train_runs, 2, [
        base + " --train-iters 6",
        base + f" --train-iters 4 --save {ckpt} --save-interval 4",
        base + f" --train-iters 6 --load {ckpt}",
        base.replace("minus_sqrt", "cosine") + f" --train-iters 6 --load {ckpt}",
    ])[0]
    assert saved == straight[:4] and resumed == straight[4:], (straight, saved, resumed)
    assert "lr_wsd_decay_style (--lr-wsd-decay-style) is cosine now but minus_sqrt" in changed
