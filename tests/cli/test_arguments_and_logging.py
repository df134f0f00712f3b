"""Command-line validation (before any process group) and the Megatron-style log output."""
import contextlib
import io
import os

import pytest

from dist_harness import run_workers
from megatron_cp.cli.arguments import build_parser, parse_args
from training_utils import TINY, train_losses

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --vocab-size 100")


@pytest.mark.parametrize("extra,world,match", [
    ("--global-batch-size 6", 4, r"--global-batch-size \(6\) must be divisible by --micro-batch-size "
                                 r"\(2\) x data-parallel size \(4\)"),
    ("--tensor-model-parallel-size 8", 8, r"--num-attention-heads \(4\) must be divisible by "
                                          r"--tensor-model-parallel-size \(8\)"),
    ("--tensor-model-parallel-size 3", 4, r"the world size \(4\) must be divisible by --tensor-model-parallel-size \(3\)"),
    ("--group-query-attention --num-query-groups 3", 1, r"--num-attention-heads \(4\) must be "
                                                         r"divisible by --num-query-groups \(3\)"),
    ("--fp16 --bf16", 1, "exclusive"),
    ("--lr-warmup-iters 5", 1, r"--lr-warmup-iters \(5\) must be smaller"),
    ("--recompute-granularity full", 1, "--recompute-method"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --seq-length 31", 2,
     r"--seq-length \(31\) must be divisible"),
    ("--exit-signal-handler", 1, "give --save"),
    ("--attention-dropout 1.5", 1, r"--attention-dropout \(1.5\) is a probability"),
    ("--context-parallel-size 2 --attention-dropout 0 --seq-length 30", 2,
     r"--seq-length \(30\) must be divisible by 2 x CP \(4\)"),
    ("--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a+p2p "
     "--hierarchical-context-parallel-sizes 2 3", 4, r"multiply to 6, not --context-parallel-size \(4\)"),
    ("--position-embedding-type learned_absolute --max-position-embeddings 16", 1,
     r"--max-position-embeddings \(16\) must be at least --seq-length \(32\)"),
])
def test_bad_arguments_raise_before_any_group(extra, world, match):
    with pytest.raises(ValueError, match=match):
        parse_args(f"{BASE} {extra}".split(), world_size=world)


def test_missing_data_and_tokenizer():
    no_data = BASE.replace("--mock-data", "")
    with pytest.raises(ValueError, match="no data: give --data-path"):
        parse_args(no_data.split())
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        parse_args(f"{no_data} --data-path x --tokenizer-type SentencePieceTokenizer".split())


def test_defaults_and_derived_values():
    args = parse_args(f"{BASE} --global-batch-size 16 --tensor-model-parallel-size 2".split(),
                      world_size=4)
    assert args.data_parallel_size == 2 and args.num_microbatches == 4
    assert args.num_query_groups == 4 and args.ffn_hidden_size == 128
    assert args.lr_decay_iters == 5 and args.max_position_embeddings == 32


def test_every_flag_has_help():
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"


def _train_capturing(rank, world, argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        train_losses(rank, world, argv)
    return buf.getvalue()


# Megatron's tensorboard switches and the tags each one writes (its names).
TENSORBOARD_SWITCHES = {
    "--log-timers-to-tensorboard": ("iteration-time", "throughput", "tokens-per-second"),
    "--log-memory-to-tensorboard": ("mem-allocated-bytes", "mem-max-allocated-bytes"),
    "--log-validation-ppl-to-tensorboard": ("lm loss validation ppl",),
    "--log-world-size-to-tensorboard": ("world-size",),
}


def _scalar_tags(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.parametrize("switched", [False, True], ids=["defaults", "every-switch"])
def test_log_line_validation_line_and_tensorboard(tmp_path, switched):
    argv = (TINY.replace("--log-interval 100 --eval-iters 0", "--log-interval 2 --eval-iters 2") +
            f" --train-iters 4 --eval-interval 2 --tensorboard-dir {tmp_path}")
    if switched:
        argv += " " + " ".join(TENSORBOARD_SWITCHES) + " --no-log-loss-scale-to-tensorboard"
    out = run_workers(_train_capturing, 2, argv)[0]
    line = next(line for line in out.splitlines() if "iteration        4/       4" in line)
    for field in ("consumed samples:           32", "elapsed time per iteration (ms):",
                  "throughput per GPU (TFLOP/s/GPU):", "tokens per second:", "learning rate:",
                  "global batch size:     8", "lm loss: ", "loss scale: 1.0", "grad norm:",
                  "number of skipped iterations:   0"):
        assert field in line, field
    assert "E+00" in line.split("lm loss: ")[1].split("|")[0]
    assert "validation loss at iteration 2 | lm loss value:" in out and "lm loss PPL:" in out
    events = [f for f in os.listdir(tmp_path) if f.startswith("events.out.tfevents")]
    assert events, "tensorboard wrote no event file"
    tags = _scalar_tags(tmp_path)
    assert {"lm loss", "learning-rate", "grad-norm", "lm loss validation"} <= tags, tags
    switched_tags = {tag for written in TENSORBOARD_SWITCHES.values() for tag in written}
    assert (switched_tags <= tags) == switched and not (switched_tags & tags and not switched)
    assert ("loss-scale" in tags) != switched  # on by default, --no-log-loss-scale-... turns it off


def test_profile_flags_write_a_trace_of_the_chosen_iterations(tmp_path):
    """Megatron's --profile --use-pytorch-profiler: iterations 3..4 (step start 2, end 4) of
    every rank (no --profile-ranks, as in Megatron-LM), a torch.profiler trace per rank under
    --tensorboard-dir and the operator table."""
    argv = (TINY + f" --train-iters 6 --tensorboard-dir {tmp_path} --profile "
            "--use-pytorch-profiler --profile-step-start 2 --profile-step-end 4")
    outs = run_workers(_train_capturing, 2, argv)
    assert "profile of iterations 3..4 on rank 0" in outs[0]
    assert "profile of iterations 3..4 on rank 1" in outs[1]
    # The operator table: its header and operator rows (which operators lead it depends on
    # the machine's load, so no one operator is named).
    table = outs[0].split("profile of iterations 3..4 on rank 0")[1]
    assert "# of Calls" in table and "Self CPU" in table
    assert sum(line.lstrip().startswith("aten::") for line in table.splitlines()) >= 3, table
    traces = sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt.trace.json"))
    assert [t.split(".")[0] for t in traces] == ["rank0", "rank1"], traces
    import json
    with open(os.path.join(tmp_path, traces[0])) as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("Optimizer.step")}
    assert steps, "the trace holds no optimizer step"


def test_profile_ranks_pick_who_profiles(tmp_path):
    argv = (TINY + f" --train-iters 3 --tensorboard-dir {tmp_path} --profile "
            "--use-pytorch-profiler --profile-step-start 1 --profile-step-end 2 --profile-ranks 1")
    outs = run_workers(_train_capturing, 2, argv)
    assert "profile of iterations 2..2 on rank 1" in outs[1]
    traces = [f for f in os.listdir(tmp_path) if f.endswith(".pt.trace.json")]
    assert [t.split(".")[0] for t in traces] == ["rank1"], traces
