"""megatron_cp's call of flash-linear-attention's ``chunk_gated_delta_rule`` (the Gated
DeltaNet kernel on CUDA: layers/gated_delta_rule.py's ``_fla_chunk``), driven on CPU through
FLA's real Python entry point, so that FLA's own argument handling runs as shipped. Run by
tests/layers/test_fla_call.py in a process that can import FLA (see there why only that one).

FLA's Triton kernels do not run on CPU: Triton has no CPU backend, and its interpreter
(TRITON_INTERPRET=1) does not run FLA 0.6.0's kernels (Triton 3.5 and 3.8: the autotuner asks
for a GPU driver to time its configurations, and the interpreter hands ``range`` loops Python
ints where FLA's kernels call ``.to(tl.int64)`` on the index). So the autograd function where
the kernels start (``fla.ops.gated_delta_rule.chunk.ChunkGatedDeltaRuleFunction``) is replaced
by FLA's own PyTorch reference, ``naive_recurrent_gated_delta_rule``, run per document of a
packed row; the stand-in records the arguments it is handed. The outputs and gradients are
checked against ``torch_chunk_gated_delta_rule``, and the arguments against what FLA's entry
point documents and Megatron-LM passes: q, k, v and beta in the model's dtype, g fp32, packed
documents as batch 1 with int64 ``cu_seqlens``.
"""
import inspect

import pytest
import torch
import torch.nn.functional as F

from megatron_cp.layers import accelerators
from megatron_cp.layers import gated_delta_rule as rule

FLA_VERSION = "0.6.0"  # setup.py's "gpu" extra and scripts/env.sh pin the same
INSTALL = "see tests/layers/test_fla_call.py"
B, S, H, DK, DV = 2, 128, 2, 16, 16


@pytest.fixture
def fla(monkeypatch):
    """FLA's entry point with its kernels replaced by the recording reference (:class:`_Kernel`),
    and the route to it opened on CPU. Returns the stand-in."""
    try:
        import fla as fla_package
        from fla.ops.gated_delta_rule import chunk as fla_chunk
        from fla.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
        from fla.ops.utils.index import prepare_chunk_indices
    except ImportError as error:
        pytest.fail(f"flash-linear-attention is not importable ({error!r}); install it: {INSTALL}")
    assert fla_package.__version__ == FLA_VERSION, (
        f"FLA {fla_package.__version__} is installed, the tests check the pinned {FLA_VERSION}: "
        f"{INSTALL}")
    kernel = _Kernel(fla_chunk.ChunkGatedDeltaRuleFunction, naive_recurrent_gated_delta_rule,
                     prepare_chunk_indices)
    monkeypatch.setattr(fla_chunk, "ChunkGatedDeltaRuleFunction", kernel)
    monkeypatch.setattr(rule, "_fla_device", lambda x: True)
    # the route reaches FLA's real entry point
    assert accelerators.fla_chunk_gated_delta_rule() is fla_chunk.chunk_gated_delta_rule
    return kernel


class _Kernel:
    """Stands in for FLA's ``ChunkGatedDeltaRuleFunction``: records the arguments of each
    ``apply`` by the names of the real ``forward``, derives the chunk indices from
    ``cu_seqlens`` as the real forward does, and computes with FLA's token-by-token reference,
    one document of the packed row at a time. Returns (o in q's dtype, final state), as the
    real one."""

    def __init__(self, real, reference, prepare_chunk_indices):
        self.names = list(inspect.signature(real.forward).parameters)[1:]  # after ctx
        assert self.names[:5] == ["q", "k", "v", "g", "beta"], self.names
        self.reference, self.prepare_chunk_indices = reference, prepare_chunk_indices
        self.calls = []

    def apply(self, *args):
        call = dict(zip(self.names, args))
        self.calls.append(call)
        q, k, v, g, beta = (call[name] for name in ("q", "k", "v", "g", "beta"))
        cu = call["cu_seqlens"]
        if cu is None:
            bounds = [(0, q.shape[1])]
        else:
            assert call["initial_state"] is None and not call["output_final_state"]
            if call["chunk_indices"] is None:
                call["chunk_indices"] = self.prepare_chunk_indices(
                    cu, call["chunk_size"], cu_seqlens_cpu=call["cu_seqlens_cpu"])
            bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        outs = []
        for start, end in bounds:
            out, final = self.reference(
                *(x[:, start:end] for x in (q, k, v, beta, g)), scale=call["scale"],
                initial_state=call["initial_state"],
                output_final_state=call["output_final_state"])
            outs.append(out)
        return torch.cat(outs, dim=1).to(q.dtype), final


