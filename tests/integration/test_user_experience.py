"""What a user sees: one-line errors, the start-up banner and end summary printed once, quiet
logs, re-running / extending / changing the layout of the example script, and the learning
rate of a run resumed from a converted checkpoint."""
import contextlib
import gc
import io
import os
import re
import subprocess
import sys

import pytest
import torch

from dist_harness import WorkerError, run_workers
from megatron_cp.checkpoint import files
from megatron_cp.cli.arguments import parse_args
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.training import pretrain
from training_utils import TINY, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a traceback frame in this repository's code (not in a .venv that lives inside it)
OUR_FRAME = r'File "' + re.escape(ROOT) + r'/(?!\.venv/)'
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt_cpu.sh")
LOG_LINE = re.compile(r"iteration\s+(\d+)/.*learning rate: ([0-9.E+-]+) .*")


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    return env


def _run(cmd, cwd=ROOT, timeout=120, **env):
    proc = subprocess.run(cmd, cwd=cwd, env=_env(**env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def _pretrain_capturing(rank, world, argv, attrs=None):
    """Worker: parse, set extra ``attrs`` on args (flags another module may not have yet),
    train; returns (losses, stdout text, gc calls, gc enabled after)."""
    args = parse_args(argv.split(), world_size=world)
    for name, value in (attrs or {}).items():
        setattr(args, name, value)
    state = initialize_model_parallel(
        args.tensor_model_parallel_size, args.context_parallel_size,
        args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        device=torch.device("cpu"))
    calls, real_collect = [0], gc.collect

    def counting_collect(*a):
        calls[0] += 1
        return real_collect(*a)

    gc.collect = counting_collect
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            losses = pretrain(args, state)
    finally:
        gc.collect = real_collect
    return losses, out.getvalue(), calls[0], gc.isenabled()


def _learning_rates(text):
    return {int(m.group(1)): float(m.group(2)) for m in LOG_LINE.finditer(text)}


# ----- one-line user errors ----------------------------------------------------------------

def _main_capturing(rank, world, argv):
    from megatron_cp.training import main
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = main(argv.split())
    return status, err.getvalue() + out.getvalue()


def test_bad_flag_in_process_is_one_line_from_rank_0():
    argv = f"{TINY} --train-iters 4 --lr-warmup-iters 10"
    (status0, text0), (status1, text1) = run_workers(_main_capturing, 2, argv)
    assert status0 == status1 == 2
    assert text0.splitlines() == [
        "error: --lr-warmup-iters (10) must be smaller than --lr-decay-iters (4, default "
        "--train-iters); shorten the warmup or lengthen the decay"]
    assert text1 == ""


def test_unknown_flag_in_process_is_one_line_and_a_crash_keeps_its_traceback(monkeypatch):
    (status, text), = run_workers(_main_capturing, 1, f"{TINY} --train-iters 4 --bogus 3")
    assert status == 2 and text.splitlines() == ["error: unrecognized arguments: --bogus 3 (see --help)"]
    from megatron_cp.training import loop

    def crash(args):
        raise RuntimeError("a real bug")
    monkeypatch.setattr(loop, "pretrain", crash)
    with pytest.raises(RuntimeError, match="a real bug"):
        loop.main(f"{TINY} --train-iters 4".split())


def test_bad_flag_under_torchrun_prints_one_error_line_and_no_worker_traceback():
    status, out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "pretrain_gpt.py", *TINY.split(),
                        "--train-iters", "4", "--lr-warmup-iters", "10"])
    assert status != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == ["error: --lr-warmup-iters (10) must be smaller than --lr-decay-iters (4, "
                      "default --train-iters); shorten the warmup or lengthen the decay"], out
    assert "ValueError" not in out and not re.search(OUR_FRAME, out), out  # no worker traceback
    assert "exitcode  : 2" in out  # rank 0 exited first, with argparse's status


@pytest.mark.parametrize("flag,message", [
    (["--lr-warmup-iters", "10"], "error: --lr-warmup-iters (10) must be smaller than "
                                  "--lr-decay-iters (4, default --train-iters)"),
    (["--bogus"], "error: unrecognized arguments: --bogus (see --help)"),
])
def test_example_script_bad_flag_is_one_line_and_status_2(tmp_path, flag, message):
    status, out = _run(["bash", SCRIPT, *flag], cwd=tmp_path, NPROC="2", TP="2", CP="1", PP="1",
                       ITERS="4", DATA_ARGS="--mock-data --vocab-size 200")
    assert status == 2, out
    assert len(out.splitlines()) == 1 and out.startswith(message), out
    assert not os.path.exists(tmp_path / "runs")  # nothing started


# ----- banner, summary, quiet logs ---------------------------------------------------------

