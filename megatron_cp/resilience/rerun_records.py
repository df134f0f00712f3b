"""What the rerun state machine (:mod:`megatron_cp.resilience.rerun`) writes down: the result-rejected
tracker file and the variability statistics of ``--rerun-mode report_stats``.

* The tracker file (``--result-rejected-tracker-filename``) gets one line per rejected
  result and per rerun verdict, in Megatron-LM's format
  (``ts=... node=... device=... jobID=... rank=... iteration=... status=... result=...
  message='...'``), appended by every rank that saw it. Read back at start-up,
  :func:`iterations_to_skip` turns it into iterations to skip (``--iterations-to-skip``):
  an iteration whose result was rejected twice on one rank, reruns disabled or the rerun
  reproducing it, unless it failed on several ranks of one job (then the fault is not in
  one rank's data).
* :class:`QuickStats` keeps the relative differences between a result and its rerun's.
"""
import datetime
import logging
import os
import re

logger = logging.getLogger("megatron_cp.resilience.rerun")

# A record's status: the outcome that line reports (Megatron-LM's values).
RERUN_DISABLED = "rerun_disabled"
INITIAL_RUN = "initial_run"
FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"

# The statuses that mark a result as coming from the data or the model, not a fault.
_REPEATED = (RERUN_DISABLED, FIRST_RERUN_REPRODUCIBLE, SECOND_RERUN_REPRODUCIBLE)
_RECORD = re.compile(r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) "
                     r"status=(.+) result=.+ message=.+")


def check_appendable(path):
    """``--result-rejected-tracker-filename``: a file this process can append to, or can
    create (checked without creating it)."""
    existing = os.path.abspath(path)
    if os.path.isdir(existing):
        raise ValueError(f"--result-rejected-tracker-filename {path} is a directory; give a "
                         f"file name")
    if os.path.exists(existing):
        if not os.access(existing, os.W_OK):
            raise ValueError(f"--result-rejected-tracker-filename {path} cannot be appended "
                             f"to (not writable); give a file you can write")
        return
    folder = os.path.dirname(existing)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--result-rejected-tracker-filename {path}: cannot create it in "
                         f"{folder} (missing or not writable); give a file in a directory "
                         f"you can write")


def append_record(path, *, node, device, rank, iteration, status, result, message):
    """Append one record (``iteration`` 1-based) to the tracker file; a failure to write is
    logged, never fatal (the verdict matters more than its record)."""
    line = (f"ts={datetime.datetime.now()} node={node} device={device} "
            f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={rank} iteration={iteration} "
            f"status={status} result={result} message='{message}'\n")
    try:
        with open(path, "a") as file:
            file.write(line)
    except OSError as error:
        logger.error(f"Could not log validation error! ({error})")


def iterations_to_skip(path):
    """``(to skip, kept)``: the iterations (1-based, sorted) the tracker file at ``path``
    marks for skipping (a rank saw the same iteration rejected twice with a repeated
    status), and those it keeps although marked, because one job rejected them on more than
    one rank. A missing file gives ``([], [])``."""
    seen, candidates, by_job = set(), set(), {}
    if not os.path.exists(path):
        return [], []
    with open(path) as file:
        for line in file:
            match = _RECORD.search(line)
            if not match:
                continue
            job, rank, iteration = match[1], int(match[2]), int(match[3])
            status = match[4].split(".")[-1].lower()  # "RerunValidationStatus.X" in newer Pythons
            if status not in _REPEATED:
                continue
            if (rank, iteration) in seen:
                candidates.add(iteration)
            seen.add((rank, iteration))
            by_job.setdefault((job, iteration), set()).add(rank)
    several = {it for (_, it), ranks in by_job.items() if len(ranks) > 1}
    return sorted(candidates - several), sorted(several)


class QuickStats:
    """The distribution of one statistic: the relative differences of a validated result
    between a run and its rerun (zeros counted apart, up to ``max_size`` others kept)."""

    def __init__(self, max_size=100000):
        self.samples, self.pos, self.zero_cnt, self.max = [], 0, 0, 0.0
        self.max_size = max_size

    def record(self, value):
        if value == 0.0:
            self.zero_cnt += 1
            return
        if self.pos < self.max_size:
            self.samples.append(value)
        else:
            self.samples[self.pos % self.max_size] = value
        self.pos += 1
        self.max = max(self.max, value)

    def combine(self, others):
        """Add the samples of ``others`` (other ranks' stats of the same result)."""
        if not others:
            return
        total = len(self.samples) + sum(len(o.samples) for o in others)
        if total <= self.max_size:
            for other in others:
                self.samples.extend(other.samples)
            self.pos = total
        self.zero_cnt += sum(o.zero_cnt for o in others)
        self.max = max(self.max, *(o.max for o in others))

    def reset(self):
        self.samples, self.pos, self.zero_cnt, self.max = [], 0, 0, 0.0

    def summary(self):
        """One line: counts, mean and percentiles of the relative variability (Megatron's)."""
        self.samples.sort()
        zeros, n = self.zero_cnt, len(self.samples)
        if n == 0:
            return f"{zeros:,} samples, all identical"
        total = zeros + n
        mean = sum(self.samples) / total

        def percentile(p):
            index = int(total * p) - zeros
            return f"{self.samples[index]:.3E}" if index >= 0 else "0.0"

        return (f"{total:,}/{zeros:,} total/identical samples, rel. variability: "
                f"avg= {mean:.3E}, p50= {percentile(0.5)}, p90= {percentile(0.9)}, "
                f"p99= {percentile(0.99)}, p99.9= {percentile(0.999)}, max: {self.max:.3E}")
