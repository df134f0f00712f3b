"""Explicit pipeline splits and rank orders train exactly as one process does.

10 training steps under each setting reproduce the single-process losses to a relative 1e-5
(fp32, CPU): Megatron-LM layout strings (an embedding-only first stage; PP=4 x 2 virtual
stages with a loss-only stage and two empty stages), the first/last stage counts with
virtual stages, the embedding and loss counted in the even split (uneven: 1, 2, 1 layers on
3 stages), the interleaved schedule on 5 microbatches in groups of 3, and PP x DP under both
rank orders (DP outermost, the default; PP outermost, Megatron-LM's), also with MoE layers
whose EP x ETP differs from TP x CP and with CP x PP x DP on 8 ranks (each run reports its
groups, so the order is the one asked for). A checkpoint saved under an interleaved uneven
layout loads under PP=1 (torch_dist directly; torch through tools/checkpoint_convert.py, both
ways) with the same losses; one saved under either rank order resumes under the other.
"""
import pytest

from dist_harness import run_workers
from megatron_cp.cli.arguments import parse_args
from megatron_cp.training import pretrain
from tools import checkpoint_convert as convert
from training_utils import TINY, max_rel_diff, parallel_state, train_losses, train_runs

STEPS = TINY.replace("--num-layers 2", "--num-layers 4") + " --train-iters 10"
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 0.05 "
       "--no-bias-gelu-fusion")
REFERENCES = {"4": STEPS, "6": STEPS.replace("--num-layers 4", "--num-layers 6"),
              "4_gbs10": STEPS.replace("--global-batch-size 8", "--global-batch-size 10"),
              "4_moe": f"{STEPS} {MOE}"}
PP2, PP4 = "--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 4"
CP2, EP2 = "--context-parallel-size 2", "--expert-model-parallel-size 2"
PP_OUTER = "--rank-order tp-cp-ep-dp-pp"
# name: (world, reference, extra arguments, expected groups of rank 0 ({name: ranks}) or None)
LAYOUTS = {
    "pp2_embedding_only_stage": (2, "4", f"{PP2} --pipeline-model-parallel-layout E|ttttL", None),
    "pp2_vp2_first_last": (2, "6", f"{PP2} --num-virtual-stages-per-pipeline-rank 2 "
                                   f"--decoder-first-pipeline-num-layers 2 "
                                   f"--decoder-last-pipeline-num-layers 4", None),
    "pp2_vp2_groups_of_3": (2, "4_gbs10", f"{PP2} --num-layers-per-virtual-pipeline-stage 1 "
                                          f"--microbatch-group-size-per-virtual-pipeline-stage 3",
                            None),
    "pp3_account_for_embedding_and_loss": (3, "4", "--pipeline-model-parallel-size 3 "
                                                   "--account-for-embedding-in-pipeline-split "
                                                   "--account-for-loss-in-pipeline-split", None),
    "pp4_vp2_empty_stages": (4, "4", f"{PP4} --pipeline-model-parallel-layout E|t|t|t|t|||L "
                                     f"--eval-iters 1 --eval-interval 5", None),
    # the rank orders: DP outermost (the default), PP outermost (Megatron-LM's)
    "pp2_dp2": (4, "4", PP2, {"pp": [0, 1]}),
    "pp2_dp2_pp_outermost": (4, "4", f"{PP2} {PP_OUTER}", {"pp": [0, 2]}),
    # experts inside a stage in either order, EP x ETP (2) unlike TP x CP (1); reduced over
    # the expert-DP group, which the order moves too
    "pp2_dp2_ep2_moe": (4, "4_moe", f"{PP2} {EP2}", {"pp": [0, 1], "ep": [0, 2]}),
    "pp2_dp2_ep2_moe_pp_outermost": (4, "4_moe", f"{PP2} {EP2} {PP_OUTER}",
                                     {"pp": [0, 2], "ep": [0, 1]}),
    # CP x PP x DP, which Megatron-LM refuses under --use-tp-pp-dp-mapping (our default)
    "cp2_pp2_dp2": (8, "4", f"{PP2} {CP2} --use-tp-pp-dp-mapping", {"pp": [0, 2], "cp": [0, 1]}),
    "cp2_pp2_dp2_pp_outermost": (8, "4", f"{PP2} {CP2} {PP_OUTER}", {"pp": [0, 4], "cp": [0, 1]}),
}


def _train(rank, world, argv):
    args = parse_args(argv.split(), world_size=world)
    state = parallel_state(args)
    groups = {name: state.group_ranks(name) for name in ("pp", "cp", "ep")}
    return {"losses": pretrain(args, state), "groups": groups}


