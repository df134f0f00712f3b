"""Faults, each ending in one clear line and a way to recover (the table of docs/faults.md):
a rank killed mid-training (the others exit at once; --load resumes exactly), a peer that
stops answering (--distributed-timeout-minutes), a corrupted or truncated checkpoint or
dataset file, a NaN/inf loss or gradient norm, and an fp16 overflow (a skipped step).

Run as a script, this file is one rank of a killed-rank job (see :func:`_launched_rank`).
"""
import contextlib
import io
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from dist_harness import run_workers
from training_utils import TINY, parallel_state, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a traceback frame in this repository's code (not in a .venv that lives inside it)
OUR_FRAME = r'File "' + re.escape(ROOT) + r'/(?!\.venv/)'
THIS = os.path.abspath(__file__)
BASE = f"{TINY} --train-iters 8 --lr-decay-iters 8"
BOUND_SECONDS = 60  # a fault must end every rank well within this


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    # ROOT for the package, tests/ for the harness this file imports when run as a rank
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    return dict(env, **extra)


def _error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


# ----- a rank killed with SIGKILL ----------------------------------------------------------

def _launched_rank(argv):
    """``python tests/resilience/test_faults.py VICTIM ITERATION <pretrain flags>`` under torchrun or with
    RANK/WORLD_SIZE set: global rank VICTIM kills itself with SIGKILL as it starts
    iteration ITERATION; the others run ``pretrain_gpt.py``'s main unchanged."""
    from megatron_cp import training
    victim, at = int(argv[0]), int(argv[1])
    real_step = training.Trainer.train_step

    def train_step(self):
        if self.state.global_rank == victim and self.iteration + 1 == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(self)

    training.Trainer.train_step = train_step
    return training.main(argv[2:])


def _wait(procs, timeout):
    deadline = time.time() + timeout
    exited = {}
    while len(exited) < len(procs) and time.time() < deadline:
        for i, proc in enumerate(procs):
            if i not in exited and proc.poll() is not None:
                exited[i] = time.time()
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    return exited


