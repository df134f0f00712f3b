"""The segment planner, segment-plan execution and the local packed path, on one process.

- Planner: segments of hand-made blocks (causal diagonals, full blocks, partial overlaps,
  merging of touching full segments, documents split across zigzag chunks, empty blocks).
- Execution: every block of prepare_microbatch's zigzag layouts (plain and packed, CP 2 and
  4, short documents with one-token chunks) and of random layouts (shuffled tokens, random
  documents, GQA, b = 2) through block_forward / block_backward with both kernels ("auto":
  CPU flash per segment; "torch": plain PyTorch) against a masked fp32 reference: out, lse
  and dq, dk, dv, rows without a key included.
- Local path (no CP) with packed documents: forward and grads against reference_attention.
- The kernel choice API, and the CUDA-only glue run on the meta device (shapes and argument
  plumbing of the flash / varlen / memory-efficient calls; the numbers need a GPU).
"""
import pytest
import torch

from megatron_cp.context_parallel import (AttentionKernel, ContextParallelAttention,
                                          attention_kernel, attention_mask, block_backward,
                                          block_forward, classify_block, local_attention,
                                          masked_attention, plan_segments, reference_attention)
from megatron_cp.context_parallel import cuda_kernels, kernels
from megatron_cp.context_parallel.blockwise import segments_backward, segments_forward
from megatron_cp.data.microbatch import prepare_microbatch
from test_context_parallel_partition import DOC_LENGTHS, make_batch

TOL = dict(rtol=1e-5, atol=1e-5)
KERNELS = ("auto", "torch")


def _t(rows):
    return torch.tensor(rows, dtype=torch.int64)


# ----------------------------------------------------------------------------- planner
def test_classify_simple_blocks():
    arange = _t([[0, 1, 2, 3]])
    assert classify_block(arange, arange) == ("causal", None)
    assert classify_block(arange + 4, arange) == ("full", None)  # every key before every query
    assert classify_block(arange, arange + 4)[0] == "empty"
    one_doc = _t([[7, 7, 7, 7]])
    assert classify_block(arange, arange, one_doc, one_doc) == ("causal", None)  # docs irrelevant


