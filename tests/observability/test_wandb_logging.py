"""Weights & Biases logging (--wandb-project, megatron_cp/observability/wandb_logging.py): the last rank
writes one run, offline without a login, whose history holds the training scalars under
Megatron-LM's names; without the wandb package the flag is one error line."""
import contextlib
import glob
import io
import json
import os
import struct
import sys

from dist_harness import run_workers
from training_utils import TINY, train_losses

ARGV = f"{TINY} --train-iters 3 --log-interval 1"


def _records(path):
    """The records of a run's transaction log (``run-<id>.wandb``), parsed with wandb's own
    protobuf classes. wandb 0.31 has no Python reader of the file (its Go core reads it), so
    this reads the log's framing: a 7-byte header, then 32 KiB blocks of chunks, each with a
    4-byte checksum, a 2-byte length and a 1-byte type (1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as file:
        data = file.read()
    assert data[:4] == b":W&B", data[:7]
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # a block's tail too short for a chunk header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            position += room
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _read_run(folder):
    """``(run record, {config key: value}, [history rows])`` of an offline run folder."""
    (path,) = glob.glob(os.path.join(folder, "run-*.wandb"))
    run, config, history = None, {}, []
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json)
                           for item in record.run.config.update})
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return run, config, history


def _train_offline(rank, world, argv, netrc_path):
    """Train with no wandb login (no key, an absent netrc file) and no WANDB_MODE: the run
    must be offline."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        os.environ.pop(name, None)
    os.environ["NETRC"] = netrc_path
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        losses = train_losses(rank, world, argv)
    return losses, text.getvalue()


def test_last_rank_writes_an_offline_run_with_megatrons_scalar_names(tmp_path):
    save_dir = tmp_path / "wandb-runs"
    argv = (f"{ARGV} --wandb-project proj --wandb-exp-name tiny-run "
            f"--wandb-save-dir {save_dir}")
    (losses, text0), (same, text1) = run_workers(_train_offline, 2, argv,
                                                 str(tmp_path / "no-netrc"))
    assert losses == same
    assert "the run is written offline" in text1 and "written offline" not in text0
    runs = glob.glob(str(save_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs  # one run, by one rank
    run, config, history = _read_run(runs[0])
    assert (run.project, run.display_name) == ("proj", "tiny-run")
    assert (config["rank"], config["world_size"]) == (1, 2)  # the last rank wrote it
    assert config["wandb_exp_name"] == "tiny-run" and config["seq_length"] == 32
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [row["lm loss"] for row in history] == losses
    lrs = [row["learning-rate"] for row in history]
    assert lrs[0] == 1.5e-3 and lrs[1] == 3e-3  # --lr-warmup-iters 2 up to --lr 3e-3
    assert {"grad-norm", "samples vs steps", "batch-size", "loss-scale"} <= set(history[0])
    assert [row["samples vs steps"] for row in history] == [8, 16, 24]


def _main(argv):
    from megatron_cp.training import main
    text = io.StringIO()
    with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
        status = main(argv.split())
    return status, text.getvalue()


def test_without_the_wandb_package_the_flag_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an absent package looks like
    status, text = _main(f"{ARGV} --wandb-project proj --wandb-save-dir {tmp_path}")
    assert status == 2 and text.splitlines() == [
        "error: --wandb-project proj logs to Weights & Biases, but the wandb package is not "
        "installed: pip install wandb"], text
    status, text = _main(f"{ARGV} --wandb-project proj")
    assert status == 2 and text.splitlines()[-1] == (
        "error: --wandb-project proj needs a folder for the run: give --wandb-save-dir DIR (or "
        "--save DIR, which puts it in DIR/wandb)"), text
