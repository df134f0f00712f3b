"""Pipeline splits without processes: Megatron-LM's layout grammar, the global layer numbers
every split flag gives (Megatron-LM's offset formulas, worked by hand), one-line errors for bad
splits before anything starts, the interleaved schedule's microbatch-group rule and its
schedule table, replayed for deadlocks."""

import pytest

from megatron_cp.cli.arguments import parse_args
from megatron_cp.checkpoint.files import rank_grid
from megatron_cp.pipeline_parallel import parse_layout, pipeline_layout
from megatron_cp.pipeline_parallel.interleaved import schedule_table
from megatron_cp.pipeline_parallel.replay import record_program, simulate
from megatron_cp.pipeline_parallel.stages import validate_interleaved_microbatches
from training_utils import TINY

BASE = TINY.replace("--num-layers 2", "--num-layers 4") + " --train-iters 10"


@pytest.mark.parametrize("text,stages", [
    ("Et|(tt|)*2,tL", ["Et", "tt", "tt", "tL"]),
    ("E|(t|)*3,m|m||L", ["E", "t", "t", "t", "m", "m", "", "L"]),  # Megatron-LM's help example
    ("Et*3|(tt|)*29,m|L", ["Ettt"] + ["tt"] * 29 + ["m", "L"]),
    ("E,t*12,L", ["E" + "t" * 12 + "L"]),  # multi-digit counts, cosmetic commas
    ("(tt)*3|L", ["tttttt", "L"]),  # a group without separators
    ("(|t)*2,tL", ["", "t", "ttL"]),
])
def test_grammar(text, stages):
    assert parse_layout(text) == stages


def _numbers(layout):
    return [layout.chunk_layer_numbers(r) for r in range(layout.pp_size)]


def test_layer_numbers_follow_megatron_lms_offsets():
    # Megatron-LM's initialize_model_parallel example: 16 layers, PP=4, VP=2
    # (GPU 0: [1, 2] [9, 10], 1-based); the same from a layout string
    example = pipeline_layout(16, 4, num_virtual_stages=2)
    assert _numbers(example)[0] == [[0, 1], [8, 9]] and _numbers(example)[3] == [[6, 7], [14, 15]]
    assert _numbers(pipeline_layout(16, 4, layout="Ett|(tt|)*6,ttL")) == _numbers(example)
    # uneven first/last with virtual stages: offset = chunk x 3 + first/VP (+ middle ranks)
    uneven = pipeline_layout(6, 2, num_virtual_stages=2, first=2, last=4)
    assert str(uneven) == "Et|tt|t|ttL" and _numbers(uneven) == [[[0], [3]], [[1, 2], [4, 5]]]
    # accounted embedding and loss: offset = rank x 2 - 1 off the first stage
    accounted = pipeline_layout(4, 3, account_for_embedding=True, account_for_loss=True)
    assert str(accounted) == "Et|tt|tL" and _numbers(accounted) == [[[0]], [[1, 2]], [[3]]]
    # ... with virtual stages: offset = chunk x 4 + rank x 2 - 1
    both = pipeline_layout(6, 2, num_virtual_stages=2, account_for_embedding=True,
                           account_for_loss=True)
    assert str(both) == "Et|tt|tt|tL" and _numbers(both) == [[[0], [3, 4]], [[1, 2], [5]]]
    # embedding-only and loss-only stages, and empty ones
    assert str(pipeline_layout(2, 4, account_for_embedding=True, account_for_loss=True)) == "E|t|t|L"
    spread = pipeline_layout(4, 4, layout="E|t|t|t|t|||L")
    assert _numbers(spread) == [[[], [3]], [[0], []], [[1], []], [[2], []]]
    assert spread.describe()[1] == "PP rank 1: layer 0 | (empty stage)"
    assert spread.has_loss(3, 1) and not spread.has_loss(3, 0) and spread.has_embedding(0, 0)


MTP_UNASKED = "holds 1 MTP layers (m) but --mtp-num-layers is None"


