"""Text generation and the WIKITEXT103 task on a Qwen3-Next hybrid (Gated DeltaNet + gated
attention, MoE with a gated shared expert) imported from transformers: greedy generation with
the recurrent GDN cache (conv tail + fp32 state per layer, megatron_cp/inference/gdn_cache.py)
gives the tokens and logits of recomputing the whole sequence, at TP=1 and TP=2, and the
tokens of transformers' ``generate``; the task's summed loss is transformers' cross entropy
over the same windows."""
import pytest
import torch

from dist_harness import run_workers
from inference_utils import imported_checkpoint
from model_utils import qwen3_next_hf_model

VOCAB = 120  # the tiny model's; NullTokenizer's --vocab-size is one less (it adds its EOD)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers model, our torch_dist checkpoint of it)."""
    hf, _, load = imported_checkpoint(tmp_path_factory.mktemp("qwen3_next"), qwen3_next_hf_model)
    return hf, load


def _args(load, world, extra, get_args, check_args):
    from megatron_cp.inference.launch import parse_inference_args
    argv = (f"--load {load} --use-checkpoint-args --tokenizer-type NullTokenizer "
            f"--vocab-size {VOCAB - 1} --tensor-model-parallel-size {world} {extra}")
    return parse_inference_args(argv.split(), world, get_args, check_args)


def _generate(rank, world, load, prompt):
    """Worker: greedy generation with and without the cache (tokens, per step full logits),
    and a cached prefix continued by several tokens at once against the whole forward."""
    from megatron_cp.inference.gdn_cache import GatedDeltaLayerCache
    from megatron_cp.inference.generation import generate
    from megatron_cp.inference.kv_cache import KVCache, cached_chunk_forward
    from megatron_cp.inference.launch import load_model
    from megatron_cp.inference.sampling import SamplingParams
    from training_utils import parallel_state
    from tools.run_text_generation import check_generation_args, get_generation_args
    args = _args(load, world, "--prompt x", get_generation_args, check_generation_args)
    model = load_model(args, parallel_state(args))
    runs = [generate(model, prompt, NEW_TOKENS, SamplingParams(greedy=True), use_cache=cache,
                     return_logits=True) for cache in (True, False)]
    chunk, tokens = model.model_chunks[0], runs[0].tokens  # [b, s]
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    cache = KVCache(model.model_chunks, s)
    cached_chunk_forward(chunk, tokens[:, :5], positions[:, :5], None, cache.layers[0])
    pieces = cached_chunk_forward(chunk, tokens[:, 5:], positions[:, 5:], None, cache.layers[0])
    # the control: the same continuation after the GDN layers forgot the prefix (tails and
    # states dropped), which is what a cache that lost its state would compute
    forgetful = KVCache(model.model_chunks, s)
    cached_chunk_forward(chunk, tokens[:, :5], positions[:, :5], None, forgetful.layers[0])
    for layer in forgetful.layers[0]:
        if isinstance(layer, GatedDeltaLayerCache):
            layer.conv_tail = layer.state = None
    forgot = cached_chunk_forward(chunk, tokens[:, 5:], positions[:, 5:], None,
                                  forgetful.layers[0])
    logits = chunk(tokens, positions)  # [s, b, v/tp]
    return [(run.tokens, torch.stack(run.logits)) for run in runs] + [
        (pieces, logits[-1:]), _rounding_scale(chunk, tokens, positions, logits), forgot]


def _rounding_scale(chunk, tokens, positions, logits):
    """How far this model's fp32 logits [s, b, v/tp] of ``tokens`` move when every weight
    moves by one rounding step (x (1 +- 2^-24), random signs): the spread any change of
    summation order may produce. This tiny model, moved far from its init, amplifies it a
    lot (transformers' own cached and full logits differ by up to ~3e-4), so a fixed
    tolerance would be a guess; a broken cache moves the logits by O(1)."""
    generator = torch.Generator().manual_seed(0)
    saved = [p.detach().clone() for p in chunk.parameters()]
    with torch.no_grad():
        for p in chunk.parameters():
            sign = torch.randint(0, 2, p.shape, generator=generator) * 2 - 1
            p.mul_(1 + sign * 2.0 ** -24)
        moved = chunk(tokens, positions)
        for p, old in zip(chunk.parameters(), saved):
            p.copy_(old)
    finite = torch.isfinite(logits)  # padded vocabulary entries are -inf (all of TP rank 1's)
    return torch.where(finite, moved - logits, 0.0).abs().max().item()


@pytest.mark.parametrize("world", [1, 2])
def test_cached_greedy_generation_equals_recomputation_and_transformers(imported, world):
    hf, load = imported
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    (cached, cached_logits), (full, full_logits), (pieces, whole), scale, forgot = run_workers(
        _generate, world, load, prompt)[0]
    assert cached.shape == (2, 6 + NEW_TOKENS) and torch.equal(cached, full)
    assert 0 < scale < 1e-2, scale  # rounding-level, far from a broken cache's O(1)
    torch.testing.assert_close(cached_logits, full_logits, rtol=0, atol=scale)
    torch.testing.assert_close(pieces, whole, rtol=0, atol=scale)
    finite = torch.isfinite(whole)
    assert (forgot - whole)[finite].abs().max() > 100 * scale  # the state is what it keeps
    with torch.no_grad():  # every token is real: no padding mask from a pad id
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert torch.equal(cached, theirs)


def _task_loss(rank, world, load, text):
    """Worker: tasks/main.py's WIKITEXT103 result on ``text``."""
    from training_utils import parallel_state
    from tasks.main import check_task_args, get_tasks_args, run_task
    args = _args(load, world, f"--task WIKITEXT103 --valid-data {text}", get_tasks_args,
                 check_task_args)
    return run_task(args, parallel_state(args))


def test_wikitext_task_gives_transformers_loss(imported, tmp_path):
    """100 tokens (NullTokenizer: the text is their ids) in windows of --seq-length 64 (the
    imported max_position_embeddings): window 1 scores labels 1..64 from tokens 0..63,
    window 2 labels 65..99 from tokens 64..98. transformers' summed cross entropy of those
    (fp64 from fp32 logits) equals the task's total loss within 1e-4 relative (the logits
    agree to ~1e-6; 99 terms)."""
    hf, load = imported
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(4))
    text = tmp_path / "heldout.txt"
    text.write_text(" ".join(map(str, ids.tolist())))
    ours = run_workers(_task_loss, 1, load, str(text))[0]
    assert ours["num_windows"] == 2
    loss = 0.0
    with torch.no_grad():
        for start in (0, 64):
            window = ids[start:start + 65]  # inputs and the label after each
            logits = hf(input_ids=window[None, :-1]).logits[0]  # [s, v]
            loss += torch.nn.functional.cross_entropy(logits.double(), window[1:],
                                                      reduction="sum").item()
    assert abs(ours["total_loss"] - loss) <= 1e-4 * loss, (ours["total_loss"], loss)