def _inputs(dtype=torch.bfloat16, b=B, seed=0):
    """What GatedDeltaNet.kernel_inputs / gates give the kernel: q, k unit norm in fp32, v in
    the model's dtype, g (log decay) and beta fp32; all leaves with gradients."""
    gen = torch.Generator().manual_seed(seed)
    q = rule.l2norm(torch.randn(b, S, H, DK, generator=gen))
    k = rule.l2norm(torch.randn(b, S, H, DK, generator=gen))
    v = torch.randn(b, S, H, DV, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(b, S, H, generator=gen)) * 0.3
    beta = torch.sigmoid(torch.randn(b, S, H, generator=gen))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _documents():
    """Several documents per sample: boundaries inside a chunk, on a chunk start (64), a
    one-token document (40) and a last token alone (127)."""
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[0, 5:], ids[0, 64:], ids[0, 100:] = 1, 2, 3
    ids[1, 40:], ids[1, 41:], ids[1, 127:] = 4, 5, 6
    return ids


def _reference(q, k, v, g, beta, **kwargs):
    """torch_chunk_gated_delta_rule on the values FLA is given (q, k, beta rounded to v's dtype,
    as Megatron-LM computes them), as new leaves."""
    leaves = [x.detach().to(v.dtype).float().requires_grad_() for x in (q, k)]
    leaves += [v.detach().requires_grad_(), g.detach().requires_grad_(),
               beta.detach().to(v.dtype).float().requires_grad_()]
    return leaves, rule.torch_chunk_gated_delta_rule(*leaves, **kwargs)


def _grads(out, leaves, seed=1):
    """Gradients of sum(out * w), w with values exact in bf16 (both outputs are bf16, so the
    incoming gradient is the same for both)."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()
    return torch.autograd.grad((out.float() * w).sum(), leaves)


def _assert_close(actual, expected, rounded=True):
    """actual (the FLA route) and expected (our chunked kernel) are the same function of the
    same inputs, computed in fp32 in different orders (token by token, chunk by chunk):
    test_gdn_kernel.py bounds each fp32 computation within 1e-5 of the scale of the result
    against fp64, so 2e-5 of the largest element for the two (atol). ``rounded``: either or
    both are then rounded to bf16, which keeps 8 significant bits: one rounding step, 2^-7 of
    the element, apart (rtol)."""
    expected = expected.float()
    torch.testing.assert_close(actual.float(), expected, rtol=2 ** -7 if rounded else 1e-5,
                               atol=2e-5 * expected.abs().max().item())


def _assert_arguments(call, dtype):
    """What FLA's entry point requires and Megatron-LM passes: q, k, v and beta in the
    model's dtype (one dtype, not fp32), g fp32, the default scale 1/sqrt(dk)."""
    assert {call[name].dtype for name in ("q", "k", "v", "beta")} == {dtype}, \
        {name: call[name].dtype for name in ("q", "k", "v", "beta")}
    assert call["g"].dtype == torch.float32
    assert call["scale"] == DK ** -0.5


def test_plain_batch_with_states_matches_the_torch_kernel(fla):
    q, k, v, g, beta = inputs = _inputs()
    state = torch.randn(B, H, DK, DV, generator=torch.Generator().manual_seed(2))
    out, final = rule.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                             output_final_state=True)
    assert len(fla.calls) == 1
    call = fla.calls[0]
    _assert_arguments(call, torch.bfloat16)
    assert call["cu_seqlens"] is None and call["q"].shape == (B, S, H, DK)
    assert call["initial_state"] is state and call["output_final_state"]
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    leaves, (ref, ref_final) = _reference(*inputs, initial_state=state, output_final_state=True)
    _assert_close(out, ref)
    _assert_close(final, ref_final, rounded=False)
    for got, want in zip(_grads(out, inputs), _grads(ref, leaves)):
        _assert_close(got, want)


