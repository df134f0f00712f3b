"""Checkpoints: bit-exact resume, atomic save, refusal of mismatched arguments, SIGTERM exit."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dist_harness import WorkerError, run_workers
from megatron_cp.checkpoint import files
from training_utils import TINY, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DROPOUT = TINY  # Megatron-LM's default dropout: the resume must restore what it draws from


def test_resume_is_bit_exact(tmp_path):
    """20 straight iterations == 10 + save + load + 10, with dropout (RNG) and TP=2."""
    base = f"{DROPOUT} --train-iters 20 --tensor-model-parallel-size 2"
    straight = run_workers(train_losses, 2, base)[0]
    first = run_workers(train_losses, 2, f"{base} --exit-interval 10 --save {tmp_path}")[0]
    assert files.read_tracker(str(tmp_path)) == 10
    second = run_workers(train_losses, 2, f"{base} --load {tmp_path} --save {tmp_path}")[0]
    assert first + second == straight  # exact equality, not a tolerance
    assert files.read_tracker(str(tmp_path)) == 20


def _crash_during_second_save(rank, world, argv):
    calls = {"n": 0}
    real = files.atomic_torch_save

    def flaky(obj, path):
        if "iter_0000004" in path:
            raise OSError("disk full (simulated) while writing " + path)
        calls["n"] += 1
        return real(obj, path)

    files.atomic_torch_save = flaky
    return train_losses(rank, world, argv)


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    argv = f"{TINY} --train-iters 4 --save {tmp_path} --save-interval 2"
    with pytest.raises(WorkerError, match="disk full"):
        run_workers(_crash_during_second_save, 1, argv)
    assert files.read_tracker(str(tmp_path)) == 2
    assert not os.path.exists(tmp_path / "iter_0000004")
    # the previous checkpoint still loads and training goes on from it
    losses = run_workers(train_losses, 1, f"{TINY} --train-iters 4 --load {tmp_path}")[0]
    assert len(losses) == 2


def test_mismatched_arguments_are_refused(tmp_path):
    run_workers(train_losses, 1, f"{TINY} --train-iters 3 --save {tmp_path}")
    other = TINY.replace("--hidden-size 32", "--hidden-size 48")
    with pytest.raises(WorkerError, match=r"hidden_size: checkpoint 32 vs now 48"):
        run_workers(train_losses, 1, f"{other} --train-iters 4 --load {tmp_path}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    env = dict(os.environ, MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        env.pop(key, None)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY.split(),
           "--train-iters", "100000", "--log-interval", "1", "--exit-signal-handler",
           "--ckpt-format", "torch",
           "--save", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        for line in proc.stdout:  # wait until training runs
            if "iteration        3/" in line or time.time() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out
    saved = files.read_tracker(str(tmp_path))
    assert saved is not None and saved >= 3
    assert os.path.exists(tmp_path / f"iter_{saved:07d}" / "mp_rank_00" / "model_optim_rng.pt")


def test_use_checkpoint_args_needs_no_model_flags(tmp_path):
    """--use-checkpoint-args takes the model's shape and tokenizer from the checkpoint: a run
    that names no model flag resumes and trains on like one that names them all."""
    from megatron_cp.cli.arguments import parse_args
    model = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
             "--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm "
             "--position-embedding-type rope --mock-data --tokenizer-type NullTokenizer "
             "--vocab-size 200")
    run = ("--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 1 "
           "--hidden-dropout 0 --attention-dropout 0 --eval-iters 0 --seed 11 "
           "--override-opt_param-scheduler")
    run_workers(train_losses, 1, f"{model} {run} --train-iters 2 --save {tmp_path}")
    named = run_workers(train_losses, 1, f"{model} {run} --train-iters 4 --load {tmp_path}")[0]
    bare = f"{run} --mock-data --train-iters 4 --load {tmp_path} --use-checkpoint-args"
    args = parse_args(bare.split())
    assert (args.num_layers, args.num_query_groups, args.swiglu, args.normalization,
            args.vocab_size, args.seq_length) == (2, 2, True, "RMSNorm", 200, 32)
    assert run_workers(train_losses, 1, bare)[0] == named
    with pytest.raises(ValueError, match="give --load DIR"):
        parse_args(f"{run} --mock-data --train-iters 4 --use-checkpoint-args".split())
    with pytest.raises(ValueError, match="no checkpoint under"):
        parse_args(f"{bare} --load {tmp_path}/empty".split())


def test_exit_on_missing_checkpoint(tmp_path):
    with pytest.raises(WorkerError, match="--exit-on-missing-checkpoint: no checkpoint under"):
        run_workers(train_losses, 1, f"{TINY} --train-iters 3 --load {tmp_path} "
                                     f"--exit-on-missing-checkpoint")
    assert len(run_workers(train_losses, 1, f"{TINY} --train-iters 3 --load {tmp_path}")[0]) == 3