LAYOUT, PP2 = "--pipeline-model-parallel-layout", "--pipeline-model-parallel-size 2"


@pytest.mark.parametrize("extra,world,message", [
    (f"{PP2} {LAYOUT} Et|tmL", 2, MTP_UNASKED),
    (f"{PP2} {LAYOUT} Ettm|ttL --mtp-num-layers 1", 2, "the MTP layers (m) must all sit in the "
                                                        "last stage"),
    (f"{PP2} {LAYOUT} Ett|ttL --mtp-num-layers 1", 2, "holds 0 MTP layers (m) but "
                                                      "--mtp-num-layers is 1"),

    (f"{PP2} {LAYOUT} Et|tt|tL", 2, "has 3 stages, not a multiple of "
                                    "--pipeline-model-parallel-size (2)"),
    (f"{PP2} {LAYOUT} Et|tL", 2, "holds 2 transformer layers (t) but --num-layers is 4"),
    (f"{PP2} {LAYOUT} tE|ttL", 2, "the embedding (E) must come first"),
    (f"{PP2} {LAYOUT} Ett|tt", 2, "must hold the embedding (E) and the loss (L) once each; it "
                                  "holds 1 E and 0 L"),
    (f"--pipeline-model-parallel-size 3 {LAYOUT} |Ett|ttL", 3,
     "the embedding (E) belongs in the first stage"),
    (f"{PP2} {LAYOUT} Ett|ttX", 2, "'X' is not a piece of a stage"),
    (f"{PP2} {LAYOUT} Ett|ttL --decoder-first-pipeline-num-layers 2", 2,
     "--pipeline-model-parallel-layout places every layer itself; drop "
     "--decoder-first-pipeline-num-layers"),
    (f"{PP2} {LAYOUT} Et|t|t|tL --num-virtual-stages-per-pipeline-rank 2", 2,
     "each set the virtual stages; give one"),
    (f"{PP2} --decoder-first-pipeline-num-layers 1 --account-for-loss-in-pipeline-split", 2,
     "are two ways to balance the stages; give one"),
    (f"{PP2} --decoder-first-pipeline-num-layers 2 --num-layers-per-virtual-pipeline-stage 1", 2,
     "give the virtual stages with --num-virtual-stages-per-pipeline-rank"),
    (f"{PP2} --decoder-first-pipeline-num-layers 1 --num-virtual-stages-per-pipeline-rank 2", 2,
     "--num-virtual-stages-per-pipeline-rank (2) must divide the layers of the first stage (1)"),
    (f"{PP2} --account-for-embedding-in-pipeline-split", 2,
     "--num-layers (4) plus the accounted embedding / loss (= 5) must be divisible"),
    ("--num-virtual-stages-per-pipeline-rank 2", 1, "need --pipeline-model-parallel-size > 1"),
    (f"{PP2} --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 6", 2,
     "number of microbatches (3) to be a multiple of --pipeline-model-parallel-size (2) unless "
     "--microbatch-group-size-per-virtual-pipeline-stage is given"),
    (f"{PP2} --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 10 "
     "--microbatch-group-size-per-virtual-pipeline-stage 6", 2,
     "--microbatch-group-size-per-virtual-pipeline-stage (6) must lie between "
     "--pipeline-model-parallel-size (2) and the number of microbatches (5)"),
    (f"{PP2} --num-layers-per-virtual-pipeline-stage 1 --global-batch-size 14 "
     "--microbatch-group-size-per-virtual-pipeline-stage 3", 2,
     "the last group would hold 1, fewer than --pipeline-model-parallel-size (2)"),
    (f"{PP2} --rank-order tp-cp-ep-dp-pp --use-tp-pp-dp-mapping", 4,
     "--use-tp-pp-dp-mapping selects rank order tp-cp-ep-pp-dp but --rank-order is "
     "tp-cp-ep-dp-pp; give one of the two"),
])
def test_bad_splits_fail_with_one_line_before_anything_starts(extra, world, message):
    with pytest.raises(ValueError) as error:
        parse_args(f"{BASE} {extra}".split(), world_size=world)
    lines = str(error.value).splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def _megatron_accepts(num_microbatches, pp_size, group_size):
    """Megatron-LM's checks in forward_backward_pipelining_with_interleaving."""
    if not pp_size <= group_size <= num_microbatches:
        return False
    return not 0 < num_microbatches % group_size < pp_size


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_interleaved_microbatch_rule_is_megatron_lms(pp):
    for num in range(1, 5 * pp):
        for group in [None] + list(range(1, num + 2)):
            try:
                validate_interleaved_microbatches(num, pp, 2, group)
                accepted = True
            except ValueError:
                accepted = False
            assert accepted == _megatron_accepts(num, pp, pp if group is None else group)
    validate_interleaved_microbatches(5, pp, None, None)  # no virtual stages: no rule


