"""Megatron-LM's own checkpoints in and out, against megatron-core 0.16.1 itself.

- In: megatron-core's GPTModel (local spec: TE norm names, _extra_state objects, padded
  vocabulary, stacked layers) trains two Adam steps and is saved as Megatron-LM's training
  saves it (common.pt with its pickled Namespace and an enum of its own). Our
  ``--load DIR --use-checkpoint-args`` gives its logits within 1e-5 (fp32) and its greedy
  continuation at TP=1 and TP=2, and training goes on at its next iteration with the same
  losses under both layouts. GPT defaults (its tanh GELU: the bias-GELU fusion), Llama style,
  and MoE.
- Out: our checkpoint -> ``tools/checkpoint_convert.py --to-megatron`` -> megatron-core's
  GPTModel loads it strictly -> logits within 1e-5 of ours.
"""
import pytest
import torch

import megatron.core  # noqa: F401  (a test requirement: scripts/env.sh installs it)
from dist_harness import run_workers  # noqa: E402
from megatron_cp.checkpoint import files  # noqa: E402
from megatron_cp.cli.arguments import parse_args  # noqa: E402
from megatron_cp.training import Trainer, pretrain  # noqa: E402
import megatron_core_utils as mcu  # noqa: E402
from tools import checkpoint_convert as convert  # noqa: E402
from training_utils import parallel_state, run_and_state  # noqa: E402

RUN = ("--micro-batch-size 4 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 "
       "--lr-decay-iters 20 --lr-decay-style cosine --train-iters 20 --weight-decay 0.01 "
       "--mock-data --eval-iters 0 --log-interval 100 --use-checkpoint-args")
TOL = 1e-5  # fp32 logits of the same weights, summed over a 32-wide hidden dim


def _tokens():
    return torch.randint(0, mcu.VOCAB, (2, mcu.SEQ), generator=torch.Generator().manual_seed(3))


def _our_logits(rank, world, root, tokens):
    """Worker: our trainer loads ``root`` (at TP=world); full real-vocabulary logits, and the
    iteration and consumed samples it resumes at."""
    import torch.distributed as dist
    args = parse_args(f"{RUN} --load {root} --tensor-model-parallel-size {world}".split(),
                      world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    it, consumed = trainer.checkpointer.load(trainer.train_state(), root)
    model = trainer.model_chunks[0].module if hasattr(trainer.model_chunks[0], "module") \
        else trainer.model_chunks[0]
    model.eval()
    with torch.no_grad():
        out = model(tokens, torch.arange(mcu.SEQ).expand_as(tokens))  # [s, b, v/tp]
    parts = [torch.empty_like(out) for _ in range(world)]  # [s, b, v/tp] per TP rank
    dist.all_gather(parts, out.contiguous(), group=trainer.state.group("tp"))
    full = torch.cat(parts, dim=-1).transpose(0, 1)  # [b, s, padded v]
    return full[..., :mcu.VOCAB], it, consumed


def _resume(rank, world, root):
    args = parse_args(f"{RUN} --load {root} --tensor-model-parallel-size {world} "
                      f"--train-iters 12".split(), world_size=world)
    return pretrain(args, parallel_state(args))


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory):
    """``make(kind)``: megatron-core's checkpoint of ``kind`` (gpt, llama, moe), made once per
    module: (kind, root, tokens, its logits over the real vocabulary)."""
    made = {}

    def make(kind):
        if kind not in made:
            root = tmp_path_factory.mktemp(f"mlm_{kind}")
            tokens = _tokens()
            theirs = run_workers(mcu.train_and_save, 1, kind, str(root), tokens)[0]
            made[kind] = kind, str(root), tokens, theirs[..., :mcu.VOCAB]
        return made[kind]
    return make


# MoE is compared at TP=1 (one way is asked; its TP=2 is the dense path's)
@pytest.mark.parametrize("kind,tp", [("gpt", 1), ("gpt", 2), ("llama", 1), ("llama", 2),
                                     ("moe", 1)])
def test_megatron_checkpoint_loads_with_its_logits(megatron_checkpoint, kind, tp):
    _, root, tokens, theirs = megatron_checkpoint(kind)
    ours, it, consumed = run_workers(_our_logits, tp, root, tokens)[0]
    assert (it, consumed) == (mcu.ITERATION, mcu.ITERATION * mcu.GBS)
    torch.testing.assert_close(ours, theirs, rtol=TOL, atol=TOL)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))  # the same greedy continuation


