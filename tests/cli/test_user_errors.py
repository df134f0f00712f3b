"""A user's mistakes: each one is its own ``error:`` line, every one of them at once, before
anything starts; mistakes only the data can show stop the run with one line too; under plain
torchrun the failure summary names our error as the root cause."""
import contextlib
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from training_utils import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = TINY + " --train-iters 4"


def _main(argv):
    """``pretrain_gpt.py``'s main in this process (one rank): (status, printed text)."""
    from megatron_cp.training import main
    text = io.StringIO()
    with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
        status = main(argv.split())
    return status, text.getvalue()


def _corpus(folder, num_docs, largest_id=150, name="corpus"):
    from megatron_cp.data.indexed_dataset import IndexedDatasetBuilder
    prefix = str(folder / name)
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        doc = rng.integers(1, largest_id, int(rng.integers(30, 60)))
        doc[-1] = largest_id  # the largest id appears in every document
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return prefix


def _mistakes(tmp):
    """(flags, the line they must print): the common mistakes of a new user."""
    (tmp / "tok.vocab").write_text("x\t0\n")
    (tmp / "file").write_text("")
    return [
        ("--micro-batch-size 0", "--micro-batch-size (0) must be at least 1"),
        ("--log-interval 0", "--log-interval (0) must be at least 1"),
        ("--train-samples 80", "--train-iters (4) and --train-samples (80) both give the "
                               "training length; give one"),
        ("--split 90,x", "--split '90,x' must be up to three comma-separated non-negative "
                         "numbers, like '949,50,1'"),
        ("--num-attention-heads 3", "--hidden-size (32) must be divisible by "
                                    "--num-attention-heads (3), or set --kv-channels"),
        ("--tensor-model-parallel-size 2", "the world size (1) must be divisible by "
                                           "--tensor-model-parallel-size (2)"),
        ("--bogus 3", "unrecognized arguments: --bogus 3 (see --help)"),
        ("--seq-length x", "argument --seq-length: invalid int value: 'x' (see --help)"),
        (f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {tmp}/none.model",
         f"--tokenizer-model {tmp}/none.model: no such file"),
        (f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {tmp}/tok.vocab",
         f"--tokenizer-model {tmp}/tok.vocab is sentencepiece's vocabulary listing; give the "
         f"model file ({tmp}/tok.model)"),
        (f"--save {tmp}/file/run", f"--save {tmp}/file/run: {tmp}/file is a file, not a "
                                   f"directory; give a directory"),
        ("--no-position-embedding --position-embedding-type learned_absolute",
         "--no-position-embedding: is Megatron-LM's deprecated spelling, accepted only beside "
         "--position-embedding-type rope (no learned table to turn off)"),
        ("--fp8-format hybrid --fp8-output-proj", "--fp8-output-proj (True) needs --fp8-format "
                                                  "with --fp8-recipe 'mxfp8'"),
        ("--cuda-graph-impl local", "--cuda-graph-impl local: CUDA graph capture is not built"),
        ("--num-experts 4 --no-bias-gelu-fusion --moe-ncclep-zero-copy",
         "--moe-ncclep-zero-copy: the NCCL EP dispatcher's fixed receive buffers"),
        ("--use-nccl-ub", "--use-nccl-ub: it needs NCCL user-buffer"),
        ("--decoupled-min-lr 1e-4", "--decoupled-min-lr (0.0001) is the end of the decoupled "
                                    "learning rate's decay: add --decoupled-lr"),
        ("--num-experts 4 --no-bias-gelu-fusion --moe-router-load-balancing-type sinkhorn "
         "--moe-aux-loss-coeff 0.01",
         "--moe-router-load-balancing-type 'sinkhorn' balances without a loss, so "
         "--moe-aux-loss-coeff (0.01) must be 0"),
        ("--save-retain-interval 3", "--save-retain-interval (3) keeps the checkpoints at its "
                                     "multiples, so it must be a positive multiple of --save "
                                     "--save-interval N"),
        ("--error-injection-rate -1", "--error-injection-rate (-1) must be at least 0 (0: no "
                                      "injection)"),
        (f"--result-rejected-tracker-filename {tmp}/none/rejected.txt",
         f"--result-rejected-tracker-filename {tmp}/none/rejected.txt: cannot create it in "
         f"{tmp}/none (missing or not writable); give a file in a directory you can write"),
        ("--wandb-exp-name run1", "--wandb-exp-name is for the Weights & Biases run of "
                                  "--wandb-project; add --wandb-project NAME (or drop it)"),
    ]


def test_each_mistake_is_one_line_and_status_2(tmp_path):
    for flags, line in _mistakes(tmp_path):
        status, text = _main(f"{TRAIN} {flags}")
        assert status == 2, (flags, text)
        lines = text.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {line}"), (flags, text)


def test_every_mistake_in_one_command_is_reported_at_once(tmp_path):
    """The flags of all mistakes together (where they do not override each other): one line
    each, nothing else, and no process group was started."""
    import torch.distributed as dist
    # (the tokenizer pair and a bad --seq-length would replace the others' values; the model
    # config reports its first broken rule, so one model mistake goes in)
    mistakes = [m for m in _mistakes(tmp_path) if not m[0].startswith(
        ("--tokenizer-type", "--seq-length x", "--num-experts", "--fp8-format"))]
    status, text = _main(TRAIN + " " + " ".join(flags for flags, _ in mistakes))
    lines = text.splitlines()
    assert status == 2 and all(line.startswith("error: ") for line in lines), text
    for flags, line in mistakes:
        assert sum(printed.startswith(f"error: {line}") for printed in lines) == 1, (line, text)
    assert len(lines) == len(mistakes), text
    assert not dist.is_initialized()


