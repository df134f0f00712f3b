"""--ckpt-format torch_dist: checkpoints that load into any layout, exact resume, atomic saves.

- Any layout: a checkpoint saved under TP=2 x PP=2 x DP=2 with the distributed optimizer
  loads under TP=1 x PP=1 x DP=4, TP=4 x PP=2 and CP=2 x DP=2 without it (and DP=4 with it):
  the losses after resuming are those the original layout computes, and the full
  (unsharded) model weights and Adam moments read back are identical to the saved ones. The
  model has SwiGLU (a strided TP split), tied embeddings (a last-stage copy) and a vocabulary
  whose padding differs with the TP size.
- Resume with the distributed optimizer is bit-exact in both formats, also with
  --async-save; a torch-format checkpoint saved with it loads without it.
- A save that dies halfway (a writer SIGKILLed while writing, a writer raising on one rank)
  leaves the previous checkpoint loadable and the tracker where it was.
- Pieces: a distributed-optimizer shard cut at any flat offset maps to exact boxes.
"""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from dist_harness import WorkerError, run_workers
from megatron_cp.checkpoint import files
from megatron_cp.cli.arguments import parse_args
from megatron_cp.checkpoint.canonical import param_spec
from megatron_cp.checkpoint.pieces import Pieces
from megatron_cp.checkpoint.torch_dist_format import read_full
from megatron_cp.training import Trainer
from training_utils import TINY, max_rel_diff, run_and_state, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = (TINY.replace("--num-layers 2", "--num-layers 4")
        .replace("--make-vocab-size-divisible-by 64", "--make-vocab-size-divisible-by 48")
        + " --swiglu --lr-decay-iters 20")  # vocab 201 pads to 240 / 288 / 384 at TP 1 / 2 / 4
SOURCE = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer"
TARGETS = {  # name: (world, layout)
    "tp1_pp1_dp4": (4, ""),
    "tp1_pp1_dp4_distopt": (4, "--use-distributed-optimizer"),
    "cp2_dp2": (4, "--context-parallel-size 2"),
    "tp4_pp2": (8, "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2"),
}
SAVED_AT, RESUMED_TO = 5, 7


def _load_and_resave(rank, world, argv, target_dir):
    """Load the latest checkpoint into a fresh trainer and save it again, unchanged."""
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.iteration, trainer.consumed_samples = trainer.checkpointer.load(
        trainer.train_state(), args.load)
    trainer.checkpointer.save(trainer.train_state(), target_dir)
    return trainer.iteration


def _jobs(rank, world, jobs):
    return {name: fn(rank, world, *job_args) for name, (fn, *job_args) in jobs.items()}


def test_any_layout_loads_and_resumes(tmp_path):
    src = tmp_path / "src"
    run = f"{BASE} --ckpt-format torch_dist"
    jobs8 = {"save": (train_losses, f"{run} {SOURCE} --train-iters {SAVED_AT} --save {src}"),
             "original": (train_losses, f"{run} {SOURCE} --train-iters {RESUMED_TO} --load {src}")}
    jobs = {8: jobs8, 4: {}}
    for name, (world, layout) in TARGETS.items():
        argv = f"{run} {layout} --train-iters {RESUMED_TO} --load {src}"
        jobs[world][f"{name}:resave"] = (_load_and_resave, argv, str(tmp_path / name))
        jobs[world][f"{name}:resume"] = (train_losses, argv)
    results = {world: run_workers(_jobs, world, world_jobs, timeout=500)[0]
               for world, world_jobs in jobs.items()}
    original = results[8]["original"]
    assert len(results[8]["save"]) == SAVED_AT and len(original) == RESUMED_TO - SAVED_AT
    saved, common = read_full(str(src / f"iter_{SAVED_AT:07d}"))
    assert common["iteration"] == SAVED_AT and common["has_optimizer"]
    assert saved["model.embedding.word_embeddings.weight"].shape == (201, 32)  # real rows (+EOD)
    assert saved["model.decoder.layers.3.mlp.linear_fc1.weight"].shape == (2, 128, 32)  # gate, up
    assert any(k.startswith("optimizer.exp_avg_sq.decoder.layers.3.") for k in saved)
    assert not any(k.startswith("optimizer.main_param.") for k in saved)  # fp32: params are main
    for name, (world, _) in TARGETS.items():
        resumed = results[world][f"{name}:resume"]
        diff = max_rel_diff(resumed, original)
        print(f"{name}: losses after resuming {resumed} vs original layout {original}: {diff:.1e}")
        assert diff < 1e-5
        assert results[world][f"{name}:resave"] == SAVED_AT
        again, _ = read_full(str(tmp_path / name / f"iter_{SAVED_AT:07d}"))
        assert set(again) == set(saved), name
        for key in saved:  # weights and full Adam moments, whatever the layout held them
            assert torch.equal(again[key], saved[key]), (name, key)


