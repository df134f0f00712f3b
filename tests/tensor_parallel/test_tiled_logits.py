"""--tiled-logits-chunk-size: the output layer and cross entropy over sequence chunks give the
untiled loss and gradients, under TP (vocab-parallel, with and without SP) and CP, and at
s = 8192 with a 32000 vocabulary the step's extra peak memory due to the vocabulary is at most
a quarter of s x v x 4 bytes (untiled it is about twice s x v x 4)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_harness import run_workers
from megatron_cp import tensor_parallel as tpar
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.observability.memory_peak import PeakMemory
from megatron_cp.model import GPTConfig, GPTModel
from model_utils import full_grads, tiny_config
from training_utils import TINY, assert_refused, max_rel_diff, train_losses


def close(actual, expected, what=""):
    """fp32 sums of up to a few thousand terms in another order: 1e-5 relative to the
    tensor's scale (a single rounding is 6e-8)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale + 1e-12,
                               msg=lambda m: f"{what}: {m}")


def test_tiled_function_equals_untiled_with_padded_vocabulary():
    """Chunks that do and do not divide s (1, 5, s, more than s); padded rows get no gradient."""
    gen = torch.Generator().manual_seed(0)
    s, b, h, rows, vocab = 37, 2, 8, 64, 50
    hidden = torch.randn(s, b, h, generator=gen, requires_grad=True)
    weight = torch.randn(rows, h, generator=gen, requires_grad=True)
    target = torch.randint(0, vocab, (s, b), generator=gen)
    weights = torch.rand(s, b, generator=gen)
    logits = tpar.mask_padded_vocab(F.linear(hidden, weight), vocab, None)
    ref = tpar.vocab_parallel_cross_entropy(logits, target, None)
    ref_grads = torch.autograd.grad((ref * weights).sum(), (hidden, weight))
    for chunk in (1, 5, s, 2 * s):
        loss = tpar.tiled_vocab_parallel_cross_entropy(hidden, weight, target, vocab, None, chunk)
        grads = torch.autograd.grad((loss * weights).sum(), (hidden, weight))
        close(loss, ref, f"loss chunk={chunk}")
        for name, got, want in zip(("hidden", "weight"), grads, ref_grads):
            close(got, want, f"grad {name} chunk={chunk}")
        assert grads[1][vocab:].abs().max() == 0


def test_tiled_function_in_bf16_keeps_dtypes_and_values():
    """bf16 weights: the chunk's logits in bf16 and the loss math in fp32, as untiled; the
    weight gradient sums its chunks in fp32 and rounds once (the untiled one rounds one big
    matmul), so the two differ by bf16 roundings: a few 2^-8 relative."""
    gen = torch.Generator().manual_seed(1)
    s, b, h, vocab = 64, 1, 16, 96
    hidden = torch.randn(s, b, h, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(vocab, h, generator=gen).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (s, b), generator=gen)
    ref = tpar.vocab_parallel_cross_entropy(F.linear(hidden, weight), target, None)
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight))
    loss = tpar.tiled_vocab_parallel_cross_entropy(hidden, weight, target, vocab, None, 10)
    grads = torch.autograd.grad(loss.sum(), (hidden, weight))
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.bfloat16] * 2
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=4 * 2 ** -8 * scale)


# ----- the first "done when" of issue 23: s = 8192, vocabulary 32000, one process ----------

SEQ, VOCAB, SMALL_VOCAB, CHUNK = 8192, 32000, 128, 512


def _long_step(vocab, chunk):
    """(per-token loss, {name: grad}, peak bytes) of forward + backward of a one-layer model
    with a tiny hidden size at s = SEQ; the weights depend on the seed only."""
    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                       vocab_size=vocab, max_position_embeddings=SEQ, hidden_dropout=0.0,
                       attention_dropout=0.0, seed=3, tiled_logits_chunk_size=chunk)
    model = GPTModel(config)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, vocab, (1, SEQ), generator=gen) for _ in range(2))
    position_ids = torch.arange(SEQ).unsqueeze(0)
    with PeakMemory("cpu", measure_baseline=False) as meter:
        loss = model(tokens, position_ids, labels=labels)
        loss.mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, meter.peak_bytes


