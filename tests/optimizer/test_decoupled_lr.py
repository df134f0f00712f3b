"""--decoupled-lr / --decoupled-min-lr (Megatron-LM's meaning): the word embedding and the
output layer weight (either copy of a tied one) train at their own rate, on the same warmup
and decay from --decoupled-lr to --decoupled-min-lr (default --min-lr); the logged rate
stays --lr's. Checked: the schedule, which params, the embedding's update size, loss curves
under PP (tied copy), DP with the distributed optimizer and TP against one process, the log
line, and checkpoints (resume, and a changed rate refused)."""
import contextlib
import io
import math
import re

import pytest

from dist_harness import run_workers
from megatron_cp.model import GPTConfig, GPTModel
from megatron_cp.optimizer import OptimizerParamScheduler, get_param_groups
from training_utils import TINY, max_rel_diff, train_losses, train_runs


class _Groups:
    """An optimizer as the scheduler sees it: a main and a decoupled param group."""

    def __init__(self):
        self.param_groups = [{"is_decoupled_lr": False}, {"is_decoupled_lr": True}]


def _cosine(step, top, bottom, warmup=2, decay=10):
    if step <= warmup:
        return top * step / warmup
    if step > decay:
        return bottom
    ratio = (step - warmup) / (decay - warmup)
    return bottom + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (top - bottom)


@pytest.mark.parametrize("decoupled_min_lr", [0.5, None])
def test_schedule_of_the_decoupled_groups(decoupled_min_lr):
    opt = _Groups()
    scheduler = OptimizerParamScheduler(opt, max_lr=1.0, min_lr=0.1, lr_warmup_steps=2,
                                        lr_decay_steps=10, lr_decay_style="cosine",
                                        decoupled_lr=2.0, decoupled_min_lr=decoupled_min_lr)
    bottom = 0.1 if decoupled_min_lr is None else decoupled_min_lr  # Megatron: --min-lr
    for step in range(13):
        main, decoupled = (g["lr"] for g in opt.param_groups)
        assert main == pytest.approx(_cosine(step, 1.0, 0.1)) == scheduler.get_lr()
        assert decoupled == pytest.approx(_cosine(step, 2.0, bottom)), step
        scheduler.step(1)


def _config(**overrides):
    return GPTConfig(**{"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                        "vocab_size": 16, "position_embedding_type": "learned_absolute",
                        "max_position_embeddings": 8, **overrides})


@pytest.mark.parametrize("untied", [False, True])
def test_decoupled_params_are_the_word_embedding_and_output_layer(untied):
    config = _config(untie_embeddings_and_output_weights=untied)
    model = GPTModel(config)
    groups = get_param_groups(model, 0.1, decoupled_lr=True)
    decoupled = [p for g in groups if g["is_decoupled_lr"] for p in g["params"]]
    want = [model.embedding.word_embeddings.weight]
    if untied:
        want.append(model.output_layer.weight)
    assert {id(p) for p in decoupled} == {id(p) for p in want}  # not the position table
    assert all(g["wd_mult"] == 1.0 for g in groups if g["is_decoupled_lr"])
    assert not any(g["is_decoupled_lr"] for g in get_param_groups(model, 0.1))  # flag off
    last_stage = GPTModel(config, pre_process=False, post_process=True)  # PP: its own copy
    groups = get_param_groups(last_stage, 0.1, decoupled_lr=True)
    assert [p for g in groups if g["is_decoupled_lr"] for p in g["params"]] == \
        [last_stage.output_layer.weight]


def _each(rank, world, runs):
    """``[fn(rank, world, argv) for fn, argv in runs]``: several runs in one process group."""
    return [fn(rank, world, argv) for fn, argv in runs]


def _update_sizes(rank, world, argv):
    """The largest change of the word embedding and of a QKV weight in one step."""
    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.training import Trainer
    from training_utils import run_and_state
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    model = trainer.model_chunks[0].module
    weights = (model.embedding.word_embeddings.weight, model.decoder.layers[0].self_attention
               .linear_qkv.weight)
    before = [w.detach().clone() for w in weights]
    trainer.train_step()
    return [(w.detach() - b).abs().max().item() for w, b in zip(weights, before)]


def test_the_embedding_steps_at_the_decoupled_rate():
    """Adam's first step moves each entry by about its rate (m / sqrt(v) = +-1): the
    embedding by --decoupled-lr, the layers by --lr."""
    argv = (TINY.replace("--lr-warmup-iters 2 --lr-decay-style cosine",
                         "--lr-decay-style constant")
            + " --lr 1e-3 --weight-decay 0 --clip-grad 0 --train-iters 3")
    plain, decoupled = run_workers(
        _each, 1, [(_update_sizes, argv), (_update_sizes, argv + " --decoupled-lr 3e-2")])[0]
    assert plain == pytest.approx([1e-3, 1e-3], rel=1e-3)
    assert decoupled == pytest.approx([3e-2, 1e-3], rel=1e-3)


LEARNING_RATE = re.compile(r"iteration\s+(\d+)/.*\| learning rate: (\S+) \|")


def _logged(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train_losses(rank, world, argv)
    return losses, {int(i): float(lr) for i, lr in LEARNING_RATE.findall(out.getvalue())}


DECOUPLED = TINY + " --train-iters 5 --decoupled-lr 2e-2 --decoupled-min-lr 1e-3"


def test_loss_curves_equal_one_process_and_the_log_shows_lr():
    """With --decoupled-lr: PP = 2 (the tied copy on the last stage follows the decoupled
    rate too), DP = 2 with the distributed optimizer (untied) and TP = 2 give the one-process
    curves, which differ from the run without the flag; the log line shows --lr's schedule."""
    untied = DECOUPLED + " --untie-embeddings-and-output-weights"
    (tied_ref, logged), (untied_ref, _), (plain, _) = run_workers(
        _each, 1, [(_logged, f"{DECOUPLED} --log-interval 1"), (_logged, untied),
                         (_logged, TINY + " --train-iters 5")])[0]
    assert max_rel_diff(plain, tied_ref) > 1e-4
    main = [_cosine(step, 3e-3, 3e-4, warmup=2, decay=5) for step in range(1, 6)]
    assert [logged[i] for i in range(1, 6)] == pytest.approx(main, rel=1e-6)  # printed %.6E
    runs = [(DECOUPLED + " --pipeline-model-parallel-size 2", tied_ref),
            (untied + " --use-distributed-optimizer", untied_ref),
            (DECOUPLED + " --tensor-model-parallel-size 2 --sequence-parallel", tied_ref)]
    results = run_workers(train_runs, 2, [argv for argv, _ in runs])[0]
    for (argv, want), losses in zip(runs, results):
        assert max_rel_diff(losses, want) <= 1e-5, (argv, losses, want)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_resume_keeps_the_decoupled_schedule(tmp_path, ckpt_format):
    base = f"{DECOUPLED.replace('--train-iters 5', '--train-iters 6')} --ckpt-format {ckpt_format}"
    straight, first, second, changed, overridden = run_workers(train_runs, 1, [
        base, f"{base} --exit-interval 3 --save {tmp_path}", f"{base} --load {tmp_path}",
        f"{base.replace('--decoupled-lr 2e-2', '--decoupled-lr 5e-2')} --load {tmp_path}",
        f"{base.replace('--decoupled-lr 2e-2', '--decoupled-lr 5e-2')} --load {tmp_path} "
        f"--override-opt_param-scheduler"])[0]
    assert first + second == straight
    assert "decoupled_lr (--decoupled-lr) is 0.05 now but 0.02 in the checkpoint" in changed
    assert len(overridden) == 3 and overridden != second
