"""tasks/main.py: zero-shot WIKITEXT103 perplexity and LAMBADA accuracy of a checkpoint trained
here, under TP=1, TP=2 (with and without sequence parallelism), PP=2 (also with two virtual
stages per rank), CP=2 and DP=2, equal to
Hugging Face Llama computing the same windows and the same greedy predictions on the
exported model; the windowing, the LAMBADA targets and the one-line errors."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_workers
from inference_utils import ROOT, free_port, hf_model, trained_checkpoint
from megatron_cp.data.tokenizers import build_tokenizer
from tasks.main import check_task_args, get_tasks_args, main, run_task
from tasks.zeroshot.datasets import (lambada_tokens, lm_windows, wikitext_detokenize,
                                     wikitext_tokens, window_sample)

LAYOUTS_2 = ("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 2 --sequence-parallel",
             "--pipeline-model-parallel-size 2",
             "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
             "--context-parallel-size 2", "")  # "" : DP=2
STRIDE = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("tasks"))


def _task_argvs(ck, layout, load=None):
    common = f"--load {load or ck.load} --use-checkpoint-args --micro-batch-size 2 {layout}".split()
    return [["--task", "WIKITEXT103", "--valid-data", ck.text, "--overlapping-eval", str(STRIDE)]
            + common,
            ["--task", "WIKITEXT103", "--valid-data", ck.text] + common,
            ["--task", "LAMBADA", "--valid-data", ck.lambada] + common,
            ["--task", "LAMBADA", "--valid-data", ck.lambada, "--strict-lambada"] + common]


def _run_tasks(rank, world, argvs):
    """Worker: every task run of ``argvs`` (each in the layout its flags give)."""
    from megatron_cp.inference.launch import parse_inference_args
    from training_utils import parallel_state
    results = []
    for argv in argvs:
        args = parse_inference_args(argv, world, get_tasks_args, check_task_args)
        results.append(run_task(args, parallel_state(args)))
    return results


@pytest.fixture(scope="module")
def torch_tp2(checkpoint):
    """The checkpoint converted to the torch format at TP=2 (its own layout; any other
    reshards it on load)."""
    from tools import checkpoint_convert as convert
    path = os.path.join(os.path.dirname(checkpoint.load), "torch_tp2")
    convert.main(["--load-dir", checkpoint.load, "--save-dir", path,
                  "--target-tensor-parallel-size", "2"])
    return path


@pytest.fixture(scope="module")
def results(checkpoint, torch_tp2):
    """{layout: [wikitext strided, wikitext, lambada, lambada strict]}; "tp1" runs alone,
    "torch_tp2" reads the torch-format TP=2 checkpoint."""
    out = {"tp1": run_workers(_run_tasks, 1, _task_argvs(checkpoint, ""))[0]}
    argvs = [argv for layout in LAYOUTS_2 for argv in _task_argvs(checkpoint, layout)]
    argvs += _task_argvs(checkpoint, "--tensor-model-parallel-size 2", torch_tp2)
    flat = run_workers(_run_tasks, 2, argvs, timeout=400)[0]
    for i, layout in enumerate(LAYOUTS_2 + ("torch_tp2",)):
        out[layout or "dp2"] = flat[4 * i:4 * i + 4]
    return out


def _hf_window_losses(hf, tokens, seq_length, stride):
    """Total loss (float64) of the scored labels of every window, by Hugging Face Llama."""
    total = 0.0
    for start, first, end in lm_windows(len(tokens), seq_length, stride):
        sample = window_sample(tokens, start, first, end, seq_length)
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([sample["tokens"]])).logits[0]  # [s, v]
        nll = -torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(sample["labels"])),
                                                           torch.tensor(sample["labels"])]
        total += float((nll * torch.tensor(sample["loss_mask"], dtype=torch.float64)).sum())
    return total


def test_wikitext_perplexity_matches_hugging_face(checkpoint, results):
    tok = build_tokenizer("SentencePieceTokenizer", checkpoint.tokenizer)
    tokens, num_words = wikitext_tokens(checkpoint.text, tok)
    hf = hf_model(checkpoint.hf)
    for index, stride in ((0, STRIDE), (1, 64)):
        reference = _hf_window_losses(hf, tokens, 64, stride)
        ours = results["tp1"][index]
        assert ours["num_tokenized_tokens"] == len(tokens) and ours["num_original_tokens"] == num_words
        assert abs(ours["total_loss"] - reference) / reference < 1e-5
        hf_ppl = math.exp(reference / (len(tokens) - 1))
        assert abs(ours["ppl"] - hf_ppl) / hf_ppl < 1e-4
        assert ours["adjusted_ppl"] == pytest.approx(math.exp(reference / (num_words - 1)), rel=1e-4)
        assert ours["token_ratio"] == pytest.approx((len(tokens) - 1) / (num_words - 1))
    # overlapping windows give every token more context: a lower loss on this model
    assert results["tp1"][0]["avg_loss"] < results["tp1"][1]["avg_loss"]
    assert results["tp1"][0]["num_windows"] > results["tp1"][1]["num_windows"]


@pytest.mark.parametrize("layout", [layout or "dp2" for layout in LAYOUTS_2 + ("torch_tp2",)])
def test_every_layout_gives_the_same_results(results, layout):
    for ours, reference in zip(results[layout], results["tp1"]):
        if ours["task"] == "WIKITEXT103":
            assert ours["num_windows"] == reference["num_windows"]
            assert abs(ours["total_loss"] - reference["total_loss"]) / reference["total_loss"] < 1e-5
        else:
            assert ours["predictions"] == reference["predictions"]
            assert ours["num_correct"] == reference["num_correct"]


def test_lambada_matches_hugging_face_greedy(checkpoint, results):
    tok = build_tokenizer("SentencePieceTokenizer", checkpoint.tokenizer)
    hf = hf_model(checkpoint.hf)
    passages = [json.loads(line)["text"] for line in open(checkpoint.lambada, encoding="utf-8")]
    for ours, strict in ((results["tp1"][2], False), (results["tp1"][3], True)):
        assert ours["num_examples"] == len(passages) and ours["strict"] == strict
        for i, passage in enumerate(passages):
            context, target = lambada_tokens(passage, tok, strict)
            assert ours["targets"][i] == target
            ids = torch.tensor([(context + target)[-65:]])  # a long passage keeps its end
            context_length = ids.shape[1] - len(target)
            with torch.no_grad():
                argmax = hf(input_ids=ids[:, :-1]).logits[0, -len(target):].argmax(-1).tolist()
                greedy = hf.generate(ids[:, :context_length], max_new_tokens=len(target),
                                     do_sample=False, pad_token_id=tok.eod)
            assert ours["predictions"][i] == argmax, (i, passage)
            assert ours["correct"][i] == (greedy[0, context_length:].tolist() == target)
        assert ours["accuracy"] == sum(ours["correct"]) / len(passages)
    assert results["tp1"][2]["num_correct"] > 0  # passages seen in training are completed


def test_lm_windows_score_every_token_once_with_enough_context():
    for num_tokens, seq_length, stride in ((2, 8, 8), (9, 8, 8), (10, 8, 8), (100, 8, 3),
                                           (57, 16, 1), (17, 16, 16), (33, 16, 5)):
        scored = []
        windows = lm_windows(num_tokens, seq_length, stride)
        for k, (start, first, end) in enumerate(windows):
            assert start == k * stride and 0 <= first < end <= seq_length
            assert first == 0 if k == 0 else first >= seq_length - stride  # context kept
            scored += [start + j + 1 for j in range(first, end)]  # the predicted tokens
        assert scored == list(range(1, num_tokens)), (num_tokens, seq_length, stride)
    tokens = list(range(20))
    sample = window_sample(tokens, 4, 5, 8, 8)
    assert sample["tokens"] == list(range(4, 12)) and sample["labels"] == list(range(5, 13))
    assert sample["loss_mask"] == [0.0] * 5 + [1.0] * 3
    with pytest.raises(ValueError, match="overlapping-eval"):
        lm_windows(100, 8, 9)


def test_wikitext_detokenizer_and_word_count(tmp_path):
    raw = (" = Valkyria Chronicles III = \n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese "
           ": 戦場のヴァルキュリア3 ) , is a tactical role @-@ playing game , sold 1 @,@ 000 @.@ 5 "
           "copies . It 's \" great \" . \n")
    text = wikitext_detokenize(raw)
    assert "role-playing game, sold 1,000.5 copies. It's \"great\"." in text
    assert "3: Unrecorded Chronicles (Japanese: 戦場のヴァルキュリア3), is" in text
    path = tmp_path / "wiki.txt"
    path.write_text(raw, encoding="utf-8")
    tok = build_tokenizer("NullTokenizer", vocab_size=10)
    path.write_text("3 1 4 1 5 9 2 6", encoding="utf-8")
    tokens, words = wikitext_tokens(str(path), tok)
    assert tokens == [3, 1, 4, 1, 5, 9, 2, 6] and words == 8


def test_lambada_targets_strict_and_tokenizer_split(checkpoint):
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert lambada_tokens("3 1 4 15", null, strict=True) == ([3, 1, 4], [15])
    assert lambada_tokens("3 1 4 15", null, strict=False) == ([3, 1, 4], [15])
    spm = build_tokenizer("SentencePieceTokenizer", checkpoint.tokenizer)
    passage = "the value of the expression is returned by the generator"
    context, target = lambada_tokens(passage, spm, strict=True)
    assert spm.detokenize(target).strip() == "generator"
    assert context == spm.tokenize("the value of the expression is returned by the")
    context, target = lambada_tokens(passage, spm, strict=False)
    assert context + target == spm.tokenize(passage)
    assert spm.detokenize(target).strip().endswith("generator")
    assert not spm.detokenize(target[1:]).strip().endswith("generator")  # the shortest run


def _run_main(*argv):
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tasks", "main.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_command_line_prints_results_and_one_line_errors(checkpoint, torch_tp2, tmp_path, capsys):
    proc = _run_main("--task", "WIKITEXT103", "--valid-data", checkpoint.text, "--load",
                     checkpoint.load, "--use-checkpoint-args")
    assert proc.returncode == 0, proc.stderr
    assert "token-level ppl" in proc.stdout and "word-level (adjusted) ppl" in proc.stdout
    # a torch checkpoint saved at TP=2 runs in one process too: resharded on load
    proc = _run_main("--task", "LAMBADA", "--valid-data", checkpoint.lambada, "--load", torch_tp2,
                     "--use-checkpoint-args")
    assert proc.returncode == 0, proc.stderr
    assert "LAMBADA | number correct" in proc.stdout
    assert "saved under another parallel layout" in proc.stdout
    base = ["--load", checkpoint.load, "--use-checkpoint-args"]
    cases = [
        (["--valid-data", checkpoint.text] + base, "--task"),
        (["--task", "WIKITEXT103"] + base, "--valid-data FILE"),
        (["--task", "WIKITEXT103", "--valid-data", str(tmp_path / "missing.txt")] + base,
         "no such file"),
        (["--task", "WIKITEXT103", "--valid-data", checkpoint.text, "--overlapping-eval", "65"]
         + base, "--overlapping-eval (65) must lie in [1, --seq-length (64)]"),
        (["--task", "WIKITEXT103", "--valid-data", checkpoint.text, "--strict-lambada"] + base,
         "--strict-lambada applies to --task LAMBADA"),
        (["--task", "LAMBADA", "--valid-data", checkpoint.text, "--use-checkpoint-args"],
         "--load"),
        (["--task", "LAMBADA", "--valid-data", checkpoint.text, "--load", str(tmp_path)]
         + base[2:], "no checkpoint"),
        (["--task", "PIQA", "--valid-data", checkpoint.text] + base, "invalid choice"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (argv, err)