def _train_all(rank, world, argvs):
    return {name: _train(rank, world, argv) for name, argv in argvs.items()}


@pytest.fixture(scope="module")
def references():
    return {name: result["losses"] for name, result in
            run_workers(_train_all, 1, REFERENCES)[0].items()}


_RUNS = {}


def _results(world):
    """Train every setting of ``world`` ranks once (cached for the module)."""
    if world not in _RUNS:
        argvs = {name: f"{REFERENCES[ref]} {extra}"
                 for name, (w, ref, extra, _) in LAYOUTS.items() if w == world}
        _RUNS[world] = run_workers(_train_all, world, argvs, timeout=400)
    return _RUNS[world]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_split_matches_single_process(references, name):
    world, ref, _, groups = LAYOUTS[name]
    reference = references[ref]
    assert reference[-1] < reference[0], "the tiny model must learn"
    results = _results(world)
    for rank_results in results:  # every rank reports the same global loss
        diff = max_rel_diff(rank_results[name]["losses"], reference)
        print(f"{name}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5
    for group, ranks in (groups or {}).items():  # the order asked for
        assert results[0][name]["groups"][group] == ranks, group


LAYOUT = f"{PP2} --pipeline-model-parallel-layout Et|t|tt|L"  # interleaved, uneven: 1, 1, 2, 0


def _save_under_layout(rank, world, save_dirs):
    """Train 5 iterations under LAYOUT and save, in each format."""
    for fmt, folder in save_dirs.items():
        train_losses(rank, world, f"{STEPS} {LAYOUT} --save {folder} --exit-interval 5 "
                                  f"--ckpt-format {fmt}")
    return True


def _resume(rank, world, loads):
    """The losses after loading each checkpoint, under the arguments given with it."""
    return {name: train_losses(rank, world, f"{STEPS} {extra} --load {folder}")
            for name, (folder, extra) in loads.items()}


def test_checkpoint_under_a_layout_loads_under_pp1(references, tmp_path):
    """torch_dist loads directly; a torch checkpoint is resharded by
    tools/checkpoint_convert.py (weights only: the first resumed loss is the straight run's)
    to PP=1, and from PP=1 to another layout, which loads again."""
    dirs = {fmt: str(tmp_path / fmt) for fmt in ("torch", "torch_dist")}
    run_workers(_save_under_layout, 2, dirs)
    pp1, other = str(tmp_path / "pp1"), str(tmp_path / "other_layout")
    convert.main(["--load-dir", dirs["torch"], "--save-dir", pp1])
    convert.main(["--load-dir", pp1, "--save-dir", other, "--target-pipeline-parallel-size", "2",
                  "--target-pipeline-model-parallel-layout", "E|ttttL"])
    resumed = run_workers(_resume, 1, {"torch_dist": (dirs["torch_dist"], ""),
                                       "pp1": (pp1, "")})[0]
    layout_resumed = run_workers(_resume, 2, {
        "other": (other, f"{PP2} --pipeline-model-parallel-layout E|ttttL")})[0]
    straight = references["4"]
    assert max_rel_diff(resumed["torch_dist"], straight[5:]) < 1e-5  # optimizer state too
    for first_loss in (resumed["pp1"][0], layout_resumed["other"][0]):
        assert abs(first_loss - straight[5]) / straight[5] < 1e-5


def test_checkpoint_resumes_under_the_other_rank_order(references, tmp_path):
    """An MoE run (PP=2, DP=2, EP=2) saved under one rank order resumes under the other with
    the straight run's losses, optimizer state included: torch_dist from PP outermost to the
    default, torch from the default to PP outermost."""
    moe = f"{MOE} {PP2} {EP2}"
    pp_outer, dp_outer = str(tmp_path / "pp_outer"), str(tmp_path / "dp_outer")
    saved = run_workers(train_runs, 4, [
        f"{STEPS} {moe} {PP_OUTER} --save {pp_outer} --exit-interval 5",
        f"{STEPS} {moe} --save {dp_outer} --exit-interval 5 --ckpt-format torch"], timeout=400)
    assert all(isinstance(run, list) and len(run) == 5 for run in saved[0]), saved[0]
    resumed = run_workers(_resume, 4, {"torch_dist": (pp_outer, moe),
                                       "torch": (dp_outer, f"{moe} {PP_OUTER}")}, timeout=400)[0]
    for fmt, losses in resumed.items():
        assert max_rel_diff(losses, references["4_moe"][5:]) < 1e-5, fmt