def test_killed_rank_others_exit_with_one_line_and_load_resumes_exactly(tmp_path):
    """Two ranks started like srun does (RANK, WORLD_SIZE, MASTER_*); rank 1 is SIGKILLed as
    iteration 6 starts. Rank 0 prints one line naming itself, the iteration and the
    checkpoint, and exits 1 at once; --load then gives the losses of an uninterrupted run."""
    straight = run_workers(train_losses, 2, BASE)[0]
    flags = f"{BASE} --save {tmp_path} --save-interval 4 --log-interval 1".split()
    port = str(_free_port())
    logs = [(tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err") for r in range(2)]
    procs = []
    for r, (out, err) in enumerate(logs):
        with open(out, "w") as stdout, open(err, "w") as stderr:
            procs.append(subprocess.Popen(
                [sys.executable, THIS, "1", "6", *flags], cwd=ROOT, stdout=stdout, stderr=stderr,
                env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))
    exited = _wait(procs, timeout=120)
    outs = [(out.read_text(), err.read_text()) for out, err in logs]
    assert sorted(exited) == [0, 1], outs
    assert procs[1].returncode == -signal.SIGKILL, outs[1]
    assert procs[0].returncode == 1, outs[0]
    assert exited[0] - exited[1] < BOUND_SECONDS
    stdout, stderr = outs[0]
    assert "iteration        5/" in stdout and "iteration        6/" not in stdout
    assert _error_lines(stderr) == [
        f"error: rank 0: lost contact with another rank during iteration 6 (the connection to "
        f"it was closed: a process died or the network failed); re-run with --load {tmp_path} "
        f"to continue from the last checkpoint (iteration 4)"], stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout
    resumed = run_workers(train_losses, 2, f"{BASE} --load {tmp_path}")[0]
    assert resumed == straight[4:]  # exact equality, as an uninterrupted run


def test_killed_rank_under_torchrun_ends_the_job_in_bounded_time(tmp_path):
    """torchrun, rank 0 (which prints) killed: the survivor either prints its own line after
    the grace period or is ended by torchrun first; either way the job ends, non-zero,
    with no traceback from our code, well within the bound."""
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", THIS, "0", "3",
                           *f"{BASE} --save {tmp_path} --save-interval 2".split()],
                          cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode != 0
    assert time.time() - started < BOUND_SECONDS, proc.stdout
    assert not re.search(OUR_FRAME, proc.stdout), proc.stdout  # no worker traceback
    assert re.search(r"Signal 9 \(SIGKILL\)|exitcode\s*: -9", proc.stdout), proc.stdout
    for line in _error_lines(proc.stdout):  # at most the survivor's own line
        assert line.startswith("error: rank 1: lost contact with another rank during iteration 3")


# ----- a peer that stops answering -----------------------------------------------------------

def _hung_peer(rank, world, argv):
    """Rank 1 stops answering (a hung process, a partitioned network) as iteration 3 starts,
    for longer than the collective timeout; returns what pretrain raised here, and when."""
    import torch
    from megatron_cp.resilience import faults
    from megatron_cp import training
    from megatron_cp.cli.arguments import parse_args
    args = parse_args(argv.split(), world_size=world)
    args.distributed_timeout_minutes = 0.04  # 2.4 s (the flag takes whole minutes)
    real_step = training.Trainer.train_step

    def train_step(self):
        if rank == 1 and self.iteration + 1 == 3:
            time.sleep(4)
        return real_step(self)

    training.Trainer.train_step = train_step
    started = time.time()
    try:
        training.pretrain(args, parallel_state(args))
    except faults.LostContactError as error:
        return str(error), time.time() - started
    return None, time.time() - started


def test_peer_that_stops_answering_is_lost_contact_after_the_timeout():
    (message, _), (late, _) = run_workers(_hung_peer, 2, BASE)
    assert message == ("rank 0: lost contact with another rank during iteration 3 (no answer "
                       "within --distributed-timeout-minutes 0.04: a process died or the network "
                       "failed); nothing was saved (no --save): re-run, with --save DIR "
                       "--save-interval N to keep checkpoints")
    # the hung rank, once it wakes up, finds rank 0 gone and says so too
    assert late.startswith("rank 1: lost contact with another rank during iteration 3")


# ----- NaN / inf in the loss or the gradients ------------------------------------------------

def _main_with_bad_value(rank, world, argv, kind, victim, at):
    """Run ``training.main`` with a NaN in rank ``victim``'s loss (``kind`` "loss") or an
    inf in the gradient of its loss ("grad") at iteration ``at``; returns (status, stderr)."""
    import torch
    from megatron_cp import training
    from megatron_cp.training import trainer as trainer_module
    from megatron_cp.cli import check_args
    check_args.OTHER_RANK_GRACE_SECONDS = 0.0  # no launcher here to end the other ranks
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # what main parses for
    current = {}
    real_step, real_forward = training.Trainer.train_step, trainer_module.forward_step

    def train_step(self):
        current["iteration"] = self.iteration + 1
        return real_step(self)

    def forward_step(model, batch):
        out = real_forward(model, batch)
        if rank == victim and current["iteration"] == at:
            if kind == "loss":
                return out * float("nan")
            out.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        return out

    training.Trainer.train_step, trainer_module.forward_step = train_step, forward_step
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = training.main(argv.split())
    return status, err.getvalue()


FIX = ("stopped before the update, so the last checkpoint holds finite weights: resume from "
       "it with --load <save dir>, with a lower --lr or a longer --lr-warmup-iters, or pass "
       "--no-check-for-nan-in-loss-and-grad to train on regardless")


# With reruns disabled the loop's own checks stop on a NaN at once; under Megatron's default
# --rerun-mode validate_results the step is rerun first (tests/resilience/test_rerun.py).
NO_RERUN = f"{BASE} --rerun-mode disabled"


def test_nan_loss_stops_every_rank_naming_the_iteration_and_rank():
    (status0, err0), (status1, err1) = run_workers(_main_with_bad_value, 2, NO_RERUN, "loss",
                                                   1, 3)
    assert status0 == status1 == 1
    assert _error_lines(err0) == [f"error: rank 0: the loss is nan at iteration 3 (not finite "
                                  f"on rank 1); {FIX}"], err0
    assert _error_lines(err1) == [f"error: rank 1: the loss is nan at iteration 3 (not finite "
                                  f"on rank 1); {FIX}"], err1
    assert "Traceback" not in err0 + err1


@pytest.mark.parametrize("optimizer", ["", "--use-distributed-optimizer"])
def test_inf_gradient_stops_every_rank_naming_the_iteration(optimizer):
    (status0, err0), (status1, _) = run_workers(_main_with_bad_value, 2,
                                                f"{NO_RERUN} {optimizer}", "grad", 1, 2)
    assert status0 == status1 == 1
    # the data-parallel reduction carried rank 1's inf into rank 0's gradients too
    lines = _error_lines(err0)
    assert len(lines) == 1 and re.fullmatch(
        r"error: rank 0: the gradient norm is (nan|inf) at iteration 2 \(not finite on ranks "
        r"0, 1\); " + re.escape(FIX), lines[0]), err0


def _losses_with_nan_at(rank, world, argv, at):
    from megatron_cp import training
    from megatron_cp.training import trainer as trainer_module
    current = {}
    real_step, real_forward = training.Trainer.train_step, trainer_module.forward_step

    def train_step(self):
        current["iteration"] = self.iteration + 1
        return real_step(self)

    def forward_step(model, batch):
        out = real_forward(model, batch)
        return out * float("nan") if current["iteration"] == at else out

    training.Trainer.train_step, trainer_module.forward_step = train_step, forward_step
    with contextlib.redirect_stdout(io.StringIO()):
        return train_losses(rank, world, argv)


def test_no_check_for_nan_trains_on():
    losses = run_workers(_losses_with_nan_at, 1, f"{TINY} --train-iters 4 "
                         f"--no-check-for-nan-in-loss-and-grad", 2)[0]
    assert len(losses) == 4 and not np.isnan(losses[0]) and np.isnan(losses[1])


def _skipped_iterations(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train_losses(rank, world, argv)
    return losses, [int(n) for n in re.findall(r"number of skipped iterations:\s+(\d+)",
                                               out.getvalue())]


def test_fp16_overflow_is_a_skipped_step_not_an_error():
    argv = (f"{TINY} --train-iters 4 --log-interval 1 --fp16 --initial-loss-scale 1e12 "
            f"--hysteresis 1")
    losses, skipped = run_workers(_skipped_iterations, 1, argv)[0]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert sum(skipped) >= 1  # the dynamic loss scale overflowed, backed off, and went on


# ----- corrupted or truncated checkpoint files -----------------------------------------------

def _save_both_formats(rank, world, root):
    for fmt in ("torch", "torch_dist"):
        with contextlib.redirect_stdout(io.StringIO()):
            train_losses(rank, world, f"{TINY} --train-iters 4 --save-interval 2 "
                                      f"--save {root}/{fmt} --ckpt-format {fmt}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A torch and a torch_dist checkpoint (iterations 2 and 4) of a 2-rank run."""
    root = tmp_path_factory.mktemp("saved")
    run_workers(_save_both_formats, 2, str(root))
    return root


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _garble(path):
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())


def _write(text):
    def damage(path):
        with open(path, "w") as f:
            f.write(text)
    return damage


DIST = "iter_0000004/__0_0.distcp"
CASES = {  # name: (format, file under the checkpoint, damage, message)
    "model truncated": ("torch", "iter_0000004/mp_rank_00/model_optim_rng.pt", _truncate,
                        "checkpoint file {f} cannot be read, it is truncated or corrupted"),
    "model garbled": ("torch", "iter_0000004/mp_rank_00/model_optim_rng.pt", _garble,
                      "checkpoint file {f} cannot be read, it is truncated or corrupted"),
    "tracker garbled": ("torch", "latest_checkpointed_iteration.txt", _write("4\x00\x17"),
                        "checkpoint tracker {f} holds '4\\x00\\x17', not an iteration number"),
    "tracker empty": ("torch", "latest_checkpointed_iteration.txt", _write(""),
                      "checkpoint tracker {f} holds '', not an iteration number"),
    "tracker missing iteration": ("torch", "latest_checkpointed_iteration.txt", _write("7"),
                                  "checkpoint tracker {f} names iteration 7 but"),
    "index truncated": ("torch_dist", "iter_0000004/.metadata", _truncate,
                        "checkpoint index {f} cannot be read, it is truncated or corrupted"),
    "shard truncated": ("torch_dist", DIST, _truncate, "checkpoint file {f} is "),
    "shard garbled": ("torch_dist", DIST, _garble,
                      "checkpoint file {f} is damaged (its bytes do not decode: "),
    "common truncated": ("torch_dist", "iter_0000004/common.pt", _truncate,
                         "checkpoint file {f} cannot be read, it is truncated or corrupted"),
}


def _load_errors(rank, world, roots):
    """Load each checkpoint under ``roots`` into a fresh trainer; returns {root: message}."""
    import torch
    from megatron_cp import training
    from megatron_cp.cli.arguments import parse_args
    messages, state = {}, None
    for root in roots:
        args = parse_args(f"{TINY} --train-iters 4 --load {root}".split(), world_size=world)
        state = state or parallel_state(args)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                trainer = training.Trainer(args, state)
                trainer.checkpointer.load(trainer.train_state(), root)
            messages[root] = None
        except ValueError as error:
            messages[root] = str(error)
    return messages


def test_damaged_checkpoint_files_are_named(saved, tmp_path):
    roots = {}
    for name, (fmt, relative, damage, _) in CASES.items():
        root = tmp_path / name.replace(" ", "_")
        shutil.copytree(saved / fmt, root)
        damage(root / relative)
        roots[name] = str(root)
    messages = run_workers(_load_errors, 1, list(roots.values()))[0]
    for name, (_, relative, _, expected) in CASES.items():
        message, root = messages[roots[name]], roots[name]
        assert message is not None and message.startswith(expected.format(
            f=os.path.join(root, relative), d=root)), (name, message)
        good = 4 if relative.endswith(".txt") else 2  # a bad tracker: iteration 4 is whole
        assert message.endswith(f"; iteration {good} is the latest good one: load it with "
                                f"--ckpt-step {good} (or restore the file from a copy)"), message
        assert "\n" not in message and "Traceback" not in message, (name, message)


def _main_quietly(rank, world, argv):
    from megatron_cp import training
    from megatron_cp.cli import check_args
    check_args.OTHER_RANK_GRACE_SECONDS = 0.0
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = training.main(argv.split())
    return status, err.getvalue()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_one_rank_damaged_file_is_one_line_from_rank_0(saved, tmp_path, fmt):
    """Only rank 1's RNG file is damaged: rank 0 loads fine, yet prints rank 1's error (the
    RNG files are read only in the saving layout, so this runs on its 2 ranks)."""
    shutil.copytree(saved / fmt, tmp_path / "ck")
    bad = tmp_path / "ck" / "iter_0000004" / "rng" / "rank_00001.pt"
    _truncate(bad)
    (status0, err0), (status1, _) = run_workers(
        _main_quietly, 2, f"{TINY} --train-iters 4 --load {tmp_path / 'ck'}")
    assert status0 == status1 == 2
    lines = _error_lines(err0)
    assert len(lines) == 1 and lines[0].startswith(
        f"error: rank 1: checkpoint file {bad} cannot be read, it is truncated or corrupted"), err0
    assert "Traceback" not in err0


# ----- corrupted or truncated .bin / .idx ----------------------------------------------------

def _dataset(tmp_path):
    from megatron_cp.data.indexed_dataset import IndexedDatasetBuilder
    os.makedirs(tmp_path, exist_ok=True)
    prefix = str(tmp_path / "corpus")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(40):
        builder.add_document(rng.integers(1, 199, int(rng.integers(20, 120))))
    builder.finalize(prefix + ".idx")
    return prefix


def _patched(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_damaged_index_or_tokens_are_named(tmp_path):
    from megatron_cp.data.indexed_dataset import IndexedDataset
    header = 9 + 8 + 1 + 8 + 8
    count = 40
    cases = {
        "magic": (".idx", lambda p: _patched(p, 0, b"XXXX"), "has magic b'XXXXIDX"),
        "version": (".idx", lambda p: _patched(p, 9, struct.pack("<Q", 3)), "index version 3"),
        "dtype": (".idx", lambda p: _patched(p, 17, b"\x63"), "dtype code 99"),
        "idx truncated": (".idx", _truncate, "bytes but its header describes"),
        "bin truncated": (".bin", _truncate, "the .bin file is truncated"),
        "pointer": (".idx", lambda p: _patched(p, header + count * 4 + 8 * 7,
                                               struct.pack("<q", 10 ** 9)), "points up to byte"),
        "documents": (".idx", lambda p: _patched(p, header + count * 12 + 8 * 3,
                                                 struct.pack("<q", 0)), "document index"),
    }
    for name, (suffix, damage, expected) in cases.items():
        prefix = _dataset(tmp_path / name.replace(" ", "_"))
        damage(prefix + suffix)
        with pytest.raises(ValueError) as info:
            IndexedDataset(prefix)
        message = str(info.value)
        assert expected in message and prefix + suffix in message, (name, message)
        assert "rebuild the pair with tools/preprocess_data.py" in message


def test_truncated_bin_is_one_error_line_before_and_after_launch(tmp_path):
    prefix = _dataset(tmp_path)
    _truncate(prefix + ".bin")
    argv = TINY.replace("--mock-data", f"--data-path {prefix} --tokenizer-type NullTokenizer")
    status, err = run_workers(_main_quietly, 1, f"{argv} --train-iters 4")[0]
    assert status == 2
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"error: {prefix}.bin is ") and \
        "the .bin file is truncated" in lines[0], err
    # the launch scripts' check before torchrun says the same
    from megatron_cp.cli import check_args
    before = io.StringIO()
    with contextlib.redirect_stderr(before):
        assert check_args.main(["--world-size", "2", *argv.split(), "--train-iters", "4"]) == 2
    assert _error_lines(before.getvalue()) == lines


if __name__ == "__main__":
    sys.exit(_launched_rank(sys.argv[1:]))
