"""The Gated DeltaNet kernels against the token-by-token recurrence in fp64: the chunked
rule (chunk boundaries, incoming and outgoing state, packed documents) and the causal conv
(incoming tail, document restarts)."""
import torch
import torch.nn.functional as F

from megatron_cp.layers.gated_delta_rule import (causal_conv1d, chunk_gated_delta_rule,
                                                documents_from_cu_seqlens, l2norm,
                                                recurrent_gated_delta_rule)


def _inputs(b=2, s=37, h=3, dk=8, dv=6, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(b, s, h, dk, generator=gen, dtype=dtype))
    k = l2norm(torch.randn(b, s, h, dk, generator=gen, dtype=dtype))
    v = torch.randn(b, s, h, dv, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(b, s, h, generator=gen, dtype=dtype)) * 0.3  # mild decay: long memory
    beta = torch.rand(b, s, h, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _fp64(*xs):
    return [None if x is None else x.double() for x in xs]


def _docs(b, s):
    ids = torch.zeros(b, s, dtype=torch.long)
    ids[0, 5:], ids[0, 20:] = 1, 2  # a boundary inside a chunk and at position 20
    ids[1, 16:] = 1  # a boundary exactly at a chunk start (chunk 16 below)
    return ids


def test_chunked_equals_recurrence_fp64():
    q, k, v, g, beta = _inputs()
    state0 = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(1))
    from megatron_cp.layers.gated_delta_rule import torch_chunk_gated_delta_rule
    # chunks of 16 in spans of 1 and 2 chunks: document boundaries (5, 16, 20) fall inside a
    # chunk, on a chunk start and on a span start, and the state crosses the spans
    for docs in (None, _docs(2, 37)):
        for chunk, span in ((64, None), (16, 64), (16, 2), (16, 1)):
            out, final = chunk_gated_delta_rule(q, k, v, g, beta, state0, True, docs)
            if chunk != 64:
                out, final = torch_chunk_gated_delta_rule(q, k, v, g, beta, state0, True, docs,
                                                          chunk_size=chunk, span_chunks=span)
            ref, ref_final = recurrent_gated_delta_rule(*_fp64(q, k, v, g, beta, state0), True,
                                                        docs)
            # fp32 products over <= 64 tokens and dk terms: ~1e-6 relative
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(final.double(), ref_final, rtol=1e-5, atol=1e-5)


def test_chunked_gradients_equal_recurrence():
    q, k, v, g, beta = (x.double().requires_grad_() for x in _inputs(s=21))
    docs = _docs(2, 21)
    from megatron_cp.layers.gated_delta_rule import torch_chunk_gated_delta_rule
    ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta, None, False, docs)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, g, beta))
    for span in (64, 1):  # one span, and a span per chunk (the state crossing spans)
        out, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, None, False, docs, chunk_size=8,
                                              span_chunks=span)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, g, beta))
        for a, b in zip(grads, ref_grads):  # the chunked kernel computes in fp32
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_documents_are_independent_and_cu_seqlens_agree():
    """Each document computed alone gives the packed output: no state crosses a boundary."""
    q, k, v, g, beta = _inputs(b=1, s=40)
    cu = torch.tensor([0, 7, 29, 40])
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    docs = documents_from_cu_seqlens(cu, 40)
    same, _ = chunk_gated_delta_rule(q, k, v, g, beta, document_ids=docs)
    torch.testing.assert_close(packed, same, rtol=0, atol=0)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone, _ = chunk_gated_delta_rule(*(x[:, a:b] for x in (q, k, v, g, beta)))
        torch.testing.assert_close(packed[:, a:b], alone, rtol=1e-5, atol=1e-6)
    leaked, _ = chunk_gated_delta_rule(q, k, v, g, beta)  # one document: differs
    assert (leaked[:, 7:] - packed[:, 7:]).abs().max() > 1e-2


def test_state_carries_across_calls():
    """Two halves with the first half's final state = the whole (a CP wrapper's contract)."""
    q, k, v, g, beta = _inputs(s=50)
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    first, mid = chunk_gated_delta_rule(*(x[:, :23] for x in (q, k, v, g, beta)),
                                        output_final_state=True)
    second, end = chunk_gated_delta_rule(*(x[:, 23:] for x in (q, k, v, g, beta)), mid, True)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(end, final, rtol=1e-5, atol=1e-6)


def _conv_reference(x, weight, docs):
    """Each document convolved alone with nn.Conv1d's zero padding, then silu."""
    c, w = weight.shape[0], weight.shape[-1]
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        for d in docs[i].unique():
            idx = (docs[i] == d).nonzero().reshape(-1)
            seg = x[i, idx].t().unsqueeze(0)  # [1, c, len]
            y = F.conv1d(seg, weight, padding=w - 1, groups=c)[..., :len(idx)]
            out[i, idx] = F.silu(y[0].t())
    return out


def test_conv_documents_and_tail():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 30, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 1, 4, generator=gen, dtype=torch.float64)
    docs = _docs(2, 30)
    y, _ = causal_conv1d(x, weight, document_ids=docs)
    torch.testing.assert_close(y, _conv_reference(x, weight, docs))
    # split at 11 with the tail carried: the whole sequence's conv (one document)
    whole, tail = causal_conv1d(x, weight)
    a, mid = causal_conv1d(x[:, :11], weight)
    b, end = causal_conv1d(x[:, 11:], weight, initial_tail=mid)
    torch.testing.assert_close(torch.cat([a, b], 1), whole)
    torch.testing.assert_close(end, tail)
    torch.testing.assert_close(tail, x[:, -3:].transpose(1, 2))
    # a tail from another document is not seen by a sequence starting a new one
    _, last_tail = causal_conv1d(x[:, :21], weight, document_ids=docs[:, :21])
    assert (last_tail[0, :, :2] == 0).all()  # document 2 starts at 20: one token in the tail


def test_output_keeps_the_value_dtype():
    q, k, v, g, beta = _inputs(s=9)
    out, state = chunk_gated_delta_rule(q, k, v.bfloat16(), g, beta, output_final_state=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
