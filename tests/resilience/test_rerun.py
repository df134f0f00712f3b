"""The rerun state machine (``--rerun-mode``, megatron_cp/rerun.py) with Megatron-LM's
meaning: a rejected result reruns the step from the same batch and RNG states; a transient
fault is told from a reproducible result, with Megatron's log lines and exit codes (16:
resume elsewhere, 17: failed validation); report_stats prints the variability; the ranks
agree; the result-rejected tracker file marks iterations to skip.

Dropout is on in the end-to-end runs: a rerun that did not start from the same RNG states
would draw other masks and give another loss.
"""
import contextlib
import io
import os
import random
import re

import pytest

from dist_harness import run_workers
from training_utils import TINY, train_losses

from megatron_cp.resilience import rerun, rerun_records

BASE = TINY + " --train-iters 3 --log-interval 1"  # TINY's dropout on
# Only the spike check validates; its injected faults are not fatal, so training goes on.
SPIKY = " --no-check-for-nan-in-loss-and-grad --check-for-spiky-loss"


def _log(text):
    """The rerun machine's log lines (stderr: Python's logging) and the error line."""
    return [line for line in text.splitlines() if not line.startswith((" [", "---", " >"))]


def _main(rank, world, argv, node=None):
    """``pretrain_gpt.py``'s main on a harness worker: (status, stdout + stderr). ``node``
    replaces the node name that the machine compares on a resumed rerun (another GPU)."""
    from megatron_cp import training
    from megatron_cp.cli import check_args
    check_args.OTHER_RANK_GRACE_SECONDS = 0.0
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    if node is not None:
        rerun._node_name = lambda: node
    text = io.StringIO()
    with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
        status = training.main(argv.split())
    return status, text.getvalue()


def _losses_and_log(rank, world, argv):
    """The losses of ``pretrain`` and what it printed; Python's ``random`` seeded alike on
    every rank, so an injection rate above 1 picks the same rank on each."""
    random.seed(5)
    text = io.StringIO()
    with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
        losses = train_losses(rank, world, argv)
    return losses, text.getvalue()


def _counting_runs(rank, world, argv):
    """:func:`_losses_and_log`, also counting the forward passes of each iteration."""
    from megatron_cp import training
    from megatron_cp.training import trainer as trainer_module
    runs, real_forward, real_step = {}, trainer_module.forward_step, training.Trainer.train_step
    current = {}

    def train_step(self):
        current["it"] = self.iteration + 1
        return real_step(self)

    def forward_step(model, batch):
        runs[current["it"]] = runs.get(current["it"], 0) + 1
        return real_forward(model, batch)

    training.Trainer.train_step, trainer_module.forward_step = train_step, forward_step
    return (*_losses_and_log(rank, world, argv), runs)


# ----- units ----------------------------------------------------------------------------

def test_comparison_and_unexpectedly_large_values():
    assert rerun.compare_floats(2.0, 2.0) == rerun.compare_floats(float("nan"), float("nan")) == 0
    assert rerun.compare_floats(1.0, 3.0) == pytest.approx(1.0)  # |1 - 3| / mean(1, 3)
    assert rerun.compare_floats(1.0, float("nan")) == rerun.compare_floats(
        float("inf"), float("-inf")) == rerun.compare_floats(1.0, -1.0) == float("inf")
    machine = rerun.RerunStateMachine("validate_results")
    # the first 100 values set the scale and are never large
    assert not any(machine.is_unexpectedly_large(v, 10, "loss") for v in range(1, 101))
    assert not machine.is_unexpectedly_large(999.0, 10, "loss")
    assert machine.is_unexpectedly_large(1000.0, 10, "loss")  # 10 x the largest (100)
    assert not machine.is_unexpectedly_large(float("nan"), 10, "loss")  # NaN has its own check
    assert not machine.is_unexpectedly_large(1000.0, 10, "grads")  # each context its own


