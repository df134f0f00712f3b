"""tools/fork_launch.py gives forked ranks what torchrun gives them, a failing rank's exit
status, and leaves no process of theirs behind."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

from tools.fork_launch import children_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"sum {x.item():.0f} argv {sys.argv[1:]}", flush=True)
dist.barrier()
dist.destroy_process_group()
if dist_fail := os.environ.get("FAIL_RANK"):
    if os.environ["RANK"] == dist_fail:
        sys.exit(3)
"""


LAUNCHER = [sys.executable, os.path.join(ROOT, "tools", "fork_launch.py"), "--nproc-per-node"]
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def _launch(tmp_path, nproc, env=None, script_text=SCRIPT, timeout=300):
    script = tmp_path / "script.py"
    script.write_text(script_text)
    return subprocess.run([*LAUNCHER, str(nproc), str(script), "--flag", "7"],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(ENV, **(env or {})))


def _running(pid):
    """Whether ``pid`` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid):
    found, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


def test_forked_ranks_form_one_group_with_torchrun_variables(tmp_path):
    done = _launch(tmp_path, 3)
    assert done.returncode == 0, done.stdout + done.stderr
    # the ranks write to one pipe at once: a line may land inside another, so find each whole
    lines = sorted(re.findall(r"rank \d/\d local \d sum \d+ argv \[[^\]]*\]", done.stdout))
    assert lines == [f"rank {r}/3 local {r} sum 6 argv ['--flag', '7']" for r in range(3)], lines


def test_a_failing_rank_sets_the_exit_status(tmp_path):
    done = _launch(tmp_path, 2, {"FAIL_RANK": "1"})
    assert done.returncode == 3, done.stdout + done.stderr



LEAVES_A_CHILD = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # our stdout
print(f"rank {os.environ['RANK']} leaves {child.pid}", flush=True)
"""


def test_what_a_rank_leaves_running_ends_with_the_launcher(tmp_path):
    """A process a rank started and left running (it holds the output pipe) is ended once the
    ranks are done, as torchrun ends each rank's process group: the launcher returns with its
    output complete instead of the caller waiting on the pipe."""
    done = _launch(tmp_path, 2, script_text=LEAVES_A_CHILD, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    left = [int(pid) for pid in re.findall(r"rank \d leaves (\d+)", done.stdout)]
    assert len(left) == 2 and not any(map(_running, left)), done.stdout


SLEEPS = """
import os, time
print(f"rank {os.environ['RANK']} up", flush=True)
time.sleep(600)
"""


def test_a_sigterm_to_the_launcher_ends_the_ranks(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SLEEPS)
    launcher = subprocess.Popen([*LAUNCHER, "2", str(script)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=ENV)
    assert launcher.stdout.readline().endswith("up\n") and launcher.stdout.readline()
    ranks = _descendants(launcher.pid)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
    assert len(ranks) == 2 and not any(map(_running, ranks))


TINY_RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3 --mock-data "
            "--vocab-size 100 --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 1 "
            "--eval-interval 3 --num-workers 2")


def test_dataloader_workers_end_with_their_ranks(tmp_path):
    """A pretraining run with --num-workers: when the launcher returns, no process of the run is
    left (a forked rank ends with os._exit, which runs no finaliser: its DataLoader workers
    used to run on until their own parent check, up to 5 s later, holding the output pipe),
    and the pipe is closed with it."""
    launcher = subprocess.Popen([*LAUNCHER, "2", os.path.join(ROOT, "pretrain_gpt.py"),
                                 *TINY_RUN.split()], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path)
    seen, lines, closed = set(), [], []

    def read():
        for line in launcher.stdout:
            lines.append(line)
            if " iteration " in line and not seen:  # the training iterator's workers are up
                seen.update(_descendants(launcher.pid))
        closed.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    status = launcher.wait(timeout=300)
    ended = time.monotonic()
    left = [pid for pid in seen if _running(pid)]
    reader.join(timeout=30)
    out = "".join(lines)
    assert status == 0, out
    assert len(seen) > 2, f"no DataLoader worker seen beside the 2 ranks: {seen}\n{out}"
    assert not left, f"still running when the launcher returned: {left}"
    assert closed and closed[0] - ended < 2.0, "the output pipe outlived the launcher"


def test_ranks_start_with_the_launchers_objects_frozen_and_writers_imported(tmp_path):
    """What the launcher imported is shared with the ranks: its objects sit in the
    collector's permanent generation (a rank's collections do not copy their pages) and the
    writers a rank loads (tensorboard) are imported before the fork."""
    script = ("import gc, os, sys\n"
              "print(f\"rank {os.environ['RANK']} frozen {gc.get_freeze_count()} "
              "tensorboard {'torch.utils.tensorboard' in sys.modules}\", flush=True)\n")
    proc = _launch(tmp_path, 2, script_text=script)
    assert proc.returncode == 0, proc.stderr
    lines = re.findall(r"rank (\d) frozen (\d+) tensorboard (True|False)", proc.stdout)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"], proc.stdout
    assert all(int(frozen) > 10000 and loaded == "True" for _, frozen, loaded in lines), lines
