"""Attention dropout is the same under every layout: the hash mask, the dropout attention
path, context-parallel attention with dropout against one process, and training losses
(with hidden dropout on as well: Megatron-LM's defaults, hidden_dropout.py's masks).

The mask is a function of (seed, layer, sample, global head, query and key position in the
unpadded sample) only, so one process and every TP / CP / DP / PP layout (and recomputation)
drop the same elements: their losses agree to fp32 reassociation (relative 1e-5) and differ
from the losses without dropout (so a path that silently skipped dropout would fail).
"""
import math

import pytest
import torch

from dist_harness import run_workers
from megatron_cp.context_parallel import (AttentionDropout, context_parallel_attention,
                                          dropout_key, keep_mask, resolve_comm_type,
                                          zigzag_indices)
from megatron_cp.context_parallel import dropout as dropout_mod
from megatron_cp.context_parallel.reference import attention_mask
from megatron_cp.data.microbatch import prepare_microbatch
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTModel
from model_utils import tiny_config
from test_context_parallel_partition import DOC_LENGTHS, make_batch
from training_utils import NO_DROPOUT, TINY, max_rel_diff, train_losses

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 sums of a few dozen terms


# ----- the mask ---------------------------------------------------------------------------
def _python_chain(state, words):
    """The hash in Python integers (no overflow at all): what the int64 tensor ops must give."""
    for word in words:
        x = (word & 0xFFFFFFFF) ^ state
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        state = x ^ (x >> 16)
    return state


def test_hash_is_exact_integer_arithmetic():
    """Every element's hash equals the overflow-free Python one, for large seeds and sample
    numbers, negative (dummy) heads and positions up to 2^32 - 1."""
    seed = 2 ** 40 + 11
    key = dropout_key(seed, 7)
    assert key == _python_chain(0x9E3779B9, (seed, seed >> 32, 7))
    samples = torch.tensor([0, 2 ** 62 - 3, 123456789012])
    heads = torch.tensor([0, 5, -1])
    q_pos = torch.tensor([[0, 1, 2 ** 31 - 1]] * 3)
    k_pos = torch.tensor([[0, 3, 2 ** 20, 2 ** 32 - 1]] * 3)
    got = dropout_mod.element_hash(key, samples, heads, q_pos, k_pos)  # [3, 3, 3, 4]
    for n in range(3):
        for h in range(3):
            for i in range(3):
                for j in range(4):
                    sample = int(samples[n])
                    want = _python_chain(key, (sample, sample >> 32, int(heads[h]),
                                               int(q_pos[n, i]), int(k_pos[n, j])))
                    assert int(got[n, h, i, j]) == want, (n, h, i, j)


def test_mask_follows_global_coordinates_whatever_the_split():
    """Any block split (zigzag CP chunks, permuted rows, a subset of heads) reads the same
    bits as the whole [s, s] mask at the same global (head, query, key)."""
    key, p, b, nh, s = dropout_key(5, 3), 0.1, 2, 8, 64
    samples = torch.tensor([17, 18])
    everything = torch.arange(s).expand(b, s)
    full = keep_mask(key, p, samples, torch.arange(nh), everything, everything)  # [b, nh, s, s]
    gen = torch.Generator().manual_seed(0)
    splits = [(zigzag_indices(i, 4, s), zigzag_indices(j, 4, s), torch.arange(nh))
              for i in range(4) for j in range(4)]  # every ring block of CP=4
    splits += [(torch.randperm(s, generator=gen)[:20], torch.randperm(s, generator=gen)[:24],
                torch.randperm(nh, generator=gen)[:3]) for _ in range(5)]
    for rows, cols, heads in splits:
        part = keep_mask(key, p, samples, heads, rows.expand(b, -1), cols.expand(b, -1))
        assert torch.equal(part, full[:, heads][:, :, rows][:, :, :, cols])
    # other coordinates draw other masks: about p^2 + (1-p)^2 of the bits agree
    heads = torch.arange(nh)
    for other in (keep_mask(dropout_key(5, 4), p, samples, heads, everything, everything),
                  keep_mask(key, p, samples + 2, heads, everything, everything),
                  keep_mask(dropout_key(6, 3), p, samples, heads, everything, everything)):
        agree = (other == full).float().mean().item()
        assert abs(agree - (p * p + (1 - p) ** 2)) < 0.01, agree


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_is_one_minus_p(p):
    """The mean keep rate is 1 - p within 5 binomial standard deviations, and neighbouring
    keys are dropped independently (P(both dropped) = p^2)."""
    b, nh, s = 4, 8, 256
    positions = torch.arange(s).expand(b, s)
    keep = keep_mask(dropout_key(1234, 0), p, torch.arange(b) + 1000, torch.arange(nh),
                     positions, positions)
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    both = (~keep[..., 1:] & ~keep[..., :-1]).float().mean().item()
    m = keep[..., 1:].numel()
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / m)


