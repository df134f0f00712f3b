"""The GPT model under TP (with and without SP, with GQA) against the TP=1 model: logits and
every gradient; plus single-process behaviour (packed documents, recomputation)."""
import torch

from dist_harness import run_workers
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTModel
from megatron_cp.tensor_parallel import gather_from_tensor_model_parallel_region
from model_utils import full_grads, tiny_config

close = torch.testing.assert_close

CONFIGS = {
    "mha_gelu_layernorm_rope_tied": dict(),
    "gqa_swiglu_rmsnorm_learned_untied_nobias": dict(
        num_attention_heads=8, num_query_groups=4, activation="swiglu", normalization="RMSNorm",
        position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=True,
        add_bias_linear=False),
}


def _batch(b=2, s=16, vocab=120, docs=False):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (b, s), generator=gen)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    if not docs:
        return tokens, torch.arange(s).expand(b, s), labels, None
    document_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * (s - 12), [0] * 3 + [1] * (s - 3)])
    position_ids = torch.stack([torch.cat([torch.arange((row == d).sum()) for d in row.unique()])
                                for row in document_ids])
    return tokens, position_ids, labels, document_ids


def _compare(rank, world, tp, sp, name, docs):
    config_kw = dict(CONFIGS[name], sequence_parallel=sp)
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    tokens, pos, labels, doc = _batch(docs=docs)
    ref = GPTModel(tiny_config(**config_kw))
    model = GPTModel(tiny_config(**config_kw), state=state)
    # logits: gather the vocab shards and compare to the TP=1 model
    logits = gather_from_tensor_model_parallel_region(model(tokens, pos, document_ids=doc),
                                                      state.group("tp"))
    close(logits, ref(tokens, pos, document_ids=doc))
    loss = model(tokens, pos, labels=labels, document_ids=doc)
    loss_ref = ref(tokens, pos, labels=labels, document_ids=doc)
    close(loss, loss_ref)
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    (loss_ref * weights).sum().backward()
    got = full_grads(model, state.group("tp"))
    for pname, p in ref.named_parameters():
        close(got[pname], p.grad, msg=lambda m: f"{name} tp={tp} sp={sp} grad {pname}: {m}")
    return True


def _all_cases(rank, world):
    for tp in sorted({2, world}):
        for sp in (False, True):
            for name in CONFIGS:
                _compare(rank, world, tp, sp, name, docs=(sp and tp == world))
    return True


def test_gpt_tp2_tp4_sp_gqa_match_tp1():
    assert all(run_workers(_all_cases, 4))


def test_packed_documents_attend_within_document():
    """A packed sample gives each document the loss it has when run alone."""
    config = tiny_config()
    model = GPTModel(config)
    tokens, pos, labels, doc = _batch(b=1, s=16, docs=True)
    tokens, pos, labels, doc = tokens[:1], pos[:1], labels[:1], doc[:1]
    packed = model(tokens, pos, labels=labels, document_ids=doc)
    for d in doc.unique():
        sel = doc[0] == d
        alone = model(tokens[:, sel], pos[:, sel], labels=labels[:, sel])
        close(packed[:, sel], alone)


def test_recompute_gives_same_grads():
    tokens, pos, labels, _ = _batch()
    grads = []
    for kw in (dict(), dict(recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1),
               dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
               dict(recompute_granularity="selective")):
        model = GPTModel(tiny_config(hidden_dropout=0.1, attention_dropout=0.1, **kw))
        torch.manual_seed(3)
        model(tokens, pos, labels=labels).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for other in grads[1:]:
        for n in grads[0]:
            close(other[n], grads[0][n])


def test_vocabulary_padding_never_changes_the_model():
    """513 real entries padded to 640 or to 1024 (what TP=1 and TP=8 pad to): the same real
    rows, zero padded rows, -inf padded logits, the same loss, and no gradient on padding."""
    tokens, positions, labels, _ = _batch(vocab=513)
    out = {}
    for divisible_by, untied in ((128, False), (1024, False), (128, True), (1024, True)):
        config = tiny_config(vocab_size=513, make_vocab_size_divisible_by=divisible_by,
                             untie_embeddings_and_output_weights=untied,
                             position_embedding_type="learned_absolute")
        model = GPTModel(config)
        weights = [model.embedding.word_embeddings.weight]
        if untied:
            weights.append(model.output_layer.weight)
        for weight in weights:
            assert weight.shape[0] == (640 if divisible_by == 128 else 1024)
            assert (weight[513:] == 0).all()
        with torch.no_grad():
            logits = model(tokens, positions)  # [s, b, padded]
        assert torch.isinf(logits[..., 513:]).all() and torch.isfinite(logits[..., :513]).all()
        loss = model(tokens, positions, labels=labels).sum()
        loss.backward()
        for weight in weights:
            assert (weight.grad[513:] == 0).all()
        out[divisible_by, untied] = (loss.detach(), logits[..., :513],
                                     [w.detach()[:513] for w in weights])
    for untied in (False, True):
        a, b = out[128, untied], out[1024, untied]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for wa, wb in zip(a[2], b[2]):
            assert torch.equal(wa, wb)
