"""Train one of Megatron-LM's flag sets for a few iterations on this machine's CPUs.

``shrink`` turns a set written for a GPU cluster into one a laptop trains in seconds: the widths
(hidden, FFN, expert FFN, head dim, MLA's latent ranks and head dims), the sequence length and
the batch sizes become small, while everything that decides *what* is computed stays as the set
wrote it: layer counts and patterns, head and group counts up to 8, expert counts, top-k,
parallel sizes, precision, schedules, recompute, checkpoint format. ``run`` launches pretrain_gpt.py under torchrun (gloo) with mock
data (a small real corpus for FIM sets: ``with_data``) and a fresh --save/--load/
--tensorboard-dir (and gloo for a set that names NCCL, on a
machine without CUDA), and says whether the iterations ran.

Used by tools/megatron_flag_sets.py (--run) and tests/integration/test_megatron_flag_set_runs.py.
"""
import math
import os
import re
import subprocess
import sys
import time

from megatron_cp.distributed.device import accelerator_available
from megatron_cp.resilience.rerun import (EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                EXIT_CODE_RESUME_TO_DISAMBIGUATE)
from fim_corpus import fim_corpus_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATIONS = 3

# flag -> the small value it takes; only rewritten when the set gives the flag
_WIDTHS = {"--hidden-size": 64, "--ffn-hidden-size": 128, "--kv-channels": 8,
           "--moe-ffn-hidden-size": 32, "--moe-shared-expert-intermediate-size": 32,
           "--seq-length": 128, "--max-position-embeddings": 128,
           # MLA's latent ranks and head dims: at DeepSeek's sizes (1536, 512, 128) one FP8
           # GEMM takes seconds on a CPU, where torch._scaled_mm has no fast kernel
           "--q-lora-rank": 32, "--kv-lora-rank": 32, "--qk-head-dim": 8,
           "--qk-pos-emb-head-dim": 8, "--v-head-dim": 8}
_MAX_HEADS = 8
_MAX_MICROBATCHES = 8


def _value(argv, flag, default=None, kind=int):
    return kind(argv[argv.index(flag) + 1]) if flag in argv else default