# ----- the dropout attention path ---------------------------------------------------------
def _explicit(q, k, v, tokens, docs, dropout, scale):
    """dropout(softmax(S)) V with the whole [s, s] mask, autograd for the gradients."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~attention_mask(tokens, tokens, docs, docs), float("-inf"))
    keep = keep_mask(dropout.key, dropout.p, dropout.samples, dropout.heads, tokens, tokens)
    return (scores.softmax(-1) * keep / (1 - dropout.p)) @ v


@pytest.mark.parametrize("docs", [False, True], ids=["plain", "documents"])
def test_dropout_attention_is_dropout_of_the_softmax(docs, monkeypatch):
    """The tiled plain path equals dropout(softmax(S)) V (GQA, packed documents) in output
    and gradients, with the normaliser undropped, for any tile size."""
    gen = torch.Generator().manual_seed(3)
    b, nh, nkv, s, d, scale = 2, 4, 2, 24, 8, 0.3
    q, k, v, g = (torch.randn(b, h, s, d, generator=gen) for h in (nh, nkv, nkv, nh))
    tokens = torch.arange(s).expand(b, s)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 5 + [1] * 5 + [2] * 14]) if docs else None
    drop = AttentionDropout(0.3, dropout_key(9, 1), torch.tensor([4, 5]), torch.arange(nh) + 4,
                            None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _explicit(*leaves, tokens, doc_ids, drop, scale)
    want_grads = torch.autograd.grad((want * g).sum(), leaves)
    for tile_scores in (dropout_mod.MAX_TILE_SCORES, 100):  # 100: one query row per tile
        monkeypatch.setattr(dropout_mod, "MAX_TILE_SCORES", tile_scores)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dropout_mod.dropout_attention(*leaves, None, doc_ids, drop, scale)
        torch.testing.assert_close(out, want, **TOL)
        for got, ref in zip(torch.autograd.grad((out * g).sum(), leaves), want_grads):
            torch.testing.assert_close(got, ref, **TOL)


# ----- context-parallel attention with dropout against one process ------------------------
def _take(x, index):
    """Rows ``index`` [b, s_local] of x [b, h, s, d] -> [b, h, s_local, d]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _check_cp_case(case, cp_group, cp_rank, cp_size, hierarchical):
    """One CP layout of the same unpadded samples (packed documents are padded per document
    for CP): the output and the q, k, v gradients at every real token equal one process's."""
    batch = make_batch(doc_lengths=DOC_LENGTHS) if case["docs"] else make_batch(seq_len=36)
    b, s = batch["tokens"].shape
    gen = torch.Generator().manual_seed(11)
    nh, nkv, d = case["nh"], case["nkv"], 8
    q, k, v, g = (torch.randn(b, h, s, d, generator=gen) for h in (nh, nkv, nkv, nh))
    drop = AttentionDropout(0.3, dropout_key(21, 2), torch.tensor([7, 2 ** 40 + 1]),
                            torch.arange(nh) + nh, None)  # heads as TP rank 1 holds them
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dropout_mod.dropout_attention(*full, None, batch.get("document_ids"), drop, 0.35)
    ref_grads = torch.autograd.grad((ref * g).sum(), full)

    mine = prepare_microbatch(batch, cp_rank, cp_size)
    where = mine["unpadded_index"]  # [b, s_local]; pad tokens: 0
    real = (mine["loss_mask"] > 0)[:, None, :, None]  # make_batch's loss mask is all ones
    local = [_take(t, where).requires_grad_() for t in (q, k, v)]
    sizes = resolve_comm_type(case["comm"], nkv, cp_size, case.get("hier"))[1]
    out = context_parallel_attention(*local, mine["token_index"], mine["document_ids"], cp_group,
                                     case["comm"], 0.35, hierarchical.get(sizes),
                                     dropout=drop._replace(positions=where))
    (out * _take(g, where) * real).sum().backward()  # pad rows carry no gradient
    name = f"cp={cp_size} {case}"
    torch.testing.assert_close(out * real, _take(ref, where) * real, **TOL,
                               msg=lambda m: f"{name}: {m}")
    for what, leaf, want in zip("qkv", local, ref_grads):
        torch.testing.assert_close(leaf.grad * real, _take(want, where) * real, **TOL,
                                   msg=lambda m, w=what: f"{name} d{w}: {m}")
    return name


