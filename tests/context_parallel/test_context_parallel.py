"""Context-parallel attention against the single-process reference, on gloo workers.

Every case builds the same full q, k, v (same seed) on every rank, partitions the batch
with prepare_microbatch, runs context_parallel_attention on the local shard and compares the
output and dq, dk, dv with reference_attention on the full sequence (fp32, 1e-5). Cases
are grouped so each world size is spawned only a few times.
"""
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.context_parallel import (block_backward, block_forward, classify_block,
                                          context_parallel_attention, plan_heads,
                                          reference_attention, resolve_comm_type, zigzag_indices)
from megatron_cp.context_parallel.layout import RingLayout
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.distributed.initialize import initialize_model_parallel
from test_context_parallel_partition import DOC_LENGTHS, make_batch

TOL = dict(rtol=1e-5, atol=1e-5)


def _take(x, index):
    """Rows ``index`` [b, s_local] of x [b, h, s, d] -> [b, h, s_local, d]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _hierarchical_groups(cp_size, sizes_list):
    """{(U, R): (inner, outer) groups} from ParallelStates built with each (U, R)."""
    groups = {}
    for sizes in sizes_list:
        state = initialize_model_parallel(context_parallel_size=cp_size,
                                          hierarchical_context_parallel_sizes=sizes)
        groups[sizes] = (state.group("hcp_inner"), state.group("hcp_outer"))
    return groups


def _check_case(case, cp_group, cp_rank, cp_size, hierarchical=None):
    """Run one case on this rank and compare with the reference; returns the case name.
    ``hierarchical``: {(U, R): (inner, outer) groups} for the a2a+p2p cases."""
    name = f"{case['comm']} cp={cp_size} {case}"
    if case.get("docs"):
        batch = make_batch(doc_lengths=DOC_LENGTHS)  # 36 tokens per sample, padded per document
    else:
        batch = make_batch(seq_len=case.get("s", 64))
    parts = [prepare_microbatch(batch, r, cp_size) for r in range(cp_size)]
    mine = parts[cp_rank]
    index, docs = mine["token_index"], mine["document_ids"]
    b, total = index.shape[0], cp_size * index.shape[1]
    full_docs = None
    if docs is not None:
        full_docs = torch.zeros(b, total, dtype=torch.int64)
        for part in parts:
            full_docs.scatter_(1, part["token_index"], part["document_ids"])
    gen = torch.Generator().manual_seed(case.get("seed", 7))
    nh, nkv, d = case["nh"], case["nkv"], case.get("d", 8)
    q, g = (torch.randn(b, nh, total, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, nkv, total, d, generator=gen) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*full, torch.arange(total).expand(b, total), full_docs)
    ref_grads = torch.autograd.grad((ref * g).sum(), full)

    if case.get("sbhd"):  # the model's [s, b, h, d] activations: non-contiguous views
        leaves = [_take(t, index).permute(2, 0, 1, 3).contiguous().requires_grad_() for t in (q, k, v)]
        local = [t.permute(1, 2, 0, 3) for t in leaves]  # [b, h, s_local, d] views
    else:
        leaves = local = [_take(t, index).requires_grad_() for t in (q, k, v)]
    sizes = resolve_comm_type(case["comm"], case["nkv"], cp_size, case.get("hier"))[1]
    out = context_parallel_attention(*local, index, docs, cp_group, case["comm"],
                                     hierarchical_groups=(hierarchical or {}).get(sizes),
                                     kernel=case.get("kernel", "auto"))
    (out * _take(g, index)).sum().backward()
    torch.testing.assert_close(out, _take(ref, index), **TOL, msg=lambda m: f"{name} out: {m}")
    for what, leaf, want in zip("qkv", leaves, ref_grads):
        got = leaf.grad.permute(1, 2, 0, 3) if case.get("sbhd") else leaf.grad
        torch.testing.assert_close(got, _take(want, index), **TOL,
                                   msg=lambda m, w=what: f"{name} d{w}: {m}")
    return name


CP4_CASES = [
    dict(comm="p2p", nh=4, nkv=4),
    dict(comm="p2p", nh=4, nkv=2, sbhd=True),
    dict(comm="p2p", nh=4, nkv=2, docs=True),
    dict(comm="p2p", nh=4, nkv=2, docs=True, kernel="torch"),
    dict(comm="p2p", nh=2, nkv=1, s=32, d=16, kernel="torch"),
    dict(comm="all_gather", nh=4, nkv=2),
    dict(comm="all_gather", nh=4, nkv=4, docs=True, sbhd=True),
    dict(comm="a2a", nh=4, nkv=4),
    dict(comm="a2a", nh=8, nkv=2, docs=True, sbhd=True),  # nkv < cp: KV heads repeated
    dict(comm="a2a", nh=6, nkv=2),  # 6 % 4: dummy heads
    dict(comm="a2a", nh=6, nkv=6, docs=True, kernel="torch"),  # dummy heads, MHA
    dict(comm="a2a", nh=3, nkv=1),  # dummy heads and repeated KV
    dict(comm="a2a+p2p", nh=4, nkv=2, hier=(2, 2)),
    dict(comm="a2a+p2p", nh=8, nkv=2, hier=(2, 2), docs=True, sbhd=True),
    dict(comm="a2a+p2p", nh=4, nkv=1, hier=(2, 2), d=16),  # repeated KV inside the hybrid
    dict(comm="auto", nh=4, nkv=2),  # -> a2a+p2p (2, 2)
    dict(comm="auto", nh=4, nkv=4, docs=True),  # -> a2a
    dict(comm="auto", nh=3, nkv=1),  # -> p2p
]

CP2_CASES = [
    dict(comm="p2p", nh=4, nkv=2),
    dict(comm="p2p", nh=2, nkv=2, docs=True),
    dict(comm="all_gather", nh=4, nkv=1, docs=True),
    dict(comm="a2a", nh=4, nkv=1),  # nkv < cp
    dict(comm="a2a", nh=3, nkv=3, docs=True),  # dummy heads
    dict(comm="auto", nh=4, nkv=2, docs=True),
    dict(comm="a2a+p2p", nh=4, nkv=2, hier=(1, 2), docs=True),  # needs built sub-groups
    dict(comm="a2a+p2p", nh=4, nkv=2, hier=(2, 1)),
]


def _cp4_worker(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    hierarchical = _hierarchical_groups(4, [(2, 2)])
    return [_check_case(case, group, rank, world_size, hierarchical) for case in CP4_CASES]


def _cp2_worker(rank, world_size):  # two CP groups of 2 (CP x DP): sub-groups of each
    state = initialize_model_parallel(context_parallel_size=2)
    hierarchical = _hierarchical_groups(2, [(1, 2), (2, 1)])
    return [_check_case(case, state.group("cp"), state.rank("cp"), 2, hierarchical)
            for case in CP2_CASES]


def test_context_parallel_cp4_matches_reference():
    names = run_workers(_cp4_worker, 4, timeout=240)
    assert len(names[0]) == len(CP4_CASES)


def test_context_parallel_cp2_matches_reference():
    names = run_workers(_cp2_worker, 4, timeout=240)
    assert len(names[0]) == len(CP2_CASES)


_COLLECTIVES = ("all_to_all_single", "batch_isend_irecv", "all_gather_single",
                "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
                "reduce_scatter_tensor", "new_group", "all_reduce", "broadcast", "barrier")


def _errors_and_memory_worker(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    b, d, s_local = 2, 8, 16
    q, k, v = torch.randn(b, 6, s_local, d), torch.randn(b, 2, s_local, d), torch.randn(b, 2, s_local, d)
    index = prepare_microbatch(make_batch(seq_len=64), rank, world_size)["token_index"]

    def boom(*args, **kwargs):
        raise AssertionError("communication before input validation")

    real = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    for n in real:
        setattr(dist, n, boom)
    try:
        bad = [(dict(comm_type="a2a", allow_dummy_heads=False), "dummy heads are disabled"),
               (dict(comm_type="a2a+p2p"), "needs hierarchical"),
               (dict(comm_type="a2a+p2p", hierarchical_groups=(group, group)), "multiply to 16"),
               (dict(comm_type="auto"), r"hierarchical_context_parallel_sizes=\(2, 2\)"),
               (dict(comm_type="ring"), "unknown"),
               (dict(comm_type="p2p", token_index=index[:, :8]), r"token_index must be")]
        for kwargs, match in bad:
            tokens = kwargs.pop("token_index", index)
            with pytest.raises(ValueError, match=match):
                context_parallel_attention(q, k, v, tokens, None, group, **kwargs)
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)

    # Saved for backward by ring attention: local q, k, v, out, lse (+ O(s) int metadata).
    for docs in (False, True):
        part = prepare_microbatch(make_batch(doc_lengths=DOC_LENGTHS) if docs else make_batch(seq_len=64),
                               rank, world_size)
        s_loc = part["token_index"].shape[1]
        local = [torch.randn(b, h, s_loc, d, requires_grad=True) for h in (4, 2, 2)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = context_parallel_attention(*local, part["token_index"], part["document_ids"],
                                             group, "p2p")
        floats = [t for t in saved if t.is_floating_point()]
        for t in saved:
            assert sum(size >= s_loc for size in t.shape) <= 1, f"block-shaped saved tensor {t.shape}"
            assert not t.is_floating_point() or max(t.shape) <= s_loc, f"full-seq saved {t.shape}"
            assert t.is_floating_point() or t.numel() <= b * s_loc * world_size
        expected = sum(x.numel() * 4 for x in (*local, out)) + b * 4 * s_loc * 4  # + lse fp32
        assert sum(t.numel() * t.element_size() for t in floats) == expected
        out.sum().backward()
    return True


def test_errors_before_communication_and_saved_memory():
    assert all(run_workers(_errors_and_memory_worker, 4, timeout=180))


def test_single_rank_and_block_kernels():
    """cp_group None -> local attention; fused and plain block kernels agree; plan_heads."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    tokens = torch.arange(12).expand(2, 12)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    for document_ids in (None, docs):
        out = context_parallel_attention(q, k, v, tokens, document_ids, None, "p2p")
        torch.testing.assert_close(out, reference_attention(q, k, v, tokens, document_ids), **TOL)
    # Queries 0..5 against keys 5..11: rows 0..4 see no key -> lse -inf, out 0, finite grads.
    kind, plan = classify_block(tokens[:, :6], tokens[:, 5:], docs[:, :6], docs[:, 5:])
    assert kind == "segments"
    results = {}
    for kernel in ("auto", "torch"):
        o, lse = block_forward(q[:, :, :6], k[:, :, 5:], v[:, :, 5:], 0.3, kind, plan, kernel)
        grads = block_backward(torch.ones_like(o), q[:, :, :6], k[:, :, 5:], v[:, :, 5:],
                               o, lse, 0.3, kind, plan, kernel)
        assert torch.isinf(lse[:, :, :5]).all() and (o[:, :, :5] == 0).all()
        assert torch.isfinite(lse[:, :, 5]).all()
        assert all(torch.isfinite(x).all() for x in grads)
        results[kernel] = (o, lse, *grads)
    for a, b in zip(results["auto"], results["torch"]):
        torch.testing.assert_close(a, b, **TOL)
    # The zigzag fast path is detected for prepare_microbatch's layout, and for the outer ring
    # of the hybrid after the inner all-to-all's gathered tokens are sorted (2 x 2 here).
    index = [zigzag_indices(r, 4, 32) for r in range(4)]
    assert RingLayout.from_metadata(torch.stack(index)[:, None], None).zigzag
    outer = [torch.cat(index[2 * g:2 * g + 2]).sort().values for g in range(2)]
    assert RingLayout.from_metadata(torch.stack(outer)[:, None], None).zigzag
    assert not RingLayout.from_metadata(torch.stack(index)[:, None], torch.stack(index)[:, None]).zigzag
    plan = plan_heads(8, 2, 4)  # repeat each KV head twice, no dummies
    assert plan.kv_index == [0, 0, 1, 1] and plan.num_dummy_heads == 0
    assert plan_heads(6, 6, 4).num_dummy_heads == 2  # pad 6 MHA heads to 8
    with pytest.raises(ValueError, match="dummy heads are disabled"):
        plan_heads(6, 2, 4, allow_dummy_heads=False)