def test_tracker_file_marks_iterations_rejected_twice_on_one_rank(tmp_path):
    path = str(tmp_path / "rejected.txt")
    rerun_records.check_appendable(path)
    assert not os.path.exists(path)  # checked, not created

    def record(rank, iteration, status, job="7"):
        os.environ["SLURM_JOBID"] = job
        rerun_records.append_record(path, node="n", device="cpu", rank=rank,
                                    iteration=iteration, status=status, result=float("nan"),
                                    message="found NaN in local forward loss calculation")

    try:
        record(0, 5, rerun_records.INITIAL_RUN)
        record(0, 5, rerun_records.FIRST_RERUN_REPRODUCIBLE)  # once: not yet
        record(0, 9, rerun_records.FIRST_RERUN_NOT_REPRODUCIBLE)
        record(0, 9, rerun_records.FIRST_RERUN_NOT_REPRODUCIBLE)  # transient: never
        assert rerun_records.iterations_to_skip(path) == ([], [])
        record(0, 5, rerun_records.SECOND_RERUN_REPRODUCIBLE)  # twice on rank 0: skip it
        record(1, 7, rerun_records.RERUN_DISABLED)
        record(1, 7, rerun_records.RERUN_DISABLED)
        record(2, 7, rerun_records.RERUN_DISABLED)  # another rank of the same job: keep it
        assert rerun_records.iterations_to_skip(path) == ([5], [7])
    finally:
        os.environ.pop("SLURM_JOBID")
    with open(path) as file:
        assert re.fullmatch(r"ts=\S+ \S+ node=n device=cpu jobID=7 rank=0 iteration=5 "
                            r"status=initial_run result=nan message='found NaN in local "
                            r"forward loss calculation'", file.readline().strip())


# ----- validate_results ----------------------------------------------------------------------

def test_transient_fault_is_rerun_and_training_goes_on_with_the_same_losses():
    """An injected transient fault in the (non-fatal) spike check at every validated step:
    the step reruns, the rerun's result differs (the injected verdict), training goes on,
    and the losses are those of the run without faults, dropout and all."""
    reference, quiet = run_workers(_losses_and_log, 1, BASE + SPIKY)[0]
    losses, text, runs = run_workers(_counting_runs, 1,
                                     BASE + SPIKY + " --error-injection-rate 1")[0]
    assert losses == reference  # the same computation, run again: the same bits
    assert runs == {1: 4, 2: 8, 3: 8}  # 4 microbatches; iteration 1 is never validated
    log = _log(text)
    for it in (2, 3):
        assert re.search(rf"Unexpected result \S+ on rank 0 at iteration #{it} invocation #1 "
                         rf"\(message='Spiky loss'\)", text), text
        assert (f"Rank 0, node {os.uname()[1]}, device cpu, iteration #{it}: Possible "
                f"transient error!!") in log, text
    assert log.count("Continuing normal execution because failed validation was not fatal") == 2
    assert "Need to rerun" not in quiet and "Unexpected result" not in quiet


def test_a_rerun_counts_the_moe_routing_once():
    """The routers' statistics of a rerun step (the log line's balancing loss and token
    counts) are those of one run: the rerun starts from the counters the step started
    with."""
    moe = " --num-experts 4 --moe-ffn-hidden-size 64 --moe-aux-loss-coeff 0.01 --no-bias-gelu-fusion"
    pattern = r"load_balancing_loss: (\S+) \| z_loss: \S+ \| tokens per expert min/max: (\S+) \|"
    reference = re.findall(pattern, run_workers(_losses_and_log, 1, BASE + SPIKY + moe)[0][1])
    text = run_workers(_losses_and_log, 1, BASE + SPIKY + moe + " --error-injection-rate 1")[0][1]
    assert "Possible transient error!!" in text
    assert len(reference) == 3 and re.findall(pattern, text) == reference


def test_transient_fault_in_a_fatal_check_exits_17():
    status, text = run_workers(_main, 1, BASE + " --error-injection-rate 1")[0]
    log = _log(text)
    assert status == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION == 17, text
    assert re.search(r"Unexpected result \S+ on rank 0 at iteration #2 invocation #1 "
                     r"\(message='found NaN in local forward loss calculation'\)", text), text
    assert log[-3:-1] == [
        f"Rank 0, node {os.uname()[1]}, device cpu, iteration #2: Possible transient error!!",
        "Exiting now. The job can be resumed from a previous checkpoint"], text
    assert re.fullmatch(
        r"error: the loss \(\S+\) on rank 0 at iteration 2 was rejected by "
        r"--error-injection-rate; iteration 2 failed result validation \(exit status 17\); "
        r"resume from the last checkpoint with --load, and look at the data and the model if "
        r"the rejected result was reproducible", log[-1]), text


def test_a_nan_loss_names_the_loss_the_rank_and_the_iteration(tmp_path):
    """A learning rate that blows the weights up: the loss of iteration 3 is NaN or Inf, the
    rerun gives it again, and the job stops with one line saying so before the verdict (at
    TP 2: the rank is the first that saw it)."""
    argv = (TINY + " --train-iters 6 --lr 1e20 --min-lr 1e19 --lr-warmup-iters 0 "
            f"--tensor-model-parallel-size 2 --save {tmp_path / 'ck'} --save-interval 100")
    results = run_workers(_main, 2, argv)
    status, text = results[0]
    assert status == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE, text
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.match(
        r"error: the loss was (NaN|Inf) on rank 0 at iteration \d+; iteration \d+ gave the same "
        r"rejected result when rerun here; its checkpoint was saved", errors[0]), text
    assert not any(line.startswith("error: ") for line in results[1][1].splitlines())