CP_CASES = {
    4: [dict(comm="p2p", nh=4, nkv=2, docs=False), dict(comm="p2p", nh=4, nkv=2, docs=True),
        dict(comm="all_gather", nh=4, nkv=4, docs=True),
        dict(comm="a2a", nh=8, nkv=2, docs=False),
        dict(comm="a2a", nh=6, nkv=2, docs=True),  # 6 % 4: dummy heads, repeated KV heads
        dict(comm="a2a+p2p", nh=4, nkv=2, hier=(2, 2), docs=False),
        dict(comm="a2a+p2p", nh=8, nkv=2, hier=(2, 2), docs=True)],
    2: [dict(comm="p2p", nh=2, nkv=1, docs=True), dict(comm="a2a", nh=4, nkv=2, docs=True),
        dict(comm="all_gather", nh=4, nkv=2, docs=False)],
}


def _cp_worker(rank, world):
    names = []
    for cp_size, cases in CP_CASES.items():
        state = initialize_model_parallel(context_parallel_size=cp_size,
                                          hierarchical_context_parallel_sizes=(2, 2)
                                          if cp_size == 4 else None)
        hierarchical = {(2, 2): (state.group("hcp_inner"), state.group("hcp_outer"))}
        names += [_check_cp_case(case, state.group("cp"), state.rank("cp"), cp_size, hierarchical)
                  for case in cases]
    return names


def test_context_parallel_dropout_matches_one_process():
    names = run_workers(_cp_worker, 4, timeout=240)
    assert len(names[0]) == sum(len(cases) for cases in CP_CASES.values())


# ----- the model: recomputation, eval, callers without sample numbers ----------------------
def _model_grads(**overrides):
    torch.manual_seed(0)
    tokens = torch.randint(0, 120, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    config = dict(attention_dropout=0.1, init_method_std=0.2)
    model = GPTModel(tiny_config(**{**config, **overrides}))
    loss = model(tokens, positions, labels=tokens, sample_ids=torch.tensor([3, 4])).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_recomputation_redraws_the_same_mask():
    """Selective (core attention) and full recomputation give the gradients of no recompute;
    without dropout they differ (the mask is really applied)."""
    loss, grads = _model_grads()
    for kw in (dict(recompute_granularity="selective"),
               dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)):
        other_loss, other = _model_grads(**kw)
        torch.testing.assert_close(other_loss, loss, **TOL)
        for name in grads:
            torch.testing.assert_close(other[name], grads[name], **TOL, msg=name)
    assert not torch.allclose(_model_grads(attention_dropout=0.0)[0], loss, rtol=1e-4)


