"""The global batch size of every iteration: constant (``--global-batch-size``) or stepped
by the samples consumed so far (``--step-batch-size-schedule``, Megatron-LM's grammar).

A schedule is ``THRESHOLD:BATCH_SIZE`` pairs separated by spaces or commas, e.g.
``"0:384 200B:768 400B:1152"``. Both numbers may carry a suffix K (1e3), M (1e6), B (1e9) or
T (1e12) and a fraction (``1.5B``); the value is truncated to an integer after scaling.
Thresholds count training TOKENS, which become samples by floor division by the sequence
length (Megatron-LM always passes ``--seq-length``). An iteration that starts with ``c``
samples consumed uses the batch size of the largest threshold ``<= c``; the number of
microbatches is that size / (micro batch x DP).

Megatron-LM's rules: the first threshold is 0, thresholds (in samples) strictly increase,
batch sizes are positive, and the number of microbatches must never fall during training;
each batch size in use must be divisible by micro batch x DP (a run resumed on more ranks
may have passed the entries that are not).
"""
import bisect

FLAG = "--step-batch-size-schedule"
SIZE_NAME = f"the {FLAG} batch size"
_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
_EXAMPLE = "like '0:384 200B:768' (THRESHOLD:BATCH_SIZE, thresholds in tokens)"


def _count(text, entry):
    """A schedule number: a decimal with an optional K/M/B/T suffix, truncated to an int."""
    value = text.strip().upper()
    scale = _SUFFIXES.get(value[-1:], 1)
    if scale != 1:
        value = value[:-1]
    try:
        return int(float(value) * scale)
    except ValueError:
        raise ValueError(f"{FLAG} entry {entry!r}: {text!r} is not a number (digits with an "
                         f"optional K, M, B or T suffix); write the schedule {_EXAMPLE}") from None


