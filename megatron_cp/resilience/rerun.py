"""Megatron-LM's rerun state machine (``--rerun-mode``): an iteration whose loss or gradient
fails a check is run again, from the same batch and the same RNG states, to tell a fault of
the hardware from a result the data and the model really give.

The checks (:func:`check_loss`, :func:`check_grad_bucket`) validate local values before any
data-parallel reduction: each microbatch's loss sum (NaN, inf with
``--check-for-nan-in-loss-and-grad``; a spike of 10x the largest of the first 100 losses
with ``--check-for-spiky-loss``) and each gradient bucket's norm (NaN, inf; 10x with
``--check-for-large-grads``). ``--rerun-mode``:

* ``validate_results`` (the default): a rejected result reruns the step in place, on every
  rank (the ranks agree by an all-reduce over the world). A different result is a transient
  fault: a fatal check (NaN, inf) exits with :data:`EXIT_CODE_FAILED_ON_RESULT_VALIDATION`
  (17), a non-fatal one (spike) continues. The same result is reproducible: a fatal check
  (a non-fatal one continues) saves a checkpoint under ``--save`` and exits with
  :data:`EXIT_CODE_RESUME_TO_DISAMBIGUATE` (16; without ``--save``, 17), asking the
  launcher to resume the job on another GPU, which reruns the step once more and compares:
  a different result there is a persistent fault of the first GPU, the same result a correct
  one (both exit 17); resumed on the same node and device it exits 16 again. The first
  iteration of a process is not validated (Megatron's rule: no checkpoint is known good yet).
* ``report_stats``: every step runs twice; the relative difference of each validated result
  is collected and rank 0 prints its distribution every 2 iterations (non-determinism).
  (Megatron-LM at d98e8a64 turns this flag value into no mode of its machine, whose enum
  spells it ``report_determinism_stats``, and stops at start-up; here it runs the mode the
  flag's help describes.)
* ``disabled``: no rerun; a rejected result is recorded and a non-fatal one logged, while
  the training loop's own NaN checks (:mod:`megatron_cp.resilience.faults`) stop on a fatal one.

``--error-injection-rate N`` fakes a rejected result about once in N validations (of type
``--error-injection-type``) to exercise all of it. The log lines and exit codes are
Megatron-LM's (``megatron/core/rerun_state_machine.py``).
"""
import math
import random
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from megatron_cp.distributed import device as device_mod
from megatron_cp.resilience import rerun_records as records
from megatron_cp.config.training import RERUN_MODES
from megatron_cp.resilience.rerun_outcomes import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE, GRAD_TOLERANCE,
    LARGE_GRADS_FACTOR, LOSS_TOLERANCE, REPORTING_INTERVAL_ITERATIONS, SPIKY_LOSS_FACTOR,
    ErrorInjector, RerunExit, State, _node_name, compare_floats, describe_rejection)

logger = records.logger