@pytest.mark.parametrize("flags, line", [
    ("--tensor-model-parallel-size 0", "--tensor-model-parallel-size (0) must be an integer >= 1"),
    ("--context-parallel-size 0", "--context-parallel-size (0) must be an integer >= 1"),
    ("--pipeline-model-parallel-size 0", "--pipeline-model-parallel-size (0) must be an integer "
                                         ">= 1"),
    ("--num-experts 4 --no-bias-gelu-fusion --expert-model-parallel-size 0",
     "--expert-model-parallel-size (0) must be an integer >= 1"),
    ("--num-experts 4 --no-bias-gelu-fusion --expert-tensor-parallel-size 0",
     "--expert-tensor-parallel-size (0) must be an integer >= 1"),
    ("--num-distributed-optimizer-instances 0",
     "--num-distributed-optimizer-instances (0) must be an integer >= 1"),
])
def test_a_parallel_size_below_one_is_one_line(flags, line):
    """Every parallel size that must be >= 1: one line naming it, no traceback (a size of 0
    once reached the model's divisibility rules and divided by it)."""
    status, text = _main(f"{TRAIN} {flags}")
    assert status == 2 and text.splitlines() == [f"error: {line}"], (flags, text)


@pytest.mark.parametrize("flag", ["--num-layers-per-virtual-pipeline-stage",
                                  "--num-virtual-stages-per-pipeline-rank"])
def test_virtual_stages_below_one_are_one_line(flag):
    from megatron_cp.cli.arguments import ArgumentErrors, parse_args
    with pytest.raises(ArgumentErrors) as refused:  # two ranks, so PP 2 tiles the world
        parse_args(f"{TRAIN} --pipeline-model-parallel-size 2 {flag} 0".split(), world_size=2)
    assert refused.value.lines == [f"{flag} (0) must be >= 1"]


def test_two_bad_values_and_a_missing_flag_are_all_named():
    status, text = _main("--num-layers x --hidden-size 32 --num-attention-heads y "
                         "--seq-length 32")
    assert status == 2 and text.splitlines() == [
        "error: argument --num-layers: invalid int value: 'x' (see --help)",
        "error: argument --num-attention-heads: invalid int value: 'y' (see --help)",
        "error: the following arguments are required: --micro-batch-size (see --help)"]


def test_token_ids_beyond_the_vocabulary_stop_with_one_line(tmp_path):
    prefix = _corpus(tmp_path, 40, largest_id=250)
    argv = (TRAIN.replace("--mock-data", "") + f" --data-path {prefix} "
            "--tokenizer-type NullTokenizer --split 100,0,0")
    status, text = _main(argv)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert status == 2 and errors == [
        "error: the training data holds token id 250, but the tokenizer has 201 tokens "
        "(ids 0..200): tokenize the data with the tokenizer given here (NullTokenizer: "
        "--vocab-size at least 251)"], text
    assert "Traceback" not in text


def test_a_validation_split_left_empty_skips_evaluation(tmp_path):
    """--split gives validation a weight, but a small corpus leaves it no document: the run
    says evaluation is skipped and trains (it used to crash in evaluate())."""
    prefix = _corpus(tmp_path, 12)
    argv = (TRAIN.replace("--mock-data", "").replace("--eval-iters 0", "--eval-iters 2") +
            f" --eval-interval 2 --data-path {prefix} --tokenizer-type NullTokenizer "
            "--split 96,3,1")
    status, text = _main(argv)
    assert status == 0, text
    assert ("> no validation data (--split 96,3,1 leaves the validation split empty): "
            "evaluation is skipped") in text
    assert "iteration        4/       4" in text and "validation loss at" not in text


def _torchrun(*flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "pretrain_gpt.py", *TRAIN.split(), *flags],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout


def test_torchrun_summary_names_our_errors_as_the_root_cause():
    status, out = _torchrun("--lr-warmup-iters", "10", "--split", "a,b")
    assert status != 0
    root = out.split("Root Cause (first observed failure):")[1]
    assert re.search(r"error_file: \S+error\.json", root), out
    assert ("traceback : error: --lr-warmup-iters (10) must be smaller than --lr-decay-iters "
            "(4, default --train-iters)") in root, out
    assert "error: --split 'a,b' must be up to three" in root, out
    assert "To enable traceback" not in root, out


def test_missing_data_is_reported_with_the_other_mistakes_before_start(tmp_path):
    argv = (TRAIN.replace("--mock-data", "") + f" --data-path {tmp_path}/corpus "
            "--tokenizer-type NullTokenizer --log-interval 0")
    status, text = _main(argv)
    assert status == 2 and text.splitlines() == [
        "error: --log-interval (0) must be at least 1",
        f"error: --data-path {tmp_path}/corpus: {tmp_path}/corpus.bin and {tmp_path}/corpus.idx "
        "not found; build them with tools/preprocess_data.py (or examples/prepare_pydoc_data.sh)"]
