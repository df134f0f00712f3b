"""Any checkpoint of ours, in any layout, everywhere: no conversion step.

- Training: a ``--ckpt-format torch`` checkpoint saved at TP2 x PP2 resumes at TP=1, at
  DP=2 with the distributed optimizer and at PP=2 with virtual stages, resharded on load:
  the weights, Adam state and schedule carry, so the straight run's losses follow (relative
  1e-5; a fresh Adam would change the second resumed loss). MoE (EP=2 -> EP=1):
  tests/checkpoint/test_moe_checkpoints.py.
- Generation and the WIKITEXT103 task: TP=2 checkpoints (the default torch_dist, and
  torch) run in ONE process with ``--load DIR --use-checkpoint-args`` and give the TP=2 run's
  tokens and loss; ``tools/run_text_generation.py`` on the torch one is the command line a
  user types.
- A Hugging Face Llama with fewer key/value heads than query heads, imported, generates with
  ``--use-checkpoint-args`` alone the tokens Hugging Face generates.
"""
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_workers
from inference_utils import ROOT, free_port
from training_utils import TINY, max_rel_diff, train_losses

MODEL = (TINY.replace("--num-layers 2", "--num-layers 4")
         + " --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights "
           "--group-query-attention --num-query-groups 2")
TP2_PP2 = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
PROMPTS = ("3 1 4 1 5", "9 2 6", "5 3 5 8 9 7")
NEW_TOKENS = 12


def _jobs(rank, world, jobs):
    return {name: fn(rank, world, *job_args) for name, (fn, *job_args) in jobs.items()}


def _infer(rank, world, load, text, extra=""):
    """Worker: the WIKITEXT103 result (tasks/main.py's code) and a greedy continuation of
    :data:`PROMPTS` with its logits (megatron_cp.inference, not stopping at the end of
    document, which this briefly trained model predicts first) from the checkpoint ``load``,
    in the layout ``extra`` names, the rest from the checkpoint."""
    from megatron_cp.inference.generation import generate
    from megatron_cp.inference.launch import load_model, parse_inference_args
    from megatron_cp.inference.sampling import SamplingParams
    from training_utils import parallel_state
    from tasks.main import check_task_args, get_tasks_args, run_task
    from tools.run_text_generation import check_generation_args, get_generation_args
    common = f"--load {load} --use-checkpoint-args {extra}".split()
    args = parse_inference_args(["--task", "WIKITEXT103", "--valid-data", text] + common, world,
                                get_tasks_args, check_task_args)
    task = run_task(args, parallel_state(args))
    args = parse_inference_args(common + ["--prompt", PROMPTS[0]], world, get_generation_args,
                                check_generation_args)
    model = load_model(args, parallel_state(args))
    prompt = torch.tensor([[int(x) for x in p.split()][:3] for p in PROMPTS])  # [3, 3]
    out = generate(model, prompt, NEW_TOKENS, SamplingParams(greedy=True), return_logits=True)
    return task, out.tokens, torch.stack(out.logits)  # [3, 3 + new], [new, 3, v]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    ck, dist, torch_ck = (str(tmp / name) for name in ("ck", "dist", "torch"))
    text = tmp / "heldout.txt"
    ids = torch.randint(0, 200, (160,), generator=torch.Generator().manual_seed(3))
    text.write_text(" ".join(map(str, ids.tolist())))
    tp2 = "--tensor-model-parallel-size 2"
    r4 = run_workers(_jobs, 4, {
        "straight": (train_losses, f"{MODEL} {TP2_PP2} --train-iters 6"),
        "first": (train_losses, f"{MODEL} {TP2_PP2} --train-iters 6 --exit-interval 3 "
                                f"--save {ck} --ckpt-format torch"),
        "dist": (train_losses, f"{MODEL} {tp2} --train-iters 3 --save {dist}"),  # the default
        "torch": (train_losses, f"{MODEL} {tp2} --train-iters 3 --save {torch_ck} "
                                f"--ckpt-format torch")}, timeout=400)[0]
    resumed = f"{MODEL} --train-iters 6 --load {ck}"
    r2 = run_workers(_jobs, 2, {
        "dp2_zero": (train_losses, f"{resumed} --use-distributed-optimizer"),
        "pp2_vp2": (train_losses, f"{resumed} --pipeline-model-parallel-size 2 "
                                  f"--num-layers-per-virtual-pipeline-stage 1"),
        "infer:dist:tp2": (_infer, dist, str(text), tp2),
        "infer:torch:tp2": (_infer, torch_ck, str(text), tp2)}, timeout=400)[0]
    r1 = run_workers(_jobs, 1, {
        "tp1": (train_losses, resumed),
        "infer:dist:tp1": (_infer, dist, str(text)),
        "infer:torch:tp1": (_infer, torch_ck, str(text))}, timeout=300)[0]
    return {"tmp": tmp, "text": str(text), **r4, **r2, **r1}