def test_persistent_fault_checkpoints_exits_16_and_reruns_on_another_node(tmp_path):
    """First job: the rerun reproduces the (injected) rejected result, so it saves the state
    before the step and exits 16. Resumed on the same node it exits 16 again; resumed on
    another node it reruns the step from the checkpoint (the same loss, dropout and all),
    which the persistent error makes differ there: exit 17."""
    save, tracker = str(tmp_path / "ckpt"), str(tmp_path / "rejected.txt")
    argv = (f"{BASE} --error-injection-rate 1 --error-injection-type persistent_error "
            f"--save {save} --result-rejected-tracker-filename {tracker}")
    status, text = run_workers(_main, 1, argv)[0]
    assert status == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE == 16, text
    first = re.search(r"Unexpected result (\S+) on rank 0 at iteration #2 invocation #1", text)
    assert first, text
    assert (f"Rank 0, node {os.uname()[1]}, device cpu, iteration #2: First rerun: unexpected "
            f"result is reproducible within the tolerance ({first[1]} = {first[1]}). Need to "
            f"rerun on a different GPU to verify correctness.!") in _log(text), text
    assert ("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to "
            "rerun the last iteration and establish a diagnostic") in _log(text), text
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as file:
        assert file.read() == "1"  # the state before the failed iteration 2

    status, text = run_workers(_main, 1, f"{argv} --load {save}")[0]
    assert status == 16, text
    assert ("Getting RerunStateMachine state from checkpoint. Will rerun step." in _log(text)
            and f"Got rescheduled on the same GPU. Need to resume again from the same checkpoint "
                f"(node: {os.uname()[1]}, gpu: cpu)" in _log(text)
            and "Exiting now. Please resume the job from the same checkpoint to rerun the last "
                "iteration and establish a diagnostic" in _log(text)), text

    status, text = run_workers(_main, 1, f"{argv} --load {save}", "another-node")[0]
    assert status == 17, text
    assert (f"Second rerun: unexpected result is not reproducible on a different GPU, therefore "
            f"was likely incorrect ({first[1]} != {first[1]})") in _log(text), text
    assert ("Rank 0, node another-node, device cpu, iteration #2: Possible persistent error!!"
            in _log(text)), text
    assert ("Exiting now. A checkpoint at the last iteration already exists if further "
            "examination is needed") in _log(text), text
    with open(tracker) as file:
        statuses = re.findall(r"iteration=2 status=(\w+)", file.read())
    assert statuses == ["initial_run", "first_rerun_reproducible",
                        "second_rerun_not_reproducible"]


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_a_real_nan_on_one_rank_is_rerun_and_reproduced(tmp_path, kind):
    """No injection: rank 1's loss is NaN (or its gradient inf) at iteration 2, every time it
    is computed. Rank 1's own check rejects it before any reduction, both ranks rerun the
    step, rank 1 finds it reproducible, and both save and exit 16 (with --rerun-mode disabled
    the loop's own check stops it instead: tests/resilience/test_faults.py)."""
    results = run_workers(_bad_value_on_rank_1_at_2, 2, f"{BASE} --save {tmp_path}", kind)
    (status0, text0), (status1, text1) = results
    assert status0 == status1 == 16, text1
    check = ("found NaN in local forward loss calculation" if kind == "loss" else
             r"found (NaN|Inf) in local grad norm for bucket #\d+ in backward pass before "
             r"data-parallel communication collective")
    assert re.search(rf"Unexpected result \S+ on rank 1 at iteration #2 invocation #\d+ "
                     rf"\(message='{check}'\)", text1), text1
    assert re.search(rf"Rank 1, node \S+, device cpu, iteration #2: First rerun: unexpected "
                     rf"result is reproducible within the tolerance \((nan|inf) = \1\)\. "
                     rf"Need to rerun on a different GPU to verify correctness\.!", text1), text1
    assert "Unexpected result" not in text0 and "First rerun" not in text0  # rank 0 was fine
    assert "Need to rerun step to check reproducibility of initial result" in _log(text0)
    with open(os.path.join(tmp_path, "latest_checkpointed_iteration.txt")) as file:
        assert file.read() == "1"


def _bad_value_on_rank_1_at_2(rank, world, argv, kind):
    import torch
    from megatron_cp import training
    from megatron_cp.training import trainer as trainer_module
    real_forward, real_step, current = trainer_module.forward_step, training.Trainer.train_step, {}

    def train_step(self):
        current["it"] = self.iteration + 1
        return real_step(self)

    def forward_step(model, batch):
        out = real_forward(model, batch)
        if rank == 1 and current["it"] == 2:
            if kind == "loss":
                return out * float("nan")
            out.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        return out

    training.Trainer.train_step, trainer_module.forward_step = train_step, forward_step
    return _main(rank, world, argv)


