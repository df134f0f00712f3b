"""What the rerun state machine (:mod:`megatron_cp.resilience.rerun`) decides and says: its
states, Megatron-LM's exit codes and the exit that carries one, the lines that describe a
rejected result and an exit, the comparison of two results, and ``--error-injection-*``'s
fake faults."""
import enum
import math
import os
import random

from megatron_cp.resilience.rerun_records import logger


EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16  # resume from the checkpoint just saved, elsewhere
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17

SPIKY_LOSS_FACTOR = 10  # a loss this many times the largest seen is a spike
LARGE_GRADS_FACTOR = 10
# The forward pass is deterministic; a gradient may not be (atomics in attention backward).
LOSS_TOLERANCE, GRAD_TOLERANCE = 0.0, 0.001
REPORTING_INTERVAL_ITERATIONS = 2
MATCH, MISMATCH = 0.0, math.inf


class State(enum.Enum):
    """Where the machine is in the step (Megatron's states)."""
    NOT_RUNNING_YET = 0  # between steps
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3  # saved in the checkpoint the job exits 16 with
    RERUNNING_FROM_CHECKPOINT = 4  # the resumed job's rerun, on another GPU
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5  # resumed on the same GPU: exit 16 again


class RerunExit(Exception):
    """The machine ends the job: exit with ``code``, after saving a checkpoint when
    ``checkpoint`` (the launcher resumes it elsewhere); ``iteration`` (1-based) is the step
    that failed validation; ``note`` says why a requested checkpoint was not saved; ``cause``
    names the rejected quantity, its value, the rank and the iteration."""

    def __init__(self, code, checkpoint, iteration, note="", cause=""):
        self.code, self.checkpoint, self.iteration, self.note = code, checkpoint, iteration, note
        self.cause = cause
        super().__init__(describe_exit(code, checkpoint, iteration, note, cause))

    def without_checkpoint(self, note):
        """The exit when the checkpoint it asks for cannot be saved: failed, with ``note``."""
        return RerunExit(EXIT_CODE_FAILED_ON_RESULT_VALIDATION, False, self.iteration, note,
                         self.cause)


def describe_exit(code, checkpoint, iteration, note="", cause=""):
    """The one line that closes the log lines of an exit: what was rejected (``cause``), what
    the status means, what to do."""
    head = f"{cause}; " if cause else ""
    if code == EXIT_CODE_RESUME_TO_DISAMBIGUATE:
        saved = "its checkpoint was saved" if checkpoint else "its checkpoint is there"
        return (f"{head}iteration {iteration} gave the same rejected result when rerun here; "
                f"{saved}: resume with --load on another GPU to rerun it there and tell a "
                f"faulty GPU from a real result (exit status {code}), or with --rerun-mode "
                f"disabled to stop on the value")
    return (f"{head}iteration {iteration} failed result validation (exit status {code}){note}; "
            f"resume from the last checkpoint with --load, and look at the data and the model "
            f"if the rejected result was reproducible")


def describe_rejection(quantity, value, rank, iteration, injected=False):
    """``the loss was NaN on rank 3 at iteration 7``: what a check rejected, where."""
    if injected:
        return (f"{quantity} ({value}) on rank {rank} at iteration {iteration} was rejected "
                f"by --error-injection-rate")
    if math.isnan(value):
        shown = "NaN"
    elif math.isinf(value):
        shown = "Inf" if value > 0 else "-Inf"
    else:
        shown = repr(value)
    return f"{quantity} was {shown} on rank {rank} at iteration {iteration}"


def _node_name():
    return os.uname()[1]


def compare_floats(a, b):
    """Relative difference of two results, ``|a - b| / mean(a, b)``: 0 when equal (NaN
    equals NaN), inf when they differ and one is NaN or inf (Megatron's default comparison;
    +inf against -inf and a against -a count as different, where Megatron's gives NaN or
    divides by zero)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return MATCH
    if not (math.isfinite(a) and math.isfinite(b)) or a + b == 0:
        return MISMATCH
    return math.fabs((a - b) / (a + b) * 2)


class ErrorInjector:
    """``--error-injection-rate`` / ``--error-injection-type``: fakes a rejected result in
    about one of ``rate`` validations (at most once per step), and the rerun verdicts that
    the type stands for."""

    _NAMES = {"correct_result": "Expected result", "transient_error": "Transient error",
              "persistent_error": "Persistent error"}

    def __init__(self, rate=0, kind="transient_error"):
        self.rate, self.kind = rate, kind
        self.injected = None  # the kind injected into the step under validation

    def maybe_inject(self, rank):
        if self.rate <= 0 or self.injected is not None:
            return False
        if (random.randint(0, self.rate - 1) + rank) % self.rate != 0:
            return False
        self.injected = self.kind
        logger.warning(f"Injecting error type {self._NAMES[self.kind]}")
        return True

    def maybe_miscompare(self, initial, result, state):
        """The comparison a rerun sees: the real one, or the injected kind's verdict (a
        transient error differs in place; a persistent one matches in place and differs on
        the other GPU; a correct result matches both times)."""
        if self.injected is None:
            return compare_floats(initial, result)
        if state == State.RERUNNING_IN_PLACE:
            if self.injected == "transient_error":
                self.injected = None
                return MISMATCH
            return MATCH
        assert state == State.RERUNNING_FROM_CHECKPOINT, state
        assert self.injected in ("persistent_error", "correct_result"), self.injected
        verdict = MISMATCH if self.injected == "persistent_error" else MATCH
        self.injected = None
        return verdict

    def state_dict(self):
        return {"rate": self.rate, "kind": self.kind, "injected": self.injected}

    def load_state_dict(self, saved):
        self.rate, self.kind, self.injected = saved["rate"], saved["kind"], saved["injected"]