def test_long_sequence_vocabulary_memory_and_exactness():
    budget = SEQ * VOCAB * 4 // 4
    loss, grads, peak = _long_step(VOCAB, CHUNK)
    small_peak = _long_step(SMALL_VOCAB, CHUNK)[2]
    ref_loss, ref_grads, ref_peak = _long_step(VOCAB, 0)
    ref_small_peak = _long_step(SMALL_VOCAB, 0)[2]
    # the meter sees the untiled logits (so the bound below is a real one)
    assert ref_peak - ref_small_peak > 1.5 * SEQ * VOCAB * 4, (ref_peak, ref_small_peak)
    assert peak - small_peak <= budget, (peak - small_peak, budget)
    close(loss, ref_loss, "loss")
    for name, grad in ref_grads.items():
        close(grads[name], grad, f"grad {name}")


# ----- layouts: TP (vocab-parallel, SP) and CP against one process, Megatron's defaults -------

# vocab 130 pads to 160 at TP=1 and to 192 at TP=2 (Megatron's divisible-by x TP rule), so the
# padded rows differ by layout; tied embeddings are Megatron's default.
LAYOUT_CONFIG = dict(vocab_size=130, make_vocab_size_divisible_by=32, max_position_embeddings=32)


def _batch(b=2, s=16, vocab=130):
    gen = torch.Generator().manual_seed(5)
    tokens, labels = (torch.randint(0, vocab, (b, s), generator=gen) for _ in range(2))
    return {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s), "document_ids": None}


def _layout_case(tp, cp, sp, untie):
    """The tiled model under TP=tp, CP=cp against the untiled one-process model: per-token
    losses and every gradient."""
    state = initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    kw = dict(LAYOUT_CONFIG, untie_embeddings_and_output_weights=untie)
    ref = GPTModel(tiny_config(**kw))
    model = GPTModel(tiny_config(**kw, sequence_parallel=sp, tiled_logits_chunk_size=3),
                     state=state)
    batch = _batch()
    weights = torch.linspace(0.5, 1.5, batch["tokens"].numel()).view_as(batch["tokens"])
    ref_loss = ref(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    (ref_loss * weights).sum().backward()
    mine = prepare_microbatch(dict(batch, weights=weights), state.rank("cp"), cp)
    loss = model(mine["tokens"], mine["position_ids"], labels=mine["labels"],
                 token_index=mine["token_index"])
    (loss * mine["weights"]).sum().backward()
    what = f"tp={tp} cp={cp} sp={sp} untie={untie}"
    index = mine["token_index"]
    close(loss, ref_loss if index is None else ref_loss.gather(1, index), f"{what} loss")
    got = full_grads(model, state.group("tp"))
    for name, p in ref.named_parameters():
        grad = got[name]
        if cp > 1:
            dist.all_reduce(grad, group=state.group("cp"))
        if grad.shape != p.grad.shape:  # a vocabulary-sized weight, padded differently
            vocab = LAYOUT_CONFIG["vocab_size"]
            assert grad[vocab:].abs().max() == 0 and p.grad[vocab:].abs().max() == 0, what
            grad, want = grad[:vocab], p.grad[:vocab]
        else:
            want = p.grad
        close(grad, want, f"{what} grad {name}")


def _layouts(rank, world):
    for untie in (False, True):
        _layout_case(2, 1, False, untie)
        _layout_case(2, 1, True, untie)
        _layout_case(1, 2, False, untie)
    return True


def test_tiled_loss_under_tp_sp_and_cp_matches_one_process():
    assert all(run_workers(_layouts, 2))


def test_flag_trains_the_same_losses():
    """--tiled-logits-chunk-size through the command line and the training loop: the same
    loss curve as the untiled run (the optimizer steps on the tiled gradients)."""
    argv = TINY + " --train-iters 3 --tiled-logits-chunk-size 7"
    reference = run_workers(train_losses, 1, TINY + " --train-iters 3")[0]
    tiled = run_workers(train_losses, 1, argv)[0]
    assert max_rel_diff(tiled, reference) < 1e-5, (tiled, reference)


def test_negative_chunk_size_is_refused():
    assert_refused(TINY + " --train-iters 1 --tiled-logits-chunk-size -1",
                   "--tiled-logits-chunk-size (-1) must be >= 0")


def test_mup_output_multiplier_is_refused():
    """The tiled loss computes plain logits; muP scales them (1/width here), so the pair is
    refused rather than trained with the wrong logits."""
    assert_refused(TINY + " --train-iters 1 --tiled-logits-chunk-size 4 --use-mup "
                          "--mup-base-hidden-size 16",
                   "--tiled-logits-chunk-size (4) does not apply muP's output multiplier")