def test_resume_with_the_distributed_optimizer_is_bit_exact(tmp_path):
    """20 straight iterations == 10 + save + load + 10 (dropout on, DP=2, ZeRO), in both
    formats and with --async-save; the torch-format file of a ZeRO run loads without ZeRO."""
    base = f"{BASE} --hidden-dropout 0.1 --attention-dropout 0.1 --train-iters 20"
    zero = f"{base} --use-distributed-optimizer"
    jobs = {"straight": (train_losses, zero)}
    for fmt, extra in (("torch", "--ckpt-format torch"), ("torch_dist", "--ckpt-format torch_dist"),
                       ("async", "--ckpt-format torch_dist --async-save --save-interval 4")):
        ck = tmp_path / fmt
        jobs[f"{fmt}:first"] = (train_losses, f"{zero} {extra} --exit-interval 10 --save {ck}")
        if fmt == "torch":  # before the second run moves the tracker on
            jobs["no_zero:second"] = (train_losses, f"{base} --load {ck}")
        jobs[f"{fmt}:second"] = (train_losses, f"{zero} {extra} --load {ck} --save {ck}")
    results = run_workers(_jobs, 2, jobs, timeout=400)[0]
    straight = results["straight"]
    for fmt in ("torch", "torch_dist", "async"):
        assert results[f"{fmt}:first"] + results[f"{fmt}:second"] == straight, fmt
        assert files.read_tracker(str(tmp_path / fmt)) == 20
    assert os.path.exists(tmp_path / "async" / "iter_0000008" / ".metadata")  # background saves
    # ZeRO's shards gathered into the plain format: the same optimizer without sharding
    assert max_rel_diff(results["no_zero:second"], straight[10:]) < 1e-6


def _slow_save_then_train(argv):
    """Subprocess body: train with a writer that stops halfway through the second save."""
    from megatron_cp.checkpoint import pieces
    from megatron_cp.training import main
    real, planners = pieces.PiecesSavePlanner.resolve_data, []

    def slow(self, item):
        if self not in planners:
            planners.append(self)
        if len(planners) == 2 and item.index.fqn.startswith("optimizer."):
            print("WRITING SECOND SAVE", flush=True)  # part of the file is written: hang
            time.sleep(600)
        return real(self, item)

    pieces.PiecesSavePlanner.resolve_data = slow
    sys.exit(main(argv))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_save_killed_while_writing_keeps_the_previous_checkpoint(tmp_path):
    run = f"{TINY} --lr-decay-iters 20"
    argv = (f"{run} --ckpt-format torch_dist --async-save --save-interval 2 --train-iters 1000 "
            f"--save {tmp_path}").split()
    env = dict(os.environ, MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([  # the package, the harness, this file
                   ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]))
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        env.pop(key, None)
    code = ("import sys; from test_dist_checkpoint import _slow_save_then_train; "
            f"_slow_save_then_train({argv!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.time() + 180
        for line in proc.stdout:
            lines.append(line)
            if "WRITING SECOND SAVE" in line or time.time() > deadline:
                break
        assert "WRITING SECOND SAVE" in lines[-1], "".join(lines[-30:])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert files.read_tracker(str(tmp_path)) == 2
    assert not os.path.exists(tmp_path / "iter_0000004")
    assert os.path.exists(tmp_path / "iter_0000004.tmp" / "rng")  # the partial save, ignored
    same = f"{run} --train-iters 1000 --exit-interval 3"  # the data order of the killed run
    straight = run_workers(train_losses, 1, same)[0]
    resumed = run_workers(train_losses, 1, f"{same} --load {tmp_path}")[0]
    assert resumed == straight[2:]


def _failing_writer(rank, world, argv):
    from megatron_cp.checkpoint import pieces
    real, planners = pieces.PiecesSavePlanner.resolve_data, []

    def flaky(self, item):
        if self not in planners:
            planners.append(self)
        if len(planners) == 2 and rank == 1:
            raise OSError("disk full (simulated) while writing a torch_dist shard")
        return real(self, item)

    pieces.PiecesSavePlanner.resolve_data = flaky
    return train_losses(rank, world, argv)


def test_save_failing_on_one_rank_keeps_the_previous_checkpoint(tmp_path):
    argv = f"{BASE} --ckpt-format torch_dist --train-iters 4 --save {tmp_path} --save-interval 2"
    with pytest.raises(WorkerError, match="disk full"):
        run_workers(_failing_writer, 2, argv + " --use-distributed-optimizer")
    assert files.read_tracker(str(tmp_path)) == 2
    assert not os.path.exists(tmp_path / "iter_0000004")
    losses = run_workers(train_losses, 2, f"{BASE} --train-iters 4 --load {tmp_path}")[0]
    assert len(losses) == 2


@pytest.mark.parametrize("shape,dim,stride,tp,vocab", [
    ((12, 5), 0, 1, 3, 30), ((6, 4), 1, 1, 2, None), ((8, 3), 0, 2, 2, None), ((7,), 0, 1, 1, None)])
def test_pieces_of_any_flat_range_land_in_the_global_tensor(shape, dim, stride, tp, vocab):
    """Every rank's shard [a, b) of its TP slice, written into the global tensor through its
    boxes, rebuilds the canonical tensor (vocab rows beyond ``vocab`` dropped)."""
    from megatron_cp.tensor_parallel import split_full
    full_shape = list(shape)
    full_shape[dim] *= tp
    full = torch.arange(torch.Size(full_shape).numel(), dtype=torch.float32).view(full_shape)
    name = "embedding.word_embeddings.weight" if vocab else "w"
    rebuilt = None
    for rank in range(tp):
        local = split_full(full, dim, stride, tp, rank).contiguous()
        param = torch.nn.Parameter(local)
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = tp > 1, dim, stride
        spec = param_spec(name, param, tp, rank, vocab)
        if rebuilt is None:
            rebuilt = torch.full(spec.global_shape, -1.0)
        flat = local.reshape(-1)
        cuts = sorted({0, flat.numel(), 5 % flat.numel(), 11 % flat.numel()})
        for a, b in zip(cuts, cuts[1:]):
            for offsets, piece in Pieces.of_flat(spec, flat[a:b], a, b).boxes:
                box = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
                rebuilt[box] = piece
    # canonical: a strided dim split into [stride, n/stride]; real vocabulary rows only
    expected = full.reshape(rebuilt.shape) if stride > 1 else full[:rebuilt.shape[0]]
    assert torch.equal(rebuilt, expected)
