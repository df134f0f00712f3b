"""Writes the fixture checkpoints that tests/test_saved_checkpoints_load.py loads: a tiny GPT
trained 2 of 4 iterations and saved in each on-disk format by the code of the day they were
made (recorded in fixtures.json with the commit), and the losses of iterations 3..4 a resume
from them gave then. Rerun only to add a format: the point is that old files keep loading.

    PYTHONPATH=.:tests python tests/data/checkpoints/make_fixtures.py
"""
import json
import os
import shutil
import subprocess

from dist_harness import run_workers
from training_utils import TINY, train_losses

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

FORMATS = ("torch", "torch_dist")
ARGV = TINY + " --lr-decay-iters 4"


def main():
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {"commit": commit, "argv": ARGV + " --train-iters 4", "formats": {}}
    for fmt in FORMATS:
        folder = os.path.join(HERE, fmt)
        shutil.rmtree(folder, ignore_errors=True)
        run_workers(train_losses, 1, ARGV + f" --train-iters 2 --save {folder} --save-interval 2 "
                    f"--ckpt-format {fmt}")
        resumed = run_workers(train_losses, 1, ARGV + f" --train-iters 4 --load {folder} "
                              f"--ckpt-format {fmt}")[0]
        record["formats"][fmt] = {"resumed_losses": resumed}
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
