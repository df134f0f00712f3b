"""Checkpoint faults end in one line and lose nothing (megatron_cp/checkpoint/faults.py): a
disk that fills up during a save, in both formats and with --async-save; damaged files named
by the load; --ckpt-step to load the iteration those messages point at.

The full disk is real when this machine allows it: the two ranks run inside a private mount
namespace (``unshare -mr``, which needs no privilege where user namespaces are enabled) on a
tmpfs sized to hold one checkpoint and a half, so the second save runs out of space in the
kernel's own write path. Where that is refused (a CI container without user namespaces),
the ranks run this file as a script instead (:func:`_fake_full_disk`): every write under the
checkpoint folder fails with ENOSPC once the folder holds as many bytes, as a full disk
would, through the same open/write calls. The test reports which one ran.

Run as a script, this file is one rank of that fallback: ``python tests/checkpoint/test_checkpoint_faults.py
FOLDER BYTES <pretrain flags>``.
"""
import contextlib
import errno
import functools
import io
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

from dist_harness import run_workers
from training_utils import TINY, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS = os.path.abspath(__file__)
BASE = f"{TINY} --train-iters 4 --lr-decay-iters 4"
FORMATS = {"torch": "--ckpt-format torch", "torch_dist": "--ckpt-format torch_dist",
           "async": "--ckpt-format torch_dist --async-save"}