def test_megatron_gelu_is_tanh_unless_fusion_is_off(megatron_checkpoint):
    """Megatron's default computes the tanh GELU (its bias-GELU fusion), which its
    checkpoint records: a run with --no-bias-gelu-fusion (the exact GELU) is refused by it,
    naming the flag."""
    _, root, tokens, _ = megatron_checkpoint("gpt")
    errors = run_workers(_refused, 1, root, tokens)[0]
    assert "drop --no-bias-gelu-fusion" in errors, errors


def _refused(rank, world, root, tokens):
    args = parse_args(f"{RUN} --load {root} --no-bias-gelu-fusion".split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    try:
        trainer.checkpointer.load(trainer.train_state(), root)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_training_resumes_at_its_next_iteration(megatron_checkpoint):
    """--train-iters 12 from its iteration 10: iterations 11 and 12 run, the same under TP=2."""
    _, root, _, _ = megatron_checkpoint("llama")
    tp1 = run_workers(_resume, 1, root)[0]
    tp2 = run_workers(_resume, 2, root)[0]
    assert len(tp1) == 2 and all(torch.isfinite(torch.tensor(tp1)))
    torch.testing.assert_close(torch.tensor(tp2), torch.tensor(tp1), rtol=TOL, atol=0)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_to_megatron_loads_strictly_in_megatron_core(megatron_checkpoint, kind, tmp_path):
    """Ours (here: the Megatron checkpoint converted to our torch_dist) -> --to-megatron ->
    megatron-core loads it strictly with our logits."""
    _, root, tokens, _ = megatron_checkpoint(kind)
    ours_dir, out_dir = tmp_path / "ours", tmp_path / "back"
    convert.main(["--load-dir", root, "--save-dir", str(ours_dir),
                  "--target-ckpt-format", "torch_dist"])
    ours, _, _ = run_workers(_our_logits, 1, str(ours_dir), tokens)[0]
    convert.main(["--load-dir", str(ours_dir), "--to-megatron", str(out_dir)])
    folder = files.iteration_dir(str(out_dir), mcu.ITERATION)
    theirs, args, iteration = run_workers(mcu.load_strict, 1, kind, folder, tokens)[0]
    assert iteration == mcu.ITERATION and args["padded_vocab_size"] == mcu.PADDED
    torch.testing.assert_close(theirs[..., :mcu.VOCAB], ours, rtol=TOL, atol=TOL)


def _task_loss(rank, world, root, text):
    """Worker: tasks/main.py's WIKITEXT103 total loss (nats) on ``text`` from ``root``."""
    from megatron_cp.inference.launch import parse_inference_args
    from tasks.main import check_task_args, get_tasks_args, run_task
    args = parse_inference_args(["--task", "WIKITEXT103", "--valid-data", text, "--load", root,
                                 "--use-checkpoint-args"], world, get_tasks_args, check_task_args)
    return run_task(args, parallel_state(args))["total_loss"]


def test_wikitext_task_on_a_megatron_checkpoint_gives_megatron_cores_loss(megatron_checkpoint,
                                                                         tmp_path):
    """The WIKITEXT103 task on the Megatron-LM checkpoint, over a text whose two windows of
    --seq-length 16 are the two rows megatron-core computed its logits of (then one more
    token): the task's summed loss is megatron-core's cross entropy of those windows (fp32
    logits, 32 tokens: relative 1e-5)."""
    _, root, tokens, theirs = megatron_checkpoint("gpt")  # [2, s], [2, s, v]
    last = torch.tensor([7])
    ids = torch.cat([tokens[0], tokens[1], last])  # [2 s + 1]: windows are the rows
    text = tmp_path / "heldout.txt"
    text.write_text(" ".join(map(str, ids.tolist())))
    ours = run_workers(_task_loss, 1, root, str(text))[0]
    labels = torch.cat([ids[1:mcu.SEQ + 1], ids[mcu.SEQ + 1:]])  # [2 s]
    loss = torch.nn.functional.cross_entropy(theirs.reshape(-1, mcu.VOCAB).double(), labels,
                                             reduction="sum")
    assert abs(ours - loss.item()) <= 1e-5 * loss.item(), (ours, loss.item())
