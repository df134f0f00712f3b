"""tools/run_text_generation.py: greedy generation from a checkpoint trained here equals Hugging
Face ``generate(do_sample=False)`` on the exported Llama model (token ids identical) at TP=1,
TP=2, PP=2 (also with virtual stages) and DP=2; the key/value cache gives the tokens and
logits of full recomputation; seeded sampling repeats; top-k / top-p on hand-made logits; the
position limit; one-line errors."""
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_workers
from inference_utils import ROOT, free_port, hf_model, trained_checkpoint
from megatron_cp.data.tokenizers import build_tokenizer
from megatron_cp.inference.generation import max_total_length
from megatron_cp.inference.sampling import SamplingParams, sample, top_k_filter, top_p_filter
from megatron_cp.model import GPTConfig
from tools.run_text_generation import (check_generation_args, get_generation_args, main,
                                       run_generation)

PROMPTS = ("The for statement", "Identifiers and keywords", "class", "If the value of")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("generation"))


def _argv(ck, extra=""):
    argv = f"--load {ck.load} --use-checkpoint-args --max-new-tokens {NEW_TOKENS} {extra}".split()
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    return argv


def _generate_all(rank, world, argvs):
    """Worker: run_generation for every argv (each in the layout its flags give)."""
    from megatron_cp.inference.launch import parse_inference_args
    from training_utils import parallel_state
    out = []
    for argv in argvs:
        args = parse_inference_args(argv, world, get_generation_args, check_generation_args)
        out.append(run_generation(args, parallel_state(args)))
    return out


def _cache_against_recompute(rank, world, ck_load):
    """Worker: per step logits with and without the cache (TP=world), and the tokens."""
    from megatron_cp.inference.generation import generate
    from megatron_cp.inference.kv_cache import KVCache, cached_chunk_forward
    from megatron_cp.inference.launch import load_model, parse_inference_args
    from training_utils import parallel_state
    argv = f"--load {ck_load} --use-checkpoint-args --prompt x --tensor-model-parallel-size {world}"
    args = parse_inference_args(argv.split(), world, get_generation_args, check_generation_args)
    model = load_model(args, parallel_state(args))
    ids = model.tokenizer.tokenize(" ".join(PROMPTS))
    prompt = torch.tensor([ids[3 * n:3 * n + 3] for n in range(4)])  # [4, 3]
    runs = [generate(model, prompt, 20, SamplingParams(greedy=True), use_cache=cache,
                     return_logits=True) for cache in (True, False)]
    # several new tokens at once after a cached prefix: each sees the prefix and its own past
    chunk, tokens = model.model_chunks[0], runs[0].tokens[:, :12]
    cache = KVCache(model.model_chunks, 12)
    positions = torch.arange(12).expand(4, 12)
    cached_chunk_forward(chunk, tokens[:, :5], positions[:, :5], None, cache.layers[0])
    pieces = cached_chunk_forward(chunk, tokens[:, 5:], positions[:, 5:], None, cache.layers[0])
    whole = chunk(tokens, positions)[-1:]  # [1, b, v/tp]
    return [(run.tokens, torch.stack(run.logits)) for run in runs] + [(pieces, whole)]


@pytest.fixture(scope="module")
def greedy(checkpoint):
    """{layout: results of the greedy run}."""
    out = {"tp1": run_workers(_generate_all, 1, [_argv(checkpoint, "--greedy")])[0][0]}
    layouts = {"tp2": "--tensor-model-parallel-size 2", "pp2": "--pipeline-model-parallel-size 2",
               "pp2_vp2": "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
               "dp2": "", "tp2_nocache": "--tensor-model-parallel-size 2 --no-kv-cache"}
    argvs = [_argv(checkpoint, f"--greedy {flags}") for flags in layouts.values()]
    for name, result in zip(layouts, run_workers(_generate_all, 2, argvs)[0]):
        out[name] = result
    return out


def test_greedy_equals_hugging_face_generate(checkpoint, greedy):
    tok = build_tokenizer("SentencePieceTokenizer", checkpoint.tokenizer)
    hf = hf_model(checkpoint.hf)
    for number, prompt in enumerate(PROMPTS):
        ids = tok.tokenize(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=tok.eod, pad_token_id=tok.eod)[0, len(ids):].tolist()
        expected = out[:out.index(tok.eod)] if tok.eod in out else out
        for layout, results in greedy.items():
            result = results[number]
            assert result["prompt"] == prompt and result["prompt_ids"] == ids
            assert result["ids"] == expected, (layout, prompt)
            assert result["text"] == tok.detokenize(expected)
    assert any(len(r["ids"]) == NEW_TOKENS for r in greedy["tp1"])  # not all stopped early