def _expected_parameters():
    from megatron_cp.data import build_tokenizer
    from megatron_cp.model import GPTModel
    from megatron_cp.startup import config_from_args
    args = parse_args(TINY.split() + ["--train-iters", "3"], world_size=1)
    vocab = build_tokenizer("NullTokenizer", None, None, None, args.vocab_size).vocab_size
    model = GPTModel(config_from_args(args, vocab))
    return sum(p.numel() for p in model.parameters())


def test_banner_and_summary_printed_once_with_model_sizes_and_no_warnings(tmp_path):
    status, out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "4", "pretrain_gpt.py", *TINY.split(),
                        "--train-iters", "3", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                        "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100",
                        "--save", str(tmp_path / "ck"), "--tensorboard-dir", str(tmp_path / "tb")],
                       timeout=180)
    assert status == 0, out
    assert out.count("------------------------ arguments ------------------------") == 1
    assert out.count("  tensor_model_parallel_size ...") == 1
    assert out.count("using world size: 4, data-parallel size: 1, context-parallel size: 1, "
                     "tensor-model-parallel size: 2, pipeline-model-parallel size: 2") == 1
    counts = {tuple(map(int, m.groups()[:2])): int(m.group(3)) for m in re.finditer(
        r"model parallel rank \((\d), (\d)\): (\d+)", out)}
    total = int(re.search(r"total number of parameters: (\d+)", out).group(1))
    assert total == _expected_parameters()
    # every rank holds its shard; the tied embedding lives on both stages, counted once
    assert set(counts) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert sum(counts.values()) > total
    assert re.search(r"dataset samples: train: \d+, validation: \d+, test: \d+", out)
    assert out.count("end of training") == 1
    assert f"checkpoints: {tmp_path / 'ck'} (latest: iteration 3)" in out
    assert f"tensorboard: {tmp_path / 'tb'}" in out
    assert "validation loss at iteration 3 | lm loss value" in out  # the end-of-training one
    assert re.search(r"final validation loss: \d\.\d+E\+00 \(PPL .*\) at iteration 3", out)
    assert out.count("FutureWarning") == 0 and out.count("Warning") == 0, out


def test_params_norm_counts_each_parameter_once_and_manual_gc(tmp_path):
    argv = TINY.replace("--log-interval 100", "--log-interval 1") + " --train-iters 3"
    attrs = {"log_params_norm": True, "manual_gc": True, "manual_gc_interval": 1,
             "compat_notes": ["--use-flash-attn: our attention kernels are chosen per device"]}
    single = run_workers(_pretrain_capturing, 1, argv, attrs)[0]
    split = run_workers(_pretrain_capturing, 4, argv + " --tensor-model-parallel-size 2 "
                        "--pipeline-model-parallel-size 2", attrs)
    norms = [float(re.findall(r"params norm: ([0-9.]+)", run[1])[-1]) for run in (single, split[0])]
    assert norms[0] > 0 and abs(norms[0] - norms[1]) / norms[0] < 1e-5
    assert all(text == "" for _, text, _, _ in split[1:])  # ranks other than 0 print nothing
    assert split[0][1].count("compatibility notes:") == 1
    assert "  - --use-flash-attn: our attention kernels are chosen per device" in split[0][1]
    _, _, collects, enabled = single
    assert collects >= 4 and enabled  # at start and every iteration; re-enabled afterwards


# ----- resume, extend, finished runs, converted checkpoints --------------------------------

def test_extending_train_iters_names_the_flags_then_continues(tmp_path):
    run_workers(train_losses, 1, f"{TINY} --train-iters 4 --save {tmp_path}")
    with pytest.raises(WorkerError, match=r"--override-opt_param-scheduler .*"
                                          r"--use-checkpoint-opt_param-scheduler") as info:
        run_workers(train_losses, 1, f"{TINY} --train-iters 6 --load {tmp_path}")
    assert re.search(r"--lr-decay-iters (and the weight-decay increment )?defaults? to --train-iters",
                     str(info.value))
    more = run_workers(train_losses, 1, f"{TINY} --train-iters 6 --load {tmp_path} --save {tmp_path} "
                                        f"--override-opt_param-scheduler")[0]
    assert len(more) == 2 and files.read_tracker(str(tmp_path)) == 6


def test_load_of_a_finished_run_says_so(tmp_path):
    run_workers(train_losses, 1, f"{TINY} --train-iters 3 --save {tmp_path}")
    losses, text, _, _ = run_workers(_pretrain_capturing, 1,
                                     f"{TINY} --train-iters 3 --load {tmp_path} --save {tmp_path}")[0]
    assert losses == []
    assert "checkpoint at iteration 3 already reached --train-iters 3; raise --train-iters to " \
           "train on" in text