# ----- report_stats, disabled, the ranks together --------------------------------------------

def test_report_stats_reruns_every_step_and_prints_the_variability():
    reference, _ = run_workers(_losses_and_log, 1, BASE)[0]
    losses, text, runs = run_workers(_counting_runs, 1, f"{BASE} --rerun-mode report_stats "
                                                        f"--check-for-large-grads")[0]
    assert losses == reference and runs == {1: 8, 2: 8, 3: 8}
    # printed after iterations 1 and 3 (every 2 iterations, Megatron's 0-based count);
    # a rerun from the same RNG states repeats every result exactly
    blocks = text.split("Stats on computation determinism in validation calls\n")[1:]
    assert len(blocks) == 2, text
    lines = blocks[1].splitlines()
    assert lines[:2] == ["  From validation call 'found Inf in local forward loss "
                         "calculation':", "    12 samples, all identical"], text
    assert ("  From validation call 'found unexpected large grads in bucket #0 in backward "
            "pass before data-parallel communication collective':") in lines
    assert lines[lines.index("  From validation call 'found NaN in local forward loss "
                             "calculation':") + 1] == "    12 samples, all identical"


def test_disabled_mode_reruns_nothing():
    """--rerun-mode disabled: no validation lines, no rerun, the same losses; an injection
    rate with it is refused (it would inject nothing)."""
    reference, _ = run_workers(_losses_and_log, 1, BASE)[0]
    losses, text, runs = run_workers(_counting_runs, 1, f"{BASE} --rerun-mode disabled "
                                                        f"--check-for-spiky-loss")[0]
    assert losses == reference and runs == {1: 4, 2: 4, 3: 4}
    for line in ("Result validation enabled", "Need to rerun", "Unexpected result"):
        assert line not in text, text
    from megatron_cp.cli.arguments import ArgumentErrors, parse_args
    with pytest.raises(ArgumentErrors, match=re.escape(
            "--error-injection-rate 3 fakes rejected results for the validation of "
            "--rerun-mode validate_results, which --rerun-mode disabled does not run; drop "
            "one of the two")):
        parse_args(f"{BASE} --rerun-mode disabled --error-injection-rate 3".split())


@pytest.mark.parametrize("layout,rate,microbatches", [
    ("", 2, 2),  # DP=2; rate 2: the rank term of Megatron's draw injects on one rank only
    ("--pipeline-model-parallel-size 2", 1, 4),  # only the last stage validates the loss
])
def test_two_ranks_agree_to_rerun(layout, rate, microbatches):
    """One rank sees a rejected (injected) result: both ranks rerun the step and go on, and
    their losses are the fault-free run's."""
    argv = f"{BASE}{SPIKY} {layout}"
    reference = run_workers(_losses_and_log, 2, argv)[0][0]
    results = run_workers(_counting_runs, 2, f"{argv} --error-injection-rate {rate}")
    texts = [text for _, text, _ in results]
    injected = [bool(re.search(r"Unexpected result .* \(message='Spiky loss'\)", t))
                for t in texts]
    assert sorted(injected) == [False, True], texts  # one rank saw a rejected result
    for losses, _, runs in results:
        assert losses == reference
        # both ranks reran iterations 2 and 3 (iteration 1 is not validated)
        assert runs == {1: microbatches, 2: 2 * microbatches, 3: 2 * microbatches}, runs


# ----- the tracker file feeds --iterations-to-skip ------------------------------------------

def test_iterations_rejected_twice_are_skipped_at_start_up(tmp_path):
    tracker = str(tmp_path / "rejected.txt")
    for status in (rerun_records.INITIAL_RUN, rerun_records.FIRST_RERUN_REPRODUCIBLE,
                   rerun_records.SECOND_RERUN_REPRODUCIBLE):
        rerun_records.append_record(tracker, node="n", device="cpu", rank=0, iteration=2,
                                    status=status, result=float("nan"), message="m")
    reference, _ = run_workers(_losses_and_log, 1, BASE)[0]
    losses, text = run_workers(_losses_and_log, 1, f"{BASE} --result-rejected-tracker-filename "
                                                   f"{tracker}")[0]
    assert "Will skip these iterations from tracker file: [2]" in text, text
    assert len(losses) == 2 and losses[0] == reference[0] and losses[1] != reference[1]
    assert re.search(r"iteration +3/ +3 \| consumed samples: +24 \| skipped samples: +8 \|",
                     text), text