@pytest.mark.parametrize("world", [1, 2])
def test_kv_cache_equals_recomputation(checkpoint, world):
    (cached, cached_logits), (full, full_logits), (pieces, whole) = run_workers(
        _cache_against_recompute, world, checkpoint.load)[0]
    assert torch.equal(cached, full) and cached.shape == (4, 23)  # a batch of 4, 3 + 20 tokens
    torch.testing.assert_close(cached_logits, full_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)


def test_seeded_sampling_repeats(checkpoint):
    flags = "--temperature 1.5 --top-k 50 --top-p 0.95"
    argvs = [_argv(checkpoint, f"{flags} {seed}")
             for seed in ("--seed 3", "--seed 3", "--seed 4", "--seed 3 --no-kv-cache")]
    first, again, other, recomputed = run_workers(_generate_all, 1, argvs)[0]
    assert [r["ids"] for r in first] == [r["ids"] for r in again]
    assert [r["ids"] for r in first] != [r["ids"] for r in other]
    assert [r["ids"] for r in first] == [r["ids"] for r in recomputed]


def test_top_k_and_top_p_filters_on_hand_made_logits():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0], [0.5, 0.5, 2.0, -1.0, 0.5]])
    inf = float("-inf")
    assert torch.equal(top_k_filter(logits, 2), torch.tensor([[inf, 4.0, 3.0, inf, inf],
                                                              [0.5, 0.5, 2.0, inf, 0.5]]))  # ties kept
    assert torch.equal(top_k_filter(logits, 0), logits) and torch.equal(top_k_filter(logits, 9), logits)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    hand = probs.log()
    kept = lambda p: torch.isfinite(top_p_filter(hand, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]  # the first token alone reaches 0.5
    assert kept(0.51) == [True, True, False, False]
    assert kept(0.8) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(0.0) == kept(1.0) == [True] * 4
    shuffled = hand[:, [2, 0, 3, 1]]  # the filter follows the values, not the positions
    assert torch.isfinite(top_p_filter(shuffled, 0.7))[0].tolist() == [False, True, False, True]
    generator = torch.Generator().manual_seed(0)
    draws = [sample(logits, SamplingParams(top_k=1), generator).tolist() for _ in range(5)]
    assert draws == [[1, 2]] * 5  # top-k 1 is greedy
    assert sample(logits, SamplingParams(greedy=True)).tolist() == [1, 2]
    seen = {int(sample(hand, SamplingParams(top_p=0.8), generator)) for _ in range(200)}
    assert seen == {0, 1}
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_learned_positions_stop_at_the_table():
    config = GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10,
                       position_embedding_type="learned_absolute", max_position_embeddings=16)
    assert max_total_length(config, 10, 4) == 14
    assert max_total_length(config, 10, 100) == 16
    with pytest.raises(ValueError, match="learned position table has 16"):
        max_total_length(config, 17, 1)
    rope = GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10,
                     max_position_embeddings=16)
    assert max_total_length(rope, 10, 100) == 110


def test_command_line_prints_completions_and_one_line_errors(checkpoint, greedy, capsys):
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "run_text_generation.py"),
                           *_argv(checkpoint, "--greedy")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for number, prompt in enumerate(PROMPTS):
        assert f"----- prompt {number} -----\n{prompt}\n" in proc.stdout
        assert greedy["tp1"][number]["text"] in proc.stdout
    # another tokenizer than the checkpoint's: found at load time, still one line
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "run_text_generation.py"),
                           *_argv(checkpoint, "--tokenizer-type NullTokenizer --vocab-size 99")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "the tokenizer has 100 tokens but the checkpoint" in errors[0]
    base = ["--load", checkpoint.load, "--use-checkpoint-args"]
    cases = [(base, "--prompt"),
             (base + ["--prompt", "x", "--greedy", "--top-p", "0.9"], "--greedy"),
             (base + ["--prompt", "x", "--temperature", "0"], "--temperature (0.0) must be > 0"),
             (base + ["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens (0)"),
             (["--use-checkpoint-args", "--prompt", "x"], "--load")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (argv, err)