PAGE = 4096


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allocated(folder):
    """Bytes the files under ``folder`` take on disk (whole pages, as tmpfs counts them)."""
    return sum(-(-os.path.getsize(os.path.join(d, n)) // PAGE) * PAGE
               for d, _, names in os.walk(folder) for n in names)


@functools.lru_cache(maxsize=1)
def _real_full_disk():
    """Whether a tmpfs can be mounted here in a private mount namespace (a real full disk)."""
    probe = os.path.join(ROOT, "tests", ".tmpfs_probe")
    os.makedirs(probe, exist_ok=True)
    try:
        return subprocess.run(["unshare", "-mr", "sh", "-c",
                               f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(probe)}"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        os.rmdir(probe)


def _fake_full_disk(folder, budget):
    """Fallback: files opened for writing under ``folder`` raise OSError(ENOSPC) from the
    write that would take the folder past ``budget`` bytes (no file name: the kernel's
    error names none, torch.save's even less)."""
    import builtins
    real_open, folder = io.open, os.path.abspath(folder)

    def used():
        return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(folder) for n in ns)

    class OnFullDisk:
        def __init__(self, file):
            self._file = file

        def write(self, data):
            if used() + len(data) > budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._file.write(data)

        def __getattr__(self, name):
            return getattr(self._file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

    def open_on_disk(file, mode="r", *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        inside = os.path.abspath(os.fspath(file)).startswith(folder + os.sep)
        return OnFullDisk(opened) if inside and any(c in mode for c in "wax+") else opened

    builtins.open = io.open = open_on_disk


def _rank_on_fake_disk(argv):
    """Script body (the fallback): a full disk of ``argv[1]`` bytes at ``argv[0]``, then
    pretrain_gpt.py's main."""
    _fake_full_disk(argv[0], int(argv[1]))
    from megatron_cp.training import main
    return main(argv[2:])


def _two_ranks_on_small_disk(tmp_path, flags, budget):
    """Run ``flags`` as 2 ranks (RANK/WORLD_SIZE, as srun starts them) saving to a disk of
    ``budget`` bytes; returns ([(status, stdout + stderr)] per rank, a copy of what the disk
    holds afterwards)."""
    real = _real_full_disk()
    disk, kept, logs = tmp_path / "disk", tmp_path / "kept", tmp_path / "logs"
    for folder in (disk, kept, logs):
        folder.mkdir()
    argv = f"{flags} --save {disk} --save-interval 2".split()
    command = ([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv] if real else
               [sys.executable, THIS, str(disk), str(budget), *argv])
    lines = [f"mount -t tmpfs -o size={budget} tmpfs {disk} || exit 97"] if real else []
    for rank in range(2):
        lines.append(f"env RANK={rank} LOCAL_RANK={rank} {shlex.join(command)} "
                     f"> {logs}/out{rank} 2>&1 & pid{rank}=$!")
    lines += [f"wait $pid{rank}; echo $? > {logs}/status{rank}" for rank in range(2)]
    lines.append(f"cp -a {disk}/. {kept}/")  # a private tmpfs goes with its namespace
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        env.pop(key, None)
    shell = ["unshare", "-mr", "sh", "-c"] if real else ["sh", "-c"]
    proc = subprocess.run([*shell, "\n".join(lines)], cwd=ROOT, env=env, timeout=240,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"full disk: {'a real tmpfs' if real else 'simulated (no mount namespace here)'} "
          f"of {budget} bytes")
    ranks = [(int((logs / f"status{r}").read_text()), (logs / f"out{r}").read_text())
             for r in range(2)]
    return ranks, kept


def _straight(tmp_path, extra):
    """Losses of 4 uninterrupted iterations, and the bytes one checkpoint takes on disk."""
    ref = tmp_path / "ref"
    with contextlib.redirect_stdout(io.StringIO()):
        losses = run_workers(train_losses, 2, f"{BASE} {extra} --save {ref} --save-interval 2")[0]
    return losses, _allocated(ref / "iter_0000002")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_full_disk_during_a_save_is_one_line_and_loses_nothing(tmp_path, fmt):
    """Saves at iterations 2 and 4 on a disk that holds one and a half checkpoints: the save
    at 4 runs out of space. Exactly one ``error:`` line (rank 0's) naming the file and what
    happened, no traceback, both ranks exit 1, no iter_0000004* left, the tracker still says
    2, and --load resumes from it with the losses of an uninterrupted run."""
    straight, size = _straight(tmp_path, FORMATS[fmt])
    ranks, kept = _two_ranks_on_small_disk(tmp_path, f"{BASE} {FORMATS[fmt]}",
                                           size + size // 2 + PAGE)
    (status0, out0), (status1, out1) = ranks
    errors = [line for line in (out0 + out1).splitlines() if line.startswith("error:")]
    disk = re.escape(str(tmp_path / "disk"))
    assert len(errors) == 1 and errors[0] in out0, out0 + out1
    assert re.fullmatch(
        rf"error: the checkpoint save at iteration 4 under {disk} failed on rank [01]: no space "
        rf"left on device while writing {disk}/iter_0000004\.tmp/\S+; free space there, or give "
        rf"--save another folder\. Its partial files \({disk}/iter_0000004\.tmp\) are removed "
        rf"and the latest checkpoint is still iteration 2: --load {disk} resumes from it",
        errors[0]), errors[0]
    assert "Traceback" not in out0 + out1
    assert status0 == status1 == 1
    assert " saved checkpoint at iteration 2" in out0
    assert sorted(os.listdir(kept)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert (kept / "latest_checkpointed_iteration.txt").read_text() == "2"
    with contextlib.redirect_stdout(io.StringIO()):
        resumed = run_workers(train_losses, 2, f"{BASE} --load {kept}")[0]
    assert resumed == straight[2:]  # exact: the checkpoint of iteration 2 is whole


def _rank_killed_mid_save(argv):
    """Subprocess body: rank 1 dies (SIGKILL) while writing its files of the second save."""
    import signal
    from megatron_cp.checkpoint import pieces
    from megatron_cp.training import main
    real, planners = pieces.PiecesSavePlanner.resolve_data, []

    def dying(self, item):
        if self not in planners:
            planners.append(self)
        if len(planners) == 2 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, item)

    pieces.PiecesSavePlanner.resolve_data = dying
    sys.exit(main(argv))


def test_rank_lost_during_a_save_removes_the_partial_files(tmp_path):
    """Rank 1 dies mid-save: rank 0 says so in one line naming the checkpoint to resume
    from (iteration 2, still the latest), and the partial iter_0000004.tmp is gone."""
    argv = f"{BASE} --ckpt-format torch_dist --save {tmp_path} --save-interval 2".split()
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()),  # the package, the harness, this file:
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.path.dirname(THIS)]))
    code = f"from test_checkpoint_faults import _rank_killed_mid_save as f; f({argv!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    out0 = procs[0].communicate(timeout=120)[0]
    procs[1].communicate(timeout=120)
    assert procs[0].returncode == 1 and procs[1].returncode == -9, out0
    assert [line for line in out0.splitlines() if line.startswith("error:")] == [
        f"error: rank 0: lost contact with another rank during the checkpoint save at "
        f"iteration 4 (the connection to it was closed: a process died or the network "
        f"failed); re-run with --load {tmp_path} to continue from the last checkpoint "
        f"(iteration 2)"], out0
    assert "Traceback" not in out0
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