def test_a_saved_layout_is_the_torch_one(runs):
    """What the other tests load: torch files at TP2 x PP2 and TP2, DCP at TP2."""
    tmp = runs["tmp"]
    assert sorted(os.listdir(tmp / "ck" / "iter_0000003")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001", "rng"]
    assert sorted(n for n in os.listdir(tmp / "torch" / "iter_0000003")
                  if n.startswith("mp_")) == ["mp_rank_00", "mp_rank_01"]
    assert (tmp / "dist" / "iter_0000003" / ".metadata").exists()


@pytest.mark.parametrize("layout", ["tp1", "dp2_zero", "pp2_vp2"])
def test_torch_checkpoint_resumes_in_another_layout(runs, layout):
    straight = runs["straight"]
    assert len(straight) == 6 and len(runs["first"]) == 3
    assert max_rel_diff(runs["first"], straight[:3]) == 0
    assert max_rel_diff(runs[layout], straight[3:]) < 1e-5


@pytest.mark.parametrize("form", ["dist", "torch"])
def test_tp2_checkpoint_runs_in_one_process(runs, form):
    (task, tokens, logits) = runs[f"infer:{form}:tp1"]
    (task_tp2, tokens_tp2, logits_tp2) = runs[f"infer:{form}:tp2"]
    assert task["num_windows"] == task_tp2["num_windows"] > 1
    assert abs(task["total_loss"] - task_tp2["total_loss"]) / task_tp2["total_loss"] < 1e-5
    assert torch.equal(tokens, tokens_tp2) and tokens.shape == (3, 3 + NEW_TOKENS)
    torch.testing.assert_close(logits, logits_tp2, rtol=1e-5, atol=1e-5)


def _command_line(script, *argv):
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        env.pop(key, None)
    return subprocess.run([sys.executable, os.path.join(ROOT, *script), *argv],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_text_generation_command_line_on_a_tp2_torch_checkpoint(runs):
    """The command of the issue: it said 'saved under another parallel layout ... convert
    it'; now it generates in one process, and says that RNG states do not carry."""
    proc = _command_line(("tools", "run_text_generation.py"), "--load", str(runs["tmp"] / "torch"),
                         "--use-checkpoint-args", "--prompt", PROMPTS[0], "--greedy",
                         "--max-new-tokens", str(NEW_TOKENS))
    assert proc.returncode == 0, proc.stderr
    assert "----- completion 0 (" in proc.stdout
    assert "saved under another parallel layout: every rank reads it whole" in proc.stdout


def _hf_gqa_llama(folder):
    """A tiny random LlamaForCausalLM with 4 query heads over 2 key/value heads, saved."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False,
                         initializer_range=0.2)  # logits far apart: no near ties
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def _generate(rank, world, argv):
    from megatron_cp.inference.launch import parse_inference_args
    from training_utils import parallel_state
    from tools.run_text_generation import (check_generation_args, get_generation_args,
                                           run_generation)
    args = parse_inference_args(argv, world, get_generation_args, check_generation_args)
    seen = (args.num_query_groups, args.group_query_attention, args.seq_length)
    return seen, run_generation(args, parallel_state(args))


def test_hf_gqa_llama_import_loads_with_checkpoint_args(tmp_path):
    from tools import checkpoint_convert as convert
    hf = _hf_gqa_llama(str(tmp_path / "hf"))
    convert.main(["--from-hf", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ck")])
    # NullTokenizer: ids 0..94, 95 the end of document, the import's 96 rows
    argv = ["--load", str(tmp_path / "ck"), "--use-checkpoint-args", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "95", "--greedy", "--max-new-tokens", "8"]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    seen, results = run_workers(_generate, 1, argv)[0]
    assert seen == (2, True, 32)
    for prompt, result in zip(PROMPTS, results):
        ids = [int(x) for x in prompt.split()]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                              eos_token_id=95, pad_token_id=95)[0, len(ids):].tolist()
        assert result["ids"] == (out[:out.index(95)] if 95 in out else out), prompt
