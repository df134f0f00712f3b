"""tools/fork_launch.py gives forked ranks what torchrun gives them, and a failing rank's
exit status."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def _launch(tmp_path, nproc, env=None):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fork_launch.py"),
                           "--nproc-per-node", str(nproc), str(script), "--flag", "7"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))


def test_forked_ranks_form_one_group_with_torchrun_variables(tmp_path):
    done = _launch(tmp_path, 3)
    assert done.returncode == 0, done.stdout + done.stderr
    # the ranks write to one pipe at once: a line may land inside another, so find each whole
    lines = sorted(re.findall(r"rank \d/\d local \d sum \d+ argv \[[^\]]*\]", done.stdout))
    assert lines == [f"rank {r}/3 local {r} sum 6 argv ['--flag', '7']" for r in range(3)], lines


def test_a_failing_rank_sets_the_exit_status(tmp_path):
    done = _launch(tmp_path, 2, {"FAIL_RANK": "1"})
    assert done.returncode == 3, done.stdout + done.stderr