# ----- damaged files, named; --ckpt-step loads the good iteration they point at ---------------

def _main(rank, world, argv):
    """``training.main(argv)``; returns (status, stdout, stderr)."""
    from megatron_cp import training
    from megatron_cp.cli import check_args
    check_args.OTHER_RANK_GRACE_SECONDS = 0.0
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = training.main(argv.split())
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One-rank checkpoints at iterations 2 and 4 in both formats, and the straight losses."""
    root = tmp_path_factory.mktemp("saved")
    losses = {}
    for fmt in ("torch", "torch_dist"):
        with contextlib.redirect_stdout(io.StringIO()):
            losses[fmt] = run_workers(train_losses, 1, f"{BASE} --ckpt-format {fmt} --save "
                                                       f"{root / fmt} --save-interval 2")[0]
    return root, losses


def _garble(path):
    with open(path, "r+b") as file:  # the index still fits, the tensor bytes do not decode
        size = file.seek(0, os.SEEK_END)
        file.seek(0)
        file.write(bytes((7 * i + 3) % 256 for i in range(size)))


def _truncate(path):
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)


DAMAGE = {  # format: (file of iteration 4, damage, how the line starts)
    "torch_dist": ("__0_0.distcp", _garble, "checkpoint file {f} is damaged (its bytes do not "
                                            "decode: "),
    "torch": ("mp_rank_00/model_optim_rng.pt", _truncate,
              "checkpoint file {f} cannot be read, it is truncated or corrupted ("),
}


@pytest.mark.parametrize("fmt", sorted(DAMAGE))
def test_damaged_file_is_one_line_naming_it_and_ckpt_step_loads_the_good_one(saved, tmp_path,
                                                                              fmt):
    root, losses = saved
    ck = tmp_path / "ck"
    shutil.copytree(root / fmt, ck)
    relative, damage, start = DAMAGE[fmt]
    bad = ck / "iter_0000004" / relative
    damage(bad)
    status, out, err = run_workers(_main, 1, f"{BASE} --load {ck}")[0]
    errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1, out + err
    assert errors[0].startswith("error: " + start.format(f=bad)), errors[0]
    assert errors[0].endswith("); iteration 2 is the latest good one: load it with --ckpt-step 2 "
                              "(or restore the file from a copy)"), errors[0]
    assert "Traceback" not in out + err
    # the way out works: iteration 2 resumes exactly (the tracker still names 4)
    with contextlib.redirect_stdout(io.StringIO()):
        resumed = run_workers(train_losses, 1, f"{BASE} --load {ck} --ckpt-step 2")[0]
    assert resumed == losses[fmt][2:]


def test_ckpt_step_names_the_saved_iterations_when_it_has_no_folder(saved):
    root, _ = saved
    status, out, err = run_workers(_main, 1, f"{BASE} --load {root / 'torch'} --ckpt-step 3")[0]
    assert status == 2
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: --ckpt-step 3: {root / 'torch' / 'iter_0000003'} does not exist (saved "
        f"iterations under {root / 'torch'}: 2, 4); give one of them"], out + err


def test_negative_ckpt_step_is_refused_before_start():
    from megatron_cp.cli.arguments import parse_args
    with pytest.raises(ValueError, match=r"--ckpt-step \(-1\) is the iteration to load"):
        parse_args(f"{BASE} --load somewhere --ckpt-step -1".split())


if __name__ == "__main__":
    sys.exit(_rank_on_fake_disk(sys.argv[1:]))
