"""Dynamic CP's flags (config/dynamic_cp.py): both of Megatron-LM's spellings, its rules, and
ours, each refused in one line before anything starts."""
import pytest

from megatron_cp.cli.arguments import parse_args
from training_utils import TINY, assert_refused

BASE = f"{TINY} --train-iters 4 --calculate-per-token-loss --context-parallel-size 2"
WHY = "dynamic context parallelism (--dynamic-context-parallel)"


@pytest.mark.parametrize("flag", ["--dynamic-context-parallel", "--hybrid-context-parallel"])
def test_both_spellings_turn_it_on(flag):
    args = parse_args(f"{BASE} {flag} --max-seqlen-per-dp-cp-rank 16".split(), world_size=4)
    assert args.dynamic_context_parallel and args.max_seqlen_per_dp_cp_rank == 16
    assert any(note.startswith("dynamic context parallelism:") for note in args.compat_notes)


@pytest.mark.parametrize("extra,world,line", [
    ("--dynamic-context-parallel", 4, f"{WHY} needs --max-seqlen-per-dp-cp-rank"),
    ("--max-seqlen-per-dp-cp-rank 16", 4, "--max-seqlen-per-dp-cp-rank is read only by dynamic"),
    ("--dynamic-context-parallel --max-seqlen-per-dp-cp-rank 8", 2,
     "--seq-length 32: a document of 32 tokens does not fit the 2 ranks"),
    ("--dynamic-context-parallel --max-seqlen-per-dp-cp-rank 16 "
     "--pipeline-model-parallel-size 2", 4, f"{WHY} does not run with pipeline parallelism"),
    ("--dynamic-context-parallel --max-seqlen-per-dp-cp-rank 16", 6, f"{WHY} needs a power-of-two"),
    ("--dynamic-context-parallel --max-seqlen-per-dp-cp-rank 16 "
     "--min-dynamic-context-parallel-size 3", 4, "--min-dynamic-context-parallel-size 3 must be"),
    ("--dynamic-context-parallel --max-seqlen-per-dp-cp-rank 16 --mtp-num-layers 1", 4,
     f"{WHY} does not run with --mtp-num-layers"),
    ("--dynamic-context-parallel --max-seqlen-per-dp-cp-rank 16 --num-experts 4 --swiglu "
     "--moe-aux-loss-coeff 0.01", 4,
     f"{WHY} does not run with MoE balancing"),
    ("--dynamic-context-parallel --max-seqlen-per-dp-cp-rank 16 --use-torch-fsdp2 "
     "--use-distributed-optimizer --no-gradient-accumulation-fusion", 4,
     f"{WHY} does not run with --use-torch-fsdp2"),
    ("--dynamic-context-parallel --max-seqlen-per-dp-cp-rank 16 --use-megatron-fsdp "
     "--no-gradient-accumulation-fusion", 4, f"{WHY} does not run with --use-megatron-fsdp"),
])
def test_rules_are_one_line_each(extra, world, line):
    assert_refused(f"{BASE} {extra}", line, world_size=world)


def test_per_token_loss_is_required():
    argv = BASE.replace("--calculate-per-token-loss", "")
    assert_refused(f"{argv} --dynamic-context-parallel --max-seqlen-per-dp-cp-rank 16",
                   f"{WHY} needs --calculate-per-token-loss", world_size=4)