def test_converted_checkpoint_resumes_the_learning_rate_schedule(tmp_path):
    from tools import checkpoint_convert
    argv = TINY.replace("--log-interval 100", "--log-interval 1") + " --train-iters 6"
    straight = _learning_rates(run_workers(_pretrain_capturing, 1, argv)[0][1])
    run_workers(train_losses, 1, f"{argv} --exit-interval 3 --save {tmp_path / 'a'} "
                                 f"--ckpt-format torch")
    checkpoint_convert.main(["--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "b")])
    _, text, _, _ = run_workers(_pretrain_capturing, 1, f"{argv} --load {tmp_path / 'b'}")[0]
    assert "the learning-rate schedule resumes at iteration 3" in text
    resumed = _learning_rates(text)
    assert sorted(resumed) == [4, 5, 6]
    for it in resumed:  # the original run's rate at that iteration, not a new warmup
        assert resumed[it] == pytest.approx(straight[it], rel=1e-6), (it, resumed, straight)


def test_example_script_resumes_and_extends(tmp_path):
    env = dict(NPROC="2", TP="2", CP="1", PP="1", DATA_ARGS="--mock-data --vocab-size 200",
               LOG_INTERVAL="1")
    folder = tmp_path / "runs" / "gpt_cpu" / "tp2_cp1_pp1_dp1" / "checkpoints"
    status, out = _run(["bash", SCRIPT], cwd=tmp_path, ITERS="2", **env)
    assert status == 0, out
    assert "training from iteration 0 to 2" in out
    assert files.read_tracker(str(folder)) == 2
    status, out = _run(["bash", SCRIPT, "--override-opt_param-scheduler"], cwd=tmp_path,
                       ITERS="3", **env)
    assert status == 0, out
    assert "loaded checkpoint from runs/gpt_cpu/tp2_cp1_pp1_dp1/checkpoints at iteration 2" in out
    assert "training from iteration 2 to 3" in out and "iteration        1/" not in out
    assert files.read_tracker(str(folder)) == 3
    status, out = _run(["bash", SCRIPT], cwd=tmp_path, ITERS="3", **env)
    assert status == 0 and "already reached --train-iters 3" in out, out


def test_example_script_keeps_one_folder_per_layout(tmp_path):
    env = dict(NPROC="2", CP="1", PP="1", ITERS="2", DATA_ARGS="--mock-data --vocab-size 200")
    status, out = _run(["bash", SCRIPT], cwd=tmp_path, TP="2", **env)
    assert status == 0, out
    status, out = _run(["bash", SCRIPT], cwd=tmp_path, TP="1", **env)
    assert status == 0, out
    assert "run folder: runs/gpt_cpu/tp1_cp1_pp1_dp2" in out
    assert "training from iteration 0 to 2" in out  # a new run, not the TP=2 checkpoint
    runs = tmp_path / "runs" / "gpt_cpu"
    assert sorted(os.listdir(runs)) == ["tp1_cp1_pp1_dp2", "tp2_cp1_pp1_dp1"]
    for layout in os.listdir(runs):
        assert files.read_tracker(str(runs / layout / "checkpoints")) == 2


def test_deepseek_v3_example_passes_the_flag_check_for_64_gpus(tmp_path):
    """examples/pretrain_deepseek_v3_distributed.sh: its flags pass the one-process check for
    8 nodes x 8 GPUs (a torchrun stand-in records the launch), on a real .bin/.idx pair; on one
    node the same flags stop at the check with one line (EP 16 needs DP x TP >= 16)."""
    import numpy as np

    from megatron_cp.data.indexed_dataset import (IndexedDatasetBuilder, data_file_path,
                                                  index_file_path)
    prefix = str(tmp_path / "data")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    for _ in range(40):
        builder.add_document(np.arange(5000) % 1000)
    builder.finalize(index_file_path(prefix))
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "torchrun"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "launched"}\n')
    fake.chmod(0o755)
    script = os.path.join(ROOT, "examples", "pretrain_deepseek_v3_distributed.sh")
    tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "129279"]
    path = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    status, out = _run(["bash", script, prefix, "unused.model", *tokenizer], cwd=tmp_path,
                       timeout=300, PATH=path)
    assert status == 0, out
    launched = (tmp_path / "launched").read_text()
    assert "--nnodes 8" in launched and "--multi-latent-attention" in launched
    assert "--mtp-num-layers 1" in launched
    status, out = _run(["bash", script, prefix, "unused.model", *tokenizer], cwd=tmp_path,
                       timeout=300, PATH=path, NNODES="1")
    assert status == 2 and out.strip().splitlines() == [
        "error: --expert-model-parallel-size (16) x --expert-tensor-parallel-size (1) = 16 must "
        "divide the data x context x tensor parallel ranks of a pipeline stage (2); pick EP x "
        "ETP among the divisors of 2"], out