def _set(argv, flag, value):
    """``argv`` with ``flag``'s value replaced (or the flag appended)."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = str(value)
    else:
        argv += [flag, str(value)]
    return argv


def _drop(argv, flag, nargs=1):
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        del argv[i:i + 1 + nargs]
    return argv


def parallel_sizes(argv, gpus=None):
    """(tp, cp, pp, world size) the set needs: ``gpus`` when its config names them
    (GPUS_PER_NODE), else 8 ranks (a node, as Megatron-LM's functional tests run) unless its
    model-parallel or expert-parallel sizes need more."""
    tp = _value(argv, "--tensor-model-parallel-size", 1)
    cp = _value(argv, "--context-parallel-size", 1)
    pp = _value(argv, "--pipeline-model-parallel-size", 1)
    ep = _value(argv, "--expert-model-parallel-size", 1)
    etp = _value(argv, "--expert-tensor-parallel-size", tp)
    return tp, cp, pp, gpus or max(8, math.lcm(tp * cp * pp, ep * etp * pp))


def shrink(argv, gpus=None):
    """``argv`` with small widths, sequence and batches, and ITERATIONS iterations."""
    tp, cp, pp, world = parallel_sizes(argv, gpus)
    dp = world // (tp * cp * pp)
    for flag, small in _WIDTHS.items():
        if flag in argv:
            argv = _set(argv, flag, small)
    heads = _value(argv, "--num-attention-heads")
    if heads and heads > _MAX_HEADS:
        argv = _set(argv, "--num-attention-heads", _MAX_HEADS)
    if "--seq-length" in argv and "--max-position-embeddings" not in argv:
        argv = _set(argv, "--max-position-embeddings", _WIDTHS["--seq-length"])
    micro = _value(argv, "--micro-batch-size", 1)
    schedule = _value(argv, "--step-batch-size-schedule", kind=str)
    if schedule is None:
        batch = _small_batch(_value(argv, "--global-batch-size", micro * dp), micro, dp, pp)
        argv = _set(argv, "--global-batch-size", batch)
    else:  # the schedule gives the batch size: shrink each of its steps, keep its thresholds
        steps = [entry.split(":") for entry in schedule.split()]
        small = [f"{at}:{_small_batch(int(size), micro, dp, pp)}" for at, size in steps]
        argv = _set(argv, "--step-batch-size-schedule", " ".join(small))
        batch = _small_batch(int(steps[0][1]), micro, dp, pp)
    if "--eval-global-batch-size" in argv:
        small = _small_batch(_value(argv, "--eval-global-batch-size"), micro, dp, pp)
        argv = _set(argv, "--eval-global-batch-size", small)
    argv = _set(argv, "--micro-batch-size", 1)
    if "--train-samples" in argv:  # a sample-based schedule stays sample-based
        argv = _set(argv, "--train-samples", ITERATIONS * batch)
        for flag, steps in (("--lr-warmup-samples", 1), ("--lr-decay-samples", 1000)):
            if _value(argv, flag, 0):
                argv = _set(argv, flag, steps * batch)
        argv = _drop(argv, "--train-iters")
    else:
        argv = _set(argv, "--train-iters", ITERATIONS)
    if _value(argv, "--eval-iters", 0):
        argv = _set(argv, "--eval-iters", 1)
    return _set(argv, "--log-interval", 1)


def _small_batch(global_batch, micro, dp, pp):
    """The shrunk global batch: one sample per microbatch, as many microbatches per step as
    the set had (at most 8, kept a multiple of PP when it was one)."""
    microbatches = max(1, global_batch // (micro * dp))
    if microbatches > _MAX_MICROBATCHES:
        microbatches = max(pp, _MAX_MICROBATCHES // pp * pp) if microbatches % pp == 0 \
            else _MAX_MICROBATCHES
    return microbatches * dp


def on_this_machine(argv):
    """``argv`` with the one device-bound value a CPU cannot take: NCCL (GPU-to-GPU
    transport) becomes gloo, which carries the same collectives between CPU processes."""
    if _value(argv, "--distributed-backend", kind=str) == "nccl" and not accelerator_available():
        argv = _set(argv, "--distributed-backend", "gloo")
    return argv


def path_flags(workdir):
    """The paths a set gets in place of the dropped ones: a fresh --save/--load and
    --tensorboard-dir under ``workdir``."""
    return ["--save", os.path.join(workdir, "checkpoints"),
            "--load", os.path.join(workdir, "checkpoints"),
            "--tensorboard-dir", os.path.join(workdir, "tensorboard")]


def with_data(argv, workdir):
    """``argv`` with the data it can train on: a set with --fim-data (which rewrites real
    text, and which Megatron-LM refuses on mock data) gets a small corpus and a GPT-2
    vocabulary with the FIM tokens, built under ``workdir`` (tools/fim_corpus.py), in place of
    the mock data; other sets keep the mock data."""
    if "--fim-data" not in argv:
        return argv
    argv = _drop(_drop(_drop(argv, "--mock-data", 0), "--tokenizer-type"), "--vocab-size")
    return argv + fim_corpus_flags(os.path.join(workdir, "fim_corpus"))


LAUNCHERS = {  # how the ranks start: torchrun as users run it, or tools/fork_launch.py
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
    "fork": [sys.executable, os.path.join(REPO, "tools", "fork_launch.py")]}


def command(argv, workdir, gpus=None, launcher="torchrun"):
    """The command line that trains shrunk ``argv`` on ``gpus`` ranks (None: as
    :func:`parallel_sizes` says), writing under ``workdir``, started by ``launcher``
    (LAUNCHERS: the ranks run the same script with the same flags either way)."""
    world = parallel_sizes(argv, gpus)[3]
    paths = path_flags(workdir)
    return [*LAUNCHERS[launcher], "--nproc-per-node", str(world),
            os.path.join(REPO, "pretrain_gpt.py"),
            *on_this_machine(shrink(with_data(argv, workdir), gpus)), *paths]


def run(argv, workdir, timeout=900, gpus=None, launcher="torchrun"):
    """Train the set; ``{"ok", "stopped_as_written", "seconds", "iterations", "losses",
    "status", "tail"}`` (``losses``: the lm loss logged at each iteration; ``tail``: the last
    lines of the output, where a failure says why; ``stopped_as_written``: see
    :func:`stops_as_written`)."""
    os.makedirs(workdir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    start = time.time()
    try:
        done = subprocess.run(command(argv, workdir, gpus, launcher), cwd=workdir, env=env,
                              timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        out, status = done.stdout, done.returncode
    except subprocess.TimeoutExpired as expired:
        out, status = (expired.stdout or b"").decode(errors="replace") + "\n(timed out)", -1
    steps = dict(re.findall(r"\] iteration +(\d+)/.*?\| lm loss: ([-+.0-9eEnaif]+) \|", out))
    losses = [float(steps[k]) for k in sorted(steps, key=int)]
    ok = status == 0 and len(losses) >= _expected(argv) and all(map(math.isfinite, losses))
    return {"ok": ok, "stopped_as_written": not ok and stops_as_written(argv, status, out),
            "seconds": round(time.time() - start, 1), "iterations": len(losses),
            "losses": losses, "status": status, "tail": out.strip().splitlines()[-12:]}


def stops_as_written(argv, status, out):
    """Whether a set that did not train its iterations stopped the way its authors wrote it
    to. The sets injecting errors (``--rerun-mode validate_results``, Megatron-LM's
    gpt3_mcore_reruns_* tests) inject one at random (one in --error-injection-rate
    validations per rank), so each trains its iterations or stops as its test checks:

    - a persistent error (``persistent_error``) comes back on the in-place rerun: a checkpoint
      is saved and the job exits with status 16, to rerun the step on another GPU;
    - a transient one (``transient_error``) does not: "Possible transient error!" and exit
      status 17 (resume from the last checkpoint), as its test's log check expects."""
    if _value(argv, "--rerun-mode", kind=str) != "validate_results":
        return False
    kind = _value(argv, "--error-injection-type", kind=str)
    if kind == "persistent_error":
        return (status == EXIT_CODE_RESUME_TO_DISAMBIGUATE
                and "Injecting error type Persistent error" in out
                and "checkpoint was saved" in out)
    if kind == "transient_error":
        return (status == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
                and "Injecting error type Transient error" in out
                and "Possible transient error!" in out)
    return False


def _expected(argv):
    """Iterations the shrunk set logs (fewer when it asks to exit earlier)."""
    exit_interval = _value(argv, "--exit-interval")
    return min(ITERATIONS, exit_interval) if exit_interval else ITERATIONS