class RerunStateMachine:
    """One per training run (``Trainer.rerun``). The step loop is::

        while machine.should_run_forward_backward(iteration):
            ...zero the gradients, run every microbatch (the checks call validate_result)...
        checkpoint, stop, code = machine.should_checkpoint_and_exit()

    ``rank``: this process's global rank; ``device``: its device (named in the log lines,
    and compared when a resumed job reruns, to know it moved); ``save_extra`` /
    ``restore_extra``: the training state beyond the global RNGs that a rerun must start
    from again (the RNG tracker's states, the MoE routers' counters).
    """

    def __init__(self, mode="disabled", *, rank=0, device=torch.device("cpu"),
                 injector=None, tracker_file=None, save_extra=None, restore_extra=None):
        if mode not in RERUN_MODES:
            raise ValueError(f"--rerun-mode {mode!r} is not one of {', '.join(RERUN_MODES)}")
        self.mode, self.state = mode, State.NOT_RUNNING_YET
        self.rank, self.device = rank, torch.device(device)
        self.injector = injector or ErrorInjector()
        self.tracker_file = tracker_file
        self.save_extra, self.restore_extra = save_extra, restore_extra
        self.current_iteration = 0  # completed iterations; the messages say +1
        self.first_iteration_complete = False
        self.logged_enabled = False
        self.saved_state = None
        self.validation_counts = {}
        self.large_value_counts, self.max_values = {}, {}
        self.saved_results, self.stats = {}, {}
        self._reset_requests()
        self.failed_call, self.initial_result = None, None
        self.failed_quantity, self.failed_injected = None, False
        self.suspicious_node, self.suspicious_device = None, None

    def _reset_requests(self):
        # Per-rank requests, agreed over the world once the (re)run is over.
        self.rerun_requested = self.checkpoint_requested = False
        self.restart_again_requested = self.continue_requested = False

    # ----- the step loop ---------------------------------------------------------------
    def should_run_forward_backward(self, iteration):
        """Whether to run (again) the forward and backward of the step after ``iteration``
        completed ones. A collective over the world at the end of each (re)run, except in
        ``disabled`` mode."""
        self.validation_counts = {}
        state = self.state
        if state == State.NOT_RUNNING_YET:
            self.current_iteration = iteration
            self.state = State.INITIAL_RUN
            if self.mode != "disabled":
                self._save_state()
                self._reset_requests()
            return True
        if state == State.INITIAL_RUN:
            self.state = State.NOT_RUNNING_YET
            if self.mode == "disabled" or not self._any_rank(self.rerun_requested)[0]:
                return False
            if self.mode == "validate_results" and self.rank == 0:
                logger.warning("Need to rerun step to check reproducibility of initial result")
            self.state = State.RERUNNING_IN_PLACE
            self._restore_state()
            return True
        if state == State.RERUNNING_IN_PLACE:
            if self.mode == "report_stats":
                self.state = State.NOT_RUNNING_YET
                self._maybe_report_stats()
                self.saved_results = {}
                return False
            will_continue, will_checkpoint = self._any_rank(self.continue_requested,
                                                            self.checkpoint_requested)
            if will_continue:
                self._continue_normally()
                return False
            if will_checkpoint:
                self.state = State.WILL_RERUN_FROM_CHECKPOINT
            # the checkpoint (or the exit) holds the state the step started from
            self._restore_state()
            return False
        if state == State.WILL_RERUN_FROM_CHECKPOINT:
            self.state = State.RERUNNING_FROM_CHECKPOINT
            return True
        if state == State.RERUNNING_FROM_CHECKPOINT:
            restart_again, will_continue = self._any_rank(self.restart_again_requested,
                                                          self.continue_requested)
            if restart_again:
                self._log_rank_0("Need to restart job from the same checkpoint because it was "
                                 "scheduled on the same node/GPU")
                self.state = State.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif will_continue:
                self._continue_normally()
            return False
        raise AssertionError(f"the step loop met rerun state {state}")

    def _continue_normally(self):
        self._log_rank_0("Continuing normal execution because failed validation was not fatal")
        self.state = State.NOT_RUNNING_YET

    def should_checkpoint_and_exit(self):
        """``(save a checkpoint, exit, exit code)`` once the step's (re)runs are over."""
        self.first_iteration_complete = True
        if self.mode != "validate_results":
            return False, False, 0
        if self.state == State.RERUNNING_IN_PLACE:
            self._log_rank_0("Exiting now. The job can be resumed from a previous checkpoint")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == State.WILL_RERUN_FROM_CHECKPOINT:
            self._log_rank_0("Saving a checkpoint and exiting now. Please resume the job from "
                             "the checkpoint to rerun the last iteration and establish a "
                             "diagnostic")
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state == State.RERUNNING_FROM_CHECKPOINT:
            self._log_rank_0("Exiting now. A checkpoint at the last iteration already exists "
                             "if further examination is needed")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == State.RERUNNING_AGAIN_FROM_CHECKPOINT:
            self._log_rank_0("Exiting now. Please resume the job from the same checkpoint to "
                             "rerun the last iteration and establish a diagnostic")
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    def step_exit(self):
        """The :class:`RerunExit` to raise, or None to go on with the step's update; an exit
        names what the first rank that rejected a result rejected (a collective then)."""
        checkpoint, stop, code = self.should_checkpoint_and_exit()
        if not stop:
            return None
        return RerunExit(code, checkpoint, self.current_iteration + 1, cause=self._cause())

    def _cause(self):
        """The line of the first rank (by global rank) whose check rejected a result this
        step: every rank's own, gathered over the world (only when the job stops)."""
        mine = None
        if self.failed_call is not None and self.initial_result is not None:
            quantity = self.failed_quantity or f"the result of '{self.failed_call[0]}'"
            mine = describe_rejection(quantity, self.initial_result, self.rank,
                                      self.current_iteration + 1, self.failed_injected)
        lines = [mine]
        if dist.is_available() and dist.is_initialized():
            lines = [None] * dist.get_world_size()
            dist.all_gather_object(lines, mine)
        return next((line for line in lines if line), "")

    # ----- validation ------------------------------------------------------------------
    @property
    def keeps_fatal_checks(self):
        """Whether a fatal check has anything to do: with reruns disabled and no tracker
        file, the training loop's own NaN checks (:mod:`megatron_cp.resilience.faults`) do it all."""
        return self.mode != "disabled" or self.tracker_file is not None

    def validate_result(self, result, rejection, message, tolerance=0.0, fatal=True,
                        quantity="the result"):
        """Check ``result`` (a number or a 0-dim tensor) with ``rejection(value) -> bool``;
        ``message`` names the check; ``tolerance``: the relative difference under which a
        rerun's result counts as the same; ``fatal``: whether a confirmed rejection ends
        the job; ``quantity``: what ``result`` is, for the exit's line (``the loss``). Every
        call site must be met in the same order by every rerun."""
        value = float(result.detach()) if torch.is_tensor(result) else float(result)
        call = self._call(message)
        if self.mode == "disabled":
            if rejection(value):
                self._record(records.RERUN_DISABLED, value, message)
                if not fatal:  # a fatal one is stopped by the loop's NaN checks
                    logger.warning(f"{self._where()}, iteration {self.current_iteration + 1}: "
                                   f"Unexpected result {value} (message='{message}')")
            return
        if self.mode == "report_stats":
            if self.state == State.INITIAL_RUN:
                self.rerun_requested = True
                self.saved_results[call] = value
            elif self.state == State.RERUNNING_IN_PLACE:
                stats = self.stats.setdefault(message, records.QuickStats())
                stats.record(compare_floats(self.saved_results[call], value))
            return
        if not self.logged_enabled:
            self.logged_enabled = True
            self._log_rank_0("Result validation enabled")
        if self.state == State.INITIAL_RUN and not self.rerun_requested:
            if not self.first_iteration_complete:
                return
            injected = self.injector.maybe_inject(self.rank)
            if injected or rejection(value):
                self.failed_call, self.initial_result = call, value
                self.failed_quantity, self.failed_injected = quantity, injected
                self.rerun_requested = True
                self._record(records.INITIAL_RUN, value, message)
                logger.error(f"Unexpected result {value} on rank {self.rank} at iteration "
                             f"#{self.current_iteration + 1} invocation #{call[1]} "
                             f"(message='{message}')")
        elif self.state == State.RERUNNING_IN_PLACE and call == self.failed_call:
            self._judge_first_rerun(value, message, tolerance, fatal)
        elif self.state == State.RERUNNING_FROM_CHECKPOINT and call == self.failed_call:
            self._judge_second_rerun(value, message, tolerance, fatal)

    def _judge_first_rerun(self, value, message, tolerance, fatal):
        difference = self.injector.maybe_miscompare(self.initial_result, value, self.state)
        if difference > tolerance:  # not reproducible: a transient fault
            self.continue_requested = not fatal
            self._log_failure("First rerun: unexpected result is not reproducible within the "
                              f"tolerance ({value} != {self.initial_result})", fatal)
            self._record(records.FIRST_RERUN_NOT_REPRODUCIBLE, value, message)
            self._log_failure("Possible transient error!", fatal)
            return
        self.checkpoint_requested, self.continue_requested = fatal, not fatal
        # the resumed job must run on another node or device to tell
        self.suspicious_node, self.suspicious_device = _node_name(), str(self.device)
        self._record(records.FIRST_RERUN_REPRODUCIBLE, value, message)
        self._log_failure("First rerun: unexpected result is reproducible within the "
                          f"tolerance ({value} = {self.initial_result}). Need to rerun on a "
                          "different GPU to verify correctness.", fatal)

    def _judge_second_rerun(self, value, message, tolerance, fatal):
        difference = self.injector.maybe_miscompare(self.initial_result, value, self.state)
        if (_node_name(), str(self.device)) == (self.suspicious_node, self.suspicious_device):
            logger.error("Got rescheduled on the same GPU. Need to resume again from the same "
                         f"checkpoint (node: {self.suspicious_node}, gpu: "
                         f"{self.suspicious_device})")
            self.restart_again_requested = True
            return
        if difference > tolerance:
            self._record(records.SECOND_RERUN_NOT_REPRODUCIBLE, value, message)
            logger.warning("Second rerun: unexpected result is not reproducible on a different "
                           f"GPU, therefore was likely incorrect ({value} != "
                           f"{self.initial_result})")
            self._log_failure("Possible persistent error!")
        else:
            self._record(records.SECOND_RERUN_REPRODUCIBLE, value, message)
            logger.warning("Second rerun: unexpected result is reproducible on a different GPU, "
                           f"therefore it was likely correct ({value} = {self.initial_result})")
            self._log_failure(f"Correct result (but possible Application error) ({message})")
        self.continue_requested = not fatal

    def is_unexpectedly_large(self, value, threshold, context, num_samples=100):
        """A rejection test: whether ``value`` is at least ``threshold`` times the largest
        of the first ``num_samples`` values seen under ``context`` (those first ones are
        never large; NaN and inf are left to their own checks)."""
        value = math.fabs(float(value))
        if not math.isfinite(value):
            return False
        count = self.large_value_counts.get(context, 0)
        if count < num_samples:
            self.large_value_counts[context] = count + 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if count + 1 == num_samples:
                logger.warning(f"Max value for {context}: {self.max_values[context]}")
            return False
        return value >= self.max_values[context] * threshold

    # ----- checkpoint ------------------------------------------------------------------
    def state_dict(self):
        """What a checkpoint keeps for a rerun on another GPU (None when none is pending):
        this rank's verdict so far, its injector, its spike statistics."""
        if self.mode == "disabled" or self.state == State.NOT_RUNNING_YET:
            return None
        return {"mode": self.mode, "state": self.state.name,
                "current_iteration": self.current_iteration,
                "rerun_requested": self.rerun_requested,
                "checkpoint_requested": self.checkpoint_requested,
                "restart_again_requested": self.restart_again_requested,
                "continue_requested": self.continue_requested,
                "injector": self.injector.state_dict(), "failed_call": self.failed_call,
                "initial_result": self.initial_result, "failed_quantity": self.failed_quantity,
                "failed_injected": self.failed_injected, "suspicious_node": self.suspicious_node,
                "suspicious_device": self.suspicious_device,
                "large_value_counts": dict(self.large_value_counts),
                "max_values": dict(self.max_values)}

    def load_state_dict(self, saved):
        """Resume a pending rerun from a checkpoint's :meth:`state_dict` (ignored, saying so,
        with ``--rerun-mode disabled``)."""
        if saved is None:
            return
        if self.mode == "disabled":
            self._log_rank_0("RerunStateMachine disabled via CLI, ignoring machine state saved "
                             "in checkpoint")
            return
        self._log_rank_0("Getting RerunStateMachine state from checkpoint. Will rerun step.")
        self.mode, self.state = saved["mode"], State[saved["state"]]
        self.current_iteration = saved["current_iteration"]
        self.rerun_requested = saved["rerun_requested"]
        self.checkpoint_requested = saved["checkpoint_requested"]
        self.restart_again_requested = saved["restart_again_requested"]
        self.continue_requested = saved["continue_requested"]
        self.injector.load_state_dict(saved["injector"])
        self.failed_call = None if saved["failed_call"] is None else tuple(saved["failed_call"])
        self.initial_result = saved["initial_result"]
        self.failed_quantity = saved.get("failed_quantity")  # absent before it was saved
        self.failed_injected = saved.get("failed_injected", False)
        self.suspicious_node = saved["suspicious_node"]
        self.suspicious_device = saved["suspicious_device"]
        self.large_value_counts = dict(saved["large_value_counts"])
        self.max_values = dict(saved["max_values"])

    # ----- helpers ---------------------------------------------------------------------
    def _call(self, message):
        """``(message, n)``: the n-th validation of ``message`` in this (re)run."""
        self.validation_counts[message] = self.validation_counts.get(message, 0) + 1
        return message, self.validation_counts[message]

    def _any_rank(self, *flags):
        """Collective over the world: each flag true on any rank."""
        values = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32,
                              device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(values)
        return [v > 0 for v in values.tolist()]

    def _save_state(self):
        """Everything a forward and backward may advance: the RNGs, and the run's extras."""
        self.saved_state = {"python": random.getstate(), "numpy": np.random.get_state(),
                            "torch": torch.get_rng_state(),
                            "device": device_mod.rng_state(self.device),
                            "extra": self.save_extra() if self.save_extra else None}

    def _restore_state(self):
        saved = self.saved_state
        random.setstate(saved["python"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
        device_mod.set_rng_state(saved["device"], self.device)
        if self.restore_extra and saved["extra"] is not None:
            self.restore_extra(saved["extra"])

    def _maybe_report_stats(self):
        """Every REPORTING_INTERVAL_ITERATIONS iterations rank 0 gathers every rank's
        statistics and prints them (it keeps the sum; the others start afresh)."""
        if self.current_iteration % REPORTING_INTERVAL_ITERATIONS != 0:
            return
        gathered = [self.stats]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size() if self.rank == 0 else None
            dist.gather_object(self.stats, gathered, dst=0)
        if self.rank != 0:
            for stats in self.stats.values():
                stats.reset()
            return
        lines = ["Stats on computation determinism in validation calls"]
        for message in sorted({m for stats in gathered for m in stats}):
            own = self.stats.setdefault(message, records.QuickStats())
            own.combine([s[message] for s in gathered[1:] if message in s])
            lines += [f"  From validation call '{message}':", f"    {own.summary()}"]
        print("\n".join(lines), flush=True)

    def _record(self, status, value, message):
        if self.tracker_file is not None:
            records.append_record(self.tracker_file, node=_node_name(), device=str(self.device),
                                  rank=self.rank, iteration=self.current_iteration + 1,
                                  status=status, result=value, message=message)

    def _where(self):
        return f"Rank {self.rank}, node {_node_name()}, device {self.device}"

    def _log_failure(self, text, fatal=True):
        line = f"{self._where()}, iteration #{self.current_iteration + 1}: {text}!"
        (logger.error if fatal else logger.warning)(line)

    def _log_rank_0(self, text):
        if self.rank == 0:
            logger.warning(text)


def from_config(training, rank, device, save_extra=None, restore_extra=None):
    """The machine that the training section ``training`` describes (its ``rerun_mode``,
    ``error_injection_rate`` and ``_type`` and ``result_rejected_tracker_filename``), for
    global ``rank`` on ``device``."""
    injector = ErrorInjector(training.error_injection_rate, training.error_injection_type)
    return RerunStateMachine(training.rerun_mode, rank=rank, device=device, injector=injector,
                             tracker_file=training.result_rejected_tracker_filename,
                             save_extra=save_extra, restore_extra=restore_extra)


def flag_problems(training):
    """The rerun settings' own rules, in the training section ``training``: a line per
    problem (none: [])."""
    problems = []
    rate = training.error_injection_rate
    if rate < 0:
        problems.append(f"--error-injection-rate ({rate}) must be at least 0 (0: no injection)")
    elif rate > 0 and training.rerun_mode != "validate_results":
        problems.append(f"--error-injection-rate {rate} fakes rejected results for the "
                        f"validation of --rerun-mode validate_results, which --rerun-mode "
                        f"{training.rerun_mode} does not run; drop one of the two")
    bad = [n for n in training.iterations_to_skip if n < 1]
    if bad:
        problems.append(f"--iterations-to-skip {' '.join(map(str, bad))}: iterations count "
                        f"from 1")
    if training.result_rejected_tracker_filename is not None:
        try:
            records.check_appendable(training.result_rejected_tracker_filename)
        except ValueError as error:
            problems.append(str(error))
    return problems


def iterations_to_skip(training, rank):
    """The training section's ``iterations_to_skip`` and, with its
    ``result_rejected_tracker_filename``, the iterations that the file's records mark (logged
    on rank 0, as Megatron does at start-up)."""
    skips = set(training.iterations_to_skip)
    tracker = training.result_rejected_tracker_filename
    if tracker is not None:
        marked, kept = records.iterations_to_skip(tracker)
        if rank == 0:
            logger.warning(f"Will skip these iterations from tracker file: {marked}")
            if kept:
                logger.warning(f"Will not skip these iterations due to multiple rank errors: "
                               f"{kept}")
        skips.update(marked)
    return skips


# ----- the checks the training step makes --------------------------------------------------

def check_loss(machine, loss, check_nan, check_spiky):
    """Validate one microbatch's local loss sum (before any reduction): NaN and inf (fatal)
    with ``check_nan``, a spike of SPIKY_LOSS_FACTOR x the largest early loss (not fatal)
    with ``check_spiky``."""
    if check_nan and machine.keeps_fatal_checks:
        machine.validate_result(loss, math.isnan, "found NaN in local forward loss calculation",
                                tolerance=LOSS_TOLERANCE, fatal=True, quantity="the loss")
        machine.validate_result(loss, math.isinf, "found Inf in local forward loss calculation",
                                tolerance=LOSS_TOLERANCE, fatal=True, quantity="the loss")
    if check_spiky:
        machine.validate_result(
            loss, partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                          context="loss"),
            "Spiky loss", tolerance=LOSS_TOLERANCE, fatal=False)


def check_grad_bucket(machine, index, grad_data, check_nan, check_large):
    """Validate the norm of gradient bucket ``index`` of this rank before its data-parallel
    reduction: NaN and inf (fatal) with ``check_nan``, LARGE_GRADS_FACTOR x the largest
    early norm (not fatal) with ``check_large``."""
    check_nan = check_nan and machine.keeps_fatal_checks
    if not (check_nan or check_large):
        return
    norm = grad_data.norm(p=2)
    bucket = f"bucket #{index} in backward pass before data-parallel communication collective"
    if check_nan:
        quantity = f"the gradient norm of bucket #{index}"
        machine.validate_result(norm, math.isnan, f"found NaN in local grad norm for {bucket}",
                                tolerance=GRAD_TOLERANCE, fatal=True, quantity=quantity)
        machine.validate_result(norm, math.isinf, f"found Inf in local grad norm for {bucket}",
                                tolerance=GRAD_TOLERANCE, fatal=True, quantity=quantity)
    if check_large:
        machine.validate_result(
            norm, partial(machine.is_unexpectedly_large, threshold=LARGE_GRADS_FACTOR,
                          context="grads"),
            f"found unexpected large grads in {bucket}", tolerance=GRAD_TOLERANCE, fatal=False)