def test_packed_documents_run_as_one_row_with_int64_cu_seqlens(fla):
    q, k, v, g, beta = inputs = _inputs()
    docs = _documents()
    out, final = rule.chunk_gated_delta_rule(q, k, v, g, beta, document_ids=docs)
    assert final is None and len(fla.calls) == 1
    call = fla.calls[0]
    _assert_arguments(call, torch.bfloat16)
    assert call["q"].shape == (1, B * S, H, DK) and call["v"].shape == (1, B * S, H, DV)
    assert call["g"].shape == call["beta"].shape == (1, B * S, H)
    cu = call["cu_seqlens"]
    assert cu.dtype == torch.int64 and cu.device == q.device
    # every document start, sample 1's first token (S) included, then the end
    assert cu.tolist() == [0, 5, 64, 100, S, S + 40, S + 41, S + 127, 2 * S]
    assert cu.tolist() == rule.packed_cu_seqlens(docs).tolist()
    # FLA's chunk indices from them: chunks of 64 per document (86 tokens: 2)
    assert call["chunk_indices"].dtype == torch.int64
    assert call["chunk_indices"][:, 0].bincount().tolist() == [1, 1, 1, 1, 1, 1, 2, 1]
    leaves, (ref, _) = _reference(*inputs, document_ids=docs)
    _assert_close(out, ref)
    for got, want in zip(_grads(out, inputs), _grads(ref, leaves)):
        _assert_close(got, want)
    # the documents restart: without them the outputs differ
    unpacked, _ = rule.torch_chunk_gated_delta_rule(*leaves)
    assert (unpacked.float() - ref.float()).abs().max() > 0.1


def test_cu_seqlens_of_one_row_reach_fla_as_int64(fla):
    q, k, v, g, beta = _inputs(b=1)
    cu = torch.tensor([0, 30, 64, 65, S], dtype=torch.int32)  # flash-attention's int32
    out, _ = rule.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    received = fla.calls[0]["cu_seqlens"]
    assert received.dtype == torch.int64 and received.tolist() == cu.tolist()
    same, _ = rule.chunk_gated_delta_rule(q, k, v, g, beta,
                                          document_ids=rule.documents_from_cu_seqlens(cu, S))
    assert fla.calls[1]["cu_seqlens"].tolist() == cu.tolist()
    torch.testing.assert_close(out, same, rtol=0, atol=0)


def test_precomputed_cu_seqlens_and_chunk_indices_are_handed_on(fla):
    """What a caller computes once per microbatch reaches FLA as it is: the same tensors
    (FLA caches what it derives from them by identity), so no layer waits on the device."""
    from fla.ops.utils.index import prepare_chunk_indices
    q, k, v, g, beta = _inputs()
    docs = _documents()
    cu = rule.packed_cu_seqlens(docs)
    cu_cpu = cu.clone()  # on a GPU: cu.cpu(), the host copy FLA reads the lengths from
    indices = prepare_chunk_indices(cu, rule.CHUNK_SIZE)
    out, _ = rule._fla_chunk(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                             chunk_indices=indices)
    call = fla.calls[0]
    assert call["cu_seqlens"] is cu and call["cu_seqlens_cpu"] is cu_cpu
    assert call["chunk_indices"] is indices
    same, _ = rule._fla_chunk(q, k, v, g, beta, document_ids=docs)
    torch.testing.assert_close(out, same, rtol=0, atol=0)
    # the layer's route: the packed rows its microbatch's SequenceLayout holds (GatedDeltaNet
    # .prepare_layout), handed on by chunk_gated_delta_rule as they are
    also, _ = rule.chunk_gated_delta_rule(q, k, v, g, beta, document_ids=docs,
                                          packed_rows=(cu, cu_cpu))
    assert fla.calls[-1]["cu_seqlens"] is cu and fla.calls[-1]["cu_seqlens_cpu"] is cu_cpu
    torch.testing.assert_close(also, same, rtol=0, atol=0)


def test_fp32_models_and_packed_states_stay_on_the_torch_kernel(fla):
    q, k, v, g, beta = _inputs(dtype=torch.float32)
    rule.chunk_gated_delta_rule(q, k, v, g, beta)  # fp32: FLA's dot products would be TF32
    docs = _documents()
    q, k, v, g, beta = _inputs()
    rule.chunk_gated_delta_rule(q, k, v, g, beta, document_ids=docs, output_final_state=True)
    assert fla.calls == []
    q, k, v, g, beta = _inputs(dtype=torch.float16)  # fp16 models: FLA, in fp16
    rule.chunk_gated_delta_rule(q, k, v, g, beta, document_ids=docs)
    _assert_arguments(fla.calls[0], torch.float16)