def test_schedule_table_and_replay_with_microbatch_groups():
    # Megatron-LM's example, PP=2, VP=2, groups of 3, 5 microbatches
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                       (3, 0), (4, 0), (3, 1), (4, 1)]
    rank0 = record_program(2, 0, 2, 5, group_size=3)
    assert [(e[2], e[1]) for e in rank0 if e[0] == "F"] == schedule_table(5, 2, 3)
    for pp, vp, num, group in [(2, 2, 5, 3), (2, 3, 7, 4), (3, 2, 7, 4), (4, 2, 9, 5),
                               (4, 3, 10, 6), (3, 2, 6, 6)]:
        programs = [record_program(pp, r, vp, num, group_size=group) for r in range(pp)]
        for program in programs:  # every chunk runs every microbatch forward and backward
            for kind in "FB":
                assert sorted((e[1], e[2]) for e in program if e[0] == kind) == \
                    [(c, m) for c in range(vp) for m in range(num)]
        simulate(programs, 1.0, 2.0, vp)  # raises on a deadlock or an unmatched message
        simulate([record_program(pp, r, vp, num, forward_only=True, group_size=group)
                  for r in range(pp)], 1.0, 0.0, vp)


def test_rank_order_flags():
    """The default is DP outermost; Megatron-LM's --use-tp-pp-dp-mapping spells it, and
    --rank-order tp-cp-ep-dp-pp is Megatron-LM's default; no order refuses a size."""
    argv = f"{BASE} {PP2} --context-parallel-size 2 --expert-model-parallel-size 4"
    argv += " --num-experts 4 --moe-router-topk 2 --no-bias-gelu-fusion"
    for extra, order in (("", "tp-cp-ep-pp-dp"), ("--use-tp-pp-dp-mapping", "tp-cp-ep-pp-dp"),
                         ("--rank-order tp-cp-ep-pp-dp --use-tp-pp-dp-mapping", "tp-cp-ep-pp-dp"),
                         ("--rank-order tp-cp-ep-dp-pp", "tp-cp-ep-dp-pp")):
        assert parse_args(f"{argv} {extra}".split(), world_size=8).rank_order == order, extra


def test_rng_files_follow_the_rank_order():
    """The RNG files are per global rank: a rank order that moves ranks (PP > 1 and DP > 1)
    is another rank grid, one that moves none is the same."""
    pp_outer, dp_outer = "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"

    def grid(order, pp, dp):
        args = {"world_size": pp * dp, "tensor_model_parallel_size": 1,
                "context_parallel_size": 1, "pipeline_model_parallel_size": pp}
        return rank_grid(args if order is None else dict(args, rank_order=order))

    assert grid(dp_outer, 2, 2) != grid(pp_outer, 2, 2)
    assert grid(None, 2, 2) == grid(dp_outer, 2, 2)  # saved before the setting
    assert grid(None, 2, 2) != grid(pp_outer, 2, 2)
    assert grid(dp_outer, 1, 4) == grid(pp_outer, 1, 4)
    assert grid(dp_outer, 2, 1) == grid(pp_outer, 2, 1)