def test_segments_of_hand_made_blocks():
    def plan(tq, tk, dq=None, dk=None):
        kind, segments = classify_block(_t(tq), _t(tk), None if dq is None else _t(dq),
                                        None if dk is None else _t(dk))
        return kind, segments.as_tuples() if segments is not None else None

    # Three documents of one sample: one causal diagonal each (a length-1 document too).
    docs = [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert plan([list(range(8))], [list(range(8))], docs, docs) == (
        "segments", [("causal", 0, 3, 0, 3), ("causal", 3, 4, 3, 4), ("causal", 7, 1, 7, 1)])
    # Zigzag diagonal, one document: both chunks causal, the late chunk sees the early one.
    assert plan([[0, 1, 6, 7]], [[0, 1, 6, 7]]) == (
        "segments", [("causal", 0, 2, 0, 2), ("causal", 2, 2, 2, 2), ("full", 2, 2, 0, 2)])
    # CP=4 zigzag of a 16-token document, ranks 2 (tokens 4,5,10,11) and 0 (0,1,14,15):
    # touching full segments merge along the queries (j < i) and along the keys (j > i).
    assert plan([[4, 5, 10, 11]], [[0, 1, 14, 15]]) == ("segments", [("full", 0, 4, 0, 2)])
    assert plan([[0, 1, 14, 15]], [[4, 5, 10, 11]]) == ("segments", [("full", 2, 2, 0, 4)])
    # Partial overlap of one query run (3..6) and one key run (1..4): keys before (full),
    # the overlap 3..4 (causal), queries after the overlap against it (full).
    assert plan([[3, 4, 5, 6]], [[1, 2, 3, 4]]) == (
        "segments", [("causal", 0, 2, 2, 2), ("full", 0, 4, 0, 2), ("full", 2, 2, 2, 2)])
    # A document split across chunks; another document's queries see none of its keys.
    assert plan([[2, 3, 8, 9]], [[0, 1, 10, 11]], [[0, 0, 1, 1]], [[0, 0, 1, 1]]) == (
        "segments", [("full", 0, 2, 0, 2)])
    assert plan([[2, 3]], [[0, 1]], [[1, 1]], [[0, 0]])[0] == "empty"
    # Two samples: flat rows (sample n, position i) -> n * s + i; keys likewise.
    assert plan([[0, 1], [0, 1]], [[0, 1], [0, 1]], [[0, 1], [0, 0]], [[0, 1], [0, 0]]) == (
        "segments", [("causal", 0, 1, 0, 1), ("causal", 1, 1, 1, 1), ("causal", 2, 2, 2, 2)])


def test_segment_calls_pack_rows_and_lengths():
    docs = _t([[0, 0, 0, 1, 1, 1, 1, 2]])
    plan = plan_segments(torch.arange(8)[None], torch.arange(8)[None], docs, docs)
    (call,) = plan.calls
    assert call.causal and call.q_identity and call.k_identity and call.q_unique
    assert call.cu_q.tolist() == [0, 3, 7, 8] and call.cu_q.dtype == torch.int32
    assert (call.max_q, call.max_k) == (4, 4)
    plan = plan_segments(_t([[0, 1, 14, 15]]), _t([[4, 5, 10, 11]]))
    (call,) = plan.calls
    assert not call.causal and call.q_rows.tolist() == [2, 3] and call.k_identity
    assert call.bounds() == [((0, 2), (0, 4))]


# ----------------------------------------------------------------------------- execution
def _block_reference(q, k, v, tq, tk, dq, dk, scale):
    """Masked fp32 attention of one block (autograd-safe on empty rows) and its lse."""
    b, nh, sq, d = q.shape
    nkv = k.shape[1]
    qf = q.float().view(b, nkv, nh // nkv, sq, d)  # [b, nkv, g, sq, d]
    scores = torch.einsum("bkgqd,bksd->bkgqs", qf, k.float()) * scale  # [b, nkv, g, sq, sk]
    scores = scores.masked_fill(~attention_mask(tq, tk, dq, dk)[:, :, None], float("-inf"))
    with torch.no_grad():
        lse = scores.logsumexp(-1).reshape(b, nh, sq)
        peak = scores.amax(-1, keepdim=True)
        peak = peak.masked_fill(torch.isinf(peak), 0.0)
    expo = torch.exp(scores - peak)
    denom = expo.sum(-1, keepdim=True)
    probs = expo / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("bkgqs,bksd->bkgqd", probs, v.float()).reshape(b, nh, sq, d)
    return out, lse


def _check_block(tq, tk, dq, dk, nh=4, nkv=2, d=8, seed=0, name="", dtype=torch.float32,
                 tol=TOL):
    b, sq, sk = tq.shape[0], tq.shape[1], tk.shape[1]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, nkv, sk, d, generator=gen).to(dtype)
    v = torch.randn(b, nkv, sk, d, generator=gen).to(dtype)
    dout = torch.randn(b, nh, sq, d, generator=gen).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _block_reference(*leaves, tq, tk, dq, dk, 0.3)
    ref_grads = torch.autograd.grad((ref_out * dout).sum(), leaves)
    kind, plan = classify_block(tq, tk, dq, dk)
    for kernel in KERNELS:
        out, lse = block_forward(q, k, v, 0.3, kind, plan, kernel)
        grads = block_backward(dout, q, k, v, out, lse, 0.3, kind, plan, kernel)
        msg = f"{name} kind={kind} kernel={kernel}"
        torch.testing.assert_close(out.float(), ref_out, **tol, msg=lambda m: f"{msg} out: {m}")
        torch.testing.assert_close(lse, ref_lse, **tol, msg=lambda m: f"{msg} lse: {m}")
        for what, got, want in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(got, want.to(dtype).float(), **tol,
                                       msg=lambda m, w=what: f"{msg} d{w}: {m}")
    return kind


@pytest.mark.parametrize("cp_size,docs", [(2, False), (2, True), (4, True), (2, "short")])
def test_zigzag_blocks_match_reference(cp_size, docs):
    """Every (query rank, key rank) block of prepare_microbatch's layout."""
    if docs == "short":  # documents of 1..4 tokens: one-token chunks at CP=2
        batch = make_batch(seq_len=16, doc_lengths=([1, 4, 2, 3, 1, 5], [3, 1, 1, 11]))
    elif docs:
        batch = make_batch(doc_lengths=DOC_LENGTHS)
    else:
        batch = make_batch(seq_len=32)
    parts = [prepare_microbatch(batch, r, cp_size) for r in range(cp_size)]
    kinds = set()
    for i, mine in enumerate(parts):
        for j, theirs in enumerate(parts):
            kinds.add(_check_block(mine["token_index"], theirs["token_index"],
                                   mine["document_ids"], theirs["document_ids"],
                                   seed=i * cp_size + j, name=f"cp={cp_size} {i}<-{j}"))
    assert "segments" in kinds


def test_random_blocks_match_reference():
    """Shuffled tokens, random documents (lengths from 1), GQA 4/1 and MHA, b = 2."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(12):
        universe = 24
        lengths = torch.randint(1, 7, (2, universe), generator=gen)
        docs_all = torch.stack([torch.repeat_interleave(torch.arange(universe), row)[:universe]
                                for row in lengths])  # [2, universe]
        pick_q = torch.stack([torch.randperm(universe, generator=gen)[:10] for _ in range(2)])
        pick_k = pick_q if trial % 3 == 0 else \
            torch.stack([torch.randperm(universe, generator=gen)[:13] for _ in range(2)])
        if trial % 4 == 1:  # sorted selections: long runs, causal and full segments
            pick_q, pick_k = pick_q.sort(1).values, pick_k.sort(1).values
        dq, dk = docs_all.gather(1, pick_q), docs_all.gather(1, pick_k)
        if trial % 5 == 4:
            dq = dk = None
        nh, nkv = (4, 1) if trial % 2 else (2, 2)
        _check_block(pick_q, pick_k, dq, dk, nh=nh, nkv=nkv, seed=trial, name=f"trial {trial}")


def test_bf16_blocks_and_plan_memo():
    """bf16 document blocks (both kernels) against the fp32 reference; equal metadata gets
    the same plan object back (every layer after the first looks its plans up)."""
    parts = [prepare_microbatch(make_batch(doc_lengths=DOC_LENGTHS), r, 2) for r in range(2)]
    meta = [(p["token_index"], p["document_ids"]) for p in parts]
    for i, j in ((0, 0), (1, 0), (0, 1)):
        _check_block(meta[i][0], meta[j][0], meta[i][1], meta[j][1], d=16, dtype=torch.bfloat16,
                     tol=dict(rtol=3e-2, atol=3e-2), name=f"bf16 {i}<-{j}")
    first = classify_block(meta[1][0], meta[0][0], meta[1][1], meta[0][1])
    again = classify_block(meta[1][0].clone(), meta[0][0].clone(), meta[1][1].clone(),
                           meta[0][1].clone())
    assert first[1] is not None and again[1] is first[1]
    other = classify_block(meta[1][0], meta[0][0], meta[1][1], meta[0][1] + 1)  # docs differ
    assert other[1] is not first[1]


def test_empty_rows_and_empty_block():
    tq, tk = _t([[0, 1, 2, 3, 4, 5]]), _t([[5, 6, 7, 8, 9, 10]])
    docs_q, docs_k = _t([[0, 0, 0, 0, 0, 1]]), _t([[1, 1, 1, 1, 1, 1]])
    assert _check_block(tq, tk, docs_q, docs_k) == "segments"  # rows 0..4 see no key
    assert _check_block(tq, tk + 1, docs_q, docs_k) == "empty"


def test_masked_attention_and_local_path_with_documents():
    """Self-attention of packed samples: masked_attention (segments, both kernels) and
    local_attention (auto: CPU mask SDPA; torch: segments) against reference_attention."""
    gen = torch.Generator().manual_seed(11)
    b, s = 2, 20
    docs = _t([[0] * 5 + [1] * 1 + [2] * 9 + [3] * 5, [0] * 20])
    q = torch.randn(b, 4, s, 8, generator=gen)
    k, v = torch.randn(b, 2, s, 8, generator=gen), torch.randn(b, 2, s, 8, generator=gen)
    dout = torch.randn(b, 4, s, 8, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, None, docs)
    ref_grads = torch.autograd.grad((ref * dout).sum(), leaves)
    tokens = torch.arange(s).expand(b, s)
    runs = {f"masked/{kernel}": (lambda x, y, z, kn=kernel: masked_attention(
        x, y, z, tokens, tokens, docs, docs, kernel=kn)) for kernel in KERNELS}
    runs.update({f"local/{kernel}": (lambda x, y, z, kn=kernel: local_attention(
        x, y, z, None, docs, kernel=kn)) for kernel in KERNELS})
    runs["local/no-docs-torch"] = lambda x, y, z: local_attention(x, y, z, kernel="torch")
    for name, run in runs.items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        want, want_grads = ref, ref_grads
        if name.endswith("no-docs-torch"):
            want = reference_attention(*[t.clone().requires_grad_() for t in (q, k, v)])
            want_grads = torch.autograd.grad((reference_attention(*leaves) * dout).sum(), leaves)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = run(*leaves)
        torch.testing.assert_close(out, want.detach(), **TOL, msg=lambda m: f"{name} out: {m}")
        for what, got, expect in zip("qkv", torch.autograd.grad((out * dout).sum(), leaves),
                                     want_grads):
            torch.testing.assert_close(got, expect, **TOL,
                                       msg=lambda m, w=what: f"{name} d{w}: {m}")


# ----------------------------------------------------------------------------- kernel choice
def test_kernel_choice():
    assert attention_kernel(None).name == "auto" and attention_kernel("torch").name == "torch"
    chosen = AttentionKernel("torch")
    assert attention_kernel(chosen) is chosen
    cpu = torch.zeros(1)
    assert isinstance(attention_kernel("auto").backend(cpu), kernels.CpuBackend)
    assert type(attention_kernel("torch").backend(cpu)) is kernels.TorchBackend
    with pytest.raises(ValueError, match=r"attention kernel 'flash' is unknown.*'auto', 'torch'"):
        attention_kernel("flash")
    with pytest.raises(ValueError, match="attention kernel 'flash' is unknown"):
        ContextParallelAttention(None, "p2p", 4, 2, kernel="flash")


# ----------------------------------------------------------------------------- CUDA glue on meta
class _MetaFlash(kernels.CudaBackend):
    """The CUDA backend with the flash kernels forced on: runs on meta tensors (shapes only)."""

    def flash_ok(self, q, k, v):
        return True


def test_cuda_glue_shapes_on_meta():
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 4, 12, 8, **meta), torch.empty(2, 2, 12, 8, **meta)
    out, lse = cuda_kernels.flash_forward(q, k, k, 0.3, True)
    assert out.shape == q.shape and lse.shape == (2, 4, 12) and lse.dtype == torch.float32
    grads = cuda_kernels.flash_backward(out, q, k, k, out, lse, 0.3, True)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    out, lse = cuda_kernels.efficient_forward(q.float(), k.float(), k.float(), 0.3, False)
    assert out.shape == q.shape and lse.shape == (2, 4, 12)
    grads = cuda_kernels.efficient_backward(out, q.float(), k.float(), k.float(), out, lse, 0.3,
                                            False)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert cuda_kernels.varlen_lse_is_packed()  # this PyTorch: lse [nh, total_q]

    # A zigzag document block through the segment executor with the varlen flash calls.
    tq, tk = _t([[0, 1, 6, 7], [0, 1, 2, 3]]), _t([[0, 1, 6, 7], [0, 1, 2, 3]])
    docs = _t([[0, 0, 0, 0], [0, 0, 1, 1]])
    kind, plan = classify_block(tq, tk, docs, docs)
    assert kind == "segments" and len(plan.calls) == 2
    q, k = torch.empty(2, 4, 4, 8, **meta), torch.empty(2, 2, 4, 8, **meta)
    out, lse = segments_forward(q, k, k, plan, 0.3, _MetaFlash())
    assert out.shape == q.shape and lse.shape == (2, 4, 4)
    grads = segments_backward(q, q, k, k, out, lse, plan, 0.3, _MetaFlash())
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_cudnn_glue_shapes_on_meta():
    """The cuDNN dense calls: GQA repeats the KV heads and sums dk / dv back; lse [b, nh, sq]
    (the kernel's [b, nh, sq, 1]); dout takes out's layout (an sbhd-permuted view here)."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(12, 2, 4, 8, **meta).permute(1, 2, 0, 3)  # [b, nh, s, d] view of sbhd
    k = torch.empty(2, 2, 6, 8, **meta)  # GQA: 2 KV heads, a key slice of 6 (a full block)
    out, lse = cuda_kernels.cudnn_forward(q, k, k, 0.3, False)
    assert out.shape == q.shape and lse.shape == (2, 4, 12) and lse.dtype == torch.float32
    grads = cuda_kernels.cudnn_backward(out.contiguous(), q, k, k, out, lse, 0.3, False)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(k.shape)]
    assert cuda_kernels._like(out.contiguous(), out).stride() == out.stride()
    assert not cuda_kernels.cudnn_eligible(q.float(), k.float(), k.float())  # not on meta/fp32


def test_varlen_lse_layouts_round_trip():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    packed = torch.randn(2, 9)  # [nh, total_q]
    padded = cuda_kernels.lse_pad(packed, cu, 5)  # [3 segments, nh, max_q 5]
    assert padded.shape == (3, 2, 5)
    torch.testing.assert_close(padded[1, :, 0], packed[:, 3])
    torch.testing.assert_close(cuda_kernels.lse_unpad(padded, cu, 9), packed)


@pytest.mark.parametrize("lengths", [(5, 9, 2), (7, 7, 7, 7), (1, 12)])
def test_padded_dense_call_equals_the_varlen_call(lengths):
    """Causal square segments as one padded dense call (what CudaBackend does with cuDNN)
    against the segment-by-segment loop: out, lse and every gradient, GQA, fp32."""
    tq = torch.arange(sum(lengths))[None]
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    kind, plan = classify_block(tq, tq, docs, docs)
    (call,) = plan.calls
    assert kind == "segments" and call.causal and call.square
    assert call.padded_cost() == pytest.approx(len(lengths) * max(lengths) ** 2 /
                                               sum(n * n for n in lengths))
    gen = torch.Generator().manual_seed(len(lengths))
    total = sum(lengths)
    q, dout = torch.randn(total, 4, 8, generator=gen), torch.randn(total, 4, 8, generator=gen)
    k, v = torch.randn(total, 2, 8, generator=gen), torch.randn(total, 2, 8, generator=gen)
    loop, cpu = kernels.TorchBackend(), kernels.CpuBackend()
    want_out, want_lse = loop.varlen_forward(q, k, v, call, 0.35)
    out, lse = kernels.padded_causal_forward(cpu.dense_forward, q, k, v, call, 0.35)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    want = loop.varlen_backward(dout, q, k, v, want_out, want_lse, call, 0.35)
    got = kernels.padded_causal_backward(cpu.dense_backward, dout, q, k, v, out, lse, call, 0.35)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_padding_that_wastes_too_much_keeps_the_varlen_call():
    tq = torch.arange(40)[None]
    docs = torch.tensor([0] * 34 + [1, 2, 3, 4, 5, 6])[None]  # one long document, 6 of one token
    _, plan = classify_block(tq, tq, docs, docs)
    assert plan.calls[0].padded_cost() > kernels.PADDED_COST_LIMIT