def parse_schedule(text, seq_length):
    """``[(threshold in samples, global batch size), ...]`` sorted by threshold, from the
    schedule string ``text`` whose thresholds are tokens of ``seq_length`` tokens per sample;
    ValueError, naming the entry and the fix, when it breaks a rule of the module doc."""
    entries = text.strip().replace(",", " ").split()
    if not entries:
        raise ValueError(f"{FLAG} is empty; write the schedule {_EXAMPLE}")
    steps = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f"{FLAG} entry {entry!r} is not THRESHOLD:BATCH_SIZE; write the "
                             f"schedule {_EXAMPLE}")
        threshold, batch_size = entry.split(":", 1)
        steps.append((_count(threshold, entry) // seq_length, _count(batch_size, entry), entry))
    steps.sort(key=lambda step: step[0])
    if steps[0][0] != 0:
        raise ValueError(f"{FLAG}: the first threshold must be 0 (the batch size the run starts "
                         f"with), got {steps[0][2]!r}; add an entry 0:BATCH_SIZE")
    for (before, _, a), (after, _, b) in zip(steps, steps[1:]):
        if after <= before:
            raise ValueError(f"{FLAG}: entries {a!r} and {b!r} start at the same sample "
                             f"({before}, thresholds are tokens / --seq-length {seq_length}); "
                             f"give each entry its own threshold")
    for (_, small, a), (_, large, b) in zip(steps, steps[1:]):
        if large < small:
            raise ValueError(f"{FLAG}: the batch size falls from {a!r} to {b!r}, and the number "
                             f"of microbatches must never decrease during training; keep the "
                             f"batch sizes non-decreasing")
    bad = [entry for _, size, entry in steps if size <= 0]
    if bad:
        raise ValueError(f"{FLAG}: batch sizes must be positive, got {', '.join(bad)}")
    return [(threshold, size) for threshold, size, _ in steps]


class BatchSchedule:
    """The global batch size and microbatch count at any number of consumed samples.

    ``steps``: ``[(threshold in samples, global batch size), ...]`` sorted, the first at 0
    (one entry: a constant batch size). ``micro_batch_size`` x ``data_parallel_size`` samples
    make one microbatch on every DP rank.
    """

    def __init__(self, steps, micro_batch_size, data_parallel_size):
        self.thresholds = [int(threshold) for threshold, _ in steps]
        self.sizes = [int(size) for _, size in steps]
        assert self.thresholds and self.thresholds[0] == 0, steps
        self.micro_batch_size, self.data_parallel_size = micro_batch_size, data_parallel_size
        self.stepped = len(self.sizes) > 1

    @classmethod
    def from_config(cls, training, parallel):
        """The schedule of a run's training section ``training``
        (:class:`~megatron_cp.config.training.TrainingConfig`): with
        --step-batch-size-schedule, its steps (which the command line's checks parse into
        ``training.batch_size_schedule``), else the constant --global-batch-size; over the
        data-parallel size of its parallel section ``parallel``
        (:class:`~megatron_cp.config.parallel.ParallelConfig`)."""
        steps = [(0, training.global_batch_size)] if training.step_batch_size_schedule is None \
            else training.batch_size_schedule
        return cls(steps, training.micro_batch_size, parallel.data_parallel_size)

    def global_batch_size(self, consumed_samples):
        """The batch size of the iteration that starts after ``consumed_samples``."""
        return self.sizes[bisect.bisect_right(self.thresholds, consumed_samples) - 1]

    def num_microbatches(self, consumed_samples):
        """Microbatches per DP rank of that iteration; ValueError when its batch size is not
        a positive multiple of micro batch x DP (say, resumed on more ranks than it fits)."""
        size = self.global_batch_size(consumed_samples)
        if self.stepped:
            check_divisible(size, self.micro_batch_size, self.data_parallel_size, SIZE_NAME,
                            f" (in use after {consumed_samples} samples)")
        else:
            check_divisible(size, self.micro_batch_size, self.data_parallel_size)
        return size // (self.micro_batch_size * self.data_parallel_size)

    def samples_after(self, iterations, consumed_samples=0):
        """Samples consumed after ``iterations`` more iterations from ``consumed_samples``."""
        if not self.stepped:
            return consumed_samples + int(iterations) * self.sizes[0]
        for _ in range(int(iterations)):
            consumed_samples += self.global_batch_size(consumed_samples)
        return consumed_samples

    def iterations_for(self, samples):
        """Iterations from the start until at least ``samples`` are consumed (Megatron's
        --train-samples to --train-iters under a schedule; the last batch may overshoot)."""
        iterations, consumed = 0, 0
        while consumed < samples:
            consumed += self.global_batch_size(consumed)
            iterations += 1
        return iterations

    def entries_in(self, num_samples):
        """The batch sizes in use by a run of ``num_samples`` samples from the start."""
        return [size for threshold, size in zip(self.thresholds, self.sizes)
                if threshold < max(num_samples, 1)]

    def describe(self, seq_length):
        """Megatron's schedule table: a line per entry (threshold, batch size, microbatches)."""
        per = self.micro_batch_size * self.data_parallel_size
        lines = [f"step batch size schedule ({len(self.sizes)} steps):"]
        for threshold, size in zip(self.thresholds, self.sizes):
            lines.append(f"  >= {threshold * seq_length:,} tokens ({threshold:,} samples) -> "
                         f"batch_size={size}, num_microbatches={size // per}")
        return "\n".join(lines)


def check_divisible(global_batch_size, micro_batch_size, data_parallel_size,
                    name="--global-batch-size", where=""):
    """A global batch splits into whole microbatches on every DP rank (ValueError if not);
    ``name`` and ``where`` say which batch size it is."""
    per = micro_batch_size * data_parallel_size
    if global_batch_size % per != 0:
        raise ValueError(f"{name} ({global_batch_size}){where} must be divisible by "
                         f"--micro-batch-size ({micro_batch_size}) x data-parallel size "
                         f"({data_parallel_size}); use a multiple of {per}")