def test_eval_and_callers_without_sample_numbers():
    """Eval mode never drops; a training call without sample numbers draws fresh ones (a new
    mask per call), with them the mask is fixed."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 120, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    model = GPTModel(tiny_config(attention_dropout=0.5))
    plain = GPTModel(tiny_config(attention_dropout=0.0)).eval()
    ids = torch.tensor([1, 2])
    with torch.no_grad():
        first, second = (model(tokens, positions, labels=tokens) for _ in range(2))
        fixed = [model(tokens, positions, labels=tokens, sample_ids=ids) for _ in range(2)]
        model.eval()
        torch.testing.assert_close(model(tokens, positions, labels=tokens),
                                   plain(tokens, positions, labels=tokens))
    assert not torch.allclose(first, second)
    assert torch.equal(fixed[0], fixed[1])


# ----- training: every layout reproduces one process --------------------------------------
# TINY's dropout (hidden and attention 0.1); --init-method-std 0.1: attention sharp enough
# that dropout moves the losses by ~1e-3, far beyond the tolerance, so a layout that skipped
# dropout would fail
BASE = TINY + " --train-iters 3 --init-method-std 0.1"
NO_DROPOUT = BASE + NO_DROPOUT
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss"
CP2, CP4 = "--context-parallel-size 2 --cp-comm-type", "--context-parallel-size 4 --cp-comm-type"
LAYOUTS = {  # world size -> {name: (flags, packed)}
    2: {"tp2-sp": ("--tensor-model-parallel-size 2 --sequence-parallel", False),
        "tp2-sp-packed": ("--tensor-model-parallel-size 2 --sequence-parallel", True),
        "dp2": ("", False),
        "pp2": ("--pipeline-model-parallel-size 2", False),
        "cp2-p2p": (f"{CP2} p2p", False), "cp2-p2p-packed": (f"{CP2} p2p", True),
        "cp2-a2a": (f"{CP2} a2a", False), "cp2-a2a-packed": (f"{CP2} a2a", True),
        "cp2-selective-packed": (f"{CP2} p2p --recompute-granularity selective", True)},
    4: {"cp4-p2p": (f"{CP4} p2p", False), "cp4-p2p-packed": (f"{CP4} p2p", True),
        "cp4-a2a": (f"{CP4} a2a", False), "cp4-a2a-packed": (f"{CP4} a2a", True),
        "cp4-hybrid": (f"{CP4} a2a+p2p --hierarchical-context-parallel-sizes 2 2", False),
        "cp4-hybrid-packed": (f"{CP4} a2a+p2p --hierarchical-context-parallel-sizes 2 2", True),
        "cp4-allgather": (f"{CP4} all_gather", False),
        "cp4-allgather-packed": (f"{CP4} all_gather", True),
        "cp2-dp2-allgather-packed": (f"{CP2} all_gather", True),
        "tp2-sp-cp2-a2a-packed": (f"--tensor-model-parallel-size 2 --sequence-parallel {CP2} a2a",
                                  True)},
}


def _jobs(rank, world, jobs):
    return {name: train_losses(rank, world, argv) for name, argv in jobs.items()}


def _argv(base, flags, packed):
    return f"{base} {flags} {PACKED if packed else ''}"


@pytest.fixture(scope="module")
def trained():
    """{world: {name: losses of every rank}} for one process (with and without dropout) and
    every layout."""
    jobs = {1: {f"{kind}{'-packed' if packed else ''}": _argv(base, "", packed)
                for kind, base in (("one", BASE), ("no-dropout", NO_DROPOUT))
                for packed in (False, True)}}
    for world, layouts in LAYOUTS.items():
        jobs[world] = {name: _argv(BASE, flags, packed)
                       for name, (flags, packed) in layouts.items()}
    results = {}
    for world, world_jobs in jobs.items():
        per_rank = run_workers(_jobs, world, world_jobs, timeout=400)
        results[world] = {name: [r[name] for r in per_rank] for name in world_jobs}
    return results


def test_dropout_changes_the_one_process_losses(trained):
    for packed in ("", "-packed"):
        one, none = trained[1][f"one{packed}"][0], trained[1][f"no-dropout{packed}"][0]
        diff = max_rel_diff(one, none)
        print(f"dropout 0.1 vs none{packed}: max relative loss difference {diff:.2e}")
        assert diff > 20 * TOL["rtol"]


@pytest.mark.parametrize("world,name", [(w, n) for w, layouts in LAYOUTS.items() for n in layouts])
def test_layout_matches_one_process(trained, world, name):
    reference = trained[1]["one-packed" if LAYOUTS[world][name][1] else "one"][0]
    for losses in trained[world][name]:
        diff = max_rel_diff(losses, reference)
        print(f"{name}: max relative loss difference {diff:.2e}")
        assert diff < TOL["rtol"]
