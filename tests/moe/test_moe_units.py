"""MoE units against hand computations, and the MoE layer under EP / ETP / TP / CP against one
process: router math, capacity, balancing losses, dispatcher permutations, module parity
(output and every gradient) and the layout invariance of the balancing loss."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_harness import run_workers
from megatron_cp import tensor_parallel as tpar
from megatron_cp.distributed.initialize import initialize_model_parallel
from megatron_cp.model import GPTConfig
from megatron_cp.moe import MoELayer
from megatron_cp.moe import take_stats as moe_take_stats
from megatron_cp.moe import update_expert_bias as moe_update_expert_bias
from megatron_cp.moe import update_qb_beta as moe_update_qb_beta
from megatron_cp.moe.balancing import AttachLoss, aux_loss, z_loss
from megatron_cp.moe.dispatcher import chunk_order, permute, unpermute
from megatron_cp.moe.routing import (apply_capacity, expert_capacity, scores_for_balancing,
                                     topk_routing)

close = torch.testing.assert_close
PREFIX = "decoder.layers.0.mlp"


# ---------------------------------------------------------------------------------------------
# Router math by hand: plain Python floats and loops.

def _softmax(xs):
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [e / sum(exps) for e in exps]


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _sqrtsoftplus(x):
    return math.sqrt(math.log1p(math.exp(x)))


ELEMENTWISE = {"sigmoid": _sigmoid, "sqrtsoftplus": _sqrtsoftplus}


def _largest(values, k, allowed):
    return sorted(allowed, key=lambda i: -values[i])[:k]


def _route_row(row, k, score="softmax", pre_softmax=False, scale=None, num_groups=None,
               group_topk=None, bias=None):
    """One token's (probs [E], chosen experts) computed the long way."""
    experts = len(row)
    sig = [ELEMENTWISE[score](x) for x in row] if score != "softmax" else None
    if score == "softmax":
        select = _softmax(row) if pre_softmax else list(row)
    else:
        select = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(sig)]
    allowed = list(range(experts))
    if num_groups:
        size = experts // num_groups
        group_score = []
        for g in range(num_groups):
            members = sorted(select[g * size:(g + 1) * size], reverse=True)
            group_score.append(sum(members[:k // group_topk]))
        best = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
        allowed = [g * size + j for g in sorted(best) for j in range(size)]
    chosen = _largest(select, k, allowed)
    if score == "softmax":
        weights = [_softmax(row)[i] for i in chosen] if pre_softmax else \
            _softmax([row[i] for i in chosen])
    else:
        weights = [sig[i] for i in chosen]
        if k > 1:
            weights = [w / sum(weights) for w in weights]
    if scale:
        weights = [w * scale for w in weights]
    probs = [0.0] * experts
    for i, w in zip(chosen, weights):
        probs[i] = w
    return probs, set(chosen)


def _check_routing(logits, k, expected_sets=None, **kw):
    bias = kw.get("bias")
    probs, routing_map = topk_routing(
        logits, k, kw.get("score", "softmax"), kw.get("pre_softmax", False), kw.get("scale"),
        kw.get("num_groups"), kw.get("group_topk"),
        torch.tensor(bias, dtype=torch.float32) if bias is not None else None)
    assert routing_map.dtype == torch.bool and probs.shape == logits.shape
    for t, row in enumerate(logits.tolist()):
        want_probs, want_set = _route_row(row, k, **kw)
        got_set = set(torch.nonzero(routing_map[t]).flatten().tolist())
        assert got_set == want_set, (t, got_set, want_set)
        if expected_sets is not None:
            assert got_set == expected_sets[t], (t, got_set, expected_sets[t])
        # softmax / sigmoid run in fp32 whatever the logits' dtype (as Megatron-LM)
        close(probs[t], torch.tensor(want_probs, dtype=probs.dtype), rtol=1e-6, atol=1e-7)
        assert (probs[t][~routing_map[t]] == 0).all()
    return probs, routing_map


LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.0],
                       [0.5, -1.0, 2.0, 1.5],
                       [-2.0, 0.25, 0.0, -0.5]], dtype=torch.float64)


def test_topk_softmax_after_topk_and_pre_softmax():
    probs, _ = _check_routing(LOGITS, 2, [{1, 2}, {2, 3}, {1, 2}])
    # row 0 by hand: softmax of (3, 2) = (e/(e+1), 1/(e+1))
    e = math.e
    close(probs[0], torch.tensor([0.0, e / (e + 1), 1 / (e + 1), 0.0], dtype=torch.float64))
    close(probs.sum(1), torch.ones(3, dtype=torch.float64))  # top-k softmax sums to 1
    probs, _ = _check_routing(LOGITS, 2, [{1, 2}, {2, 3}, {1, 2}], pre_softmax=True)
    denominator = sum(math.exp(x) for x in (1.0, 3.0, 2.0, 0.0))
    close(probs[0, 1].item(), math.exp(3.0) / denominator)
    assert (probs.sum(1) < 1).all()  # pre-softmax top-k weights are not renormalised
    _check_routing(LOGITS, 1, [{1}, {2}, {1}])
    _check_routing(LOGITS, 3, pre_softmax=True)


def test_topk_sigmoid_normalised_and_scaling_factor():
    probs, _ = _check_routing(LOGITS, 2, score="sigmoid")
    close(probs.sum(1), torch.ones(3, dtype=torch.float64))  # normalised for k > 1
    probs, _ = _check_routing(LOGITS, 1, score="sigmoid")
    close(probs[0, 1].item(), _sigmoid(3.0))  # k = 1: the raw sigmoid score
    probs, _ = _check_routing(LOGITS, 2, scale=2.5)
    close(probs.sum(1), torch.full((3,), 2.5, dtype=torch.float64))
    _check_routing(LOGITS, 2, score="sigmoid", scale=0.5)
    _check_routing(LOGITS, 2, pre_softmax=True, scale=3.0)


def test_topk_sqrtsoftplus_like_sigmoid_with_its_own_scores():
    """Megatron-LM's sqrtsoftplus: sqrt(log(1 + e^x)) per expert, chosen and normalised as
    the sigmoid scores are, an expert bias shifting the choice only."""
    wide = torch.tensor([[1.0, 3.0, 2.0, 0.0, -4.0, 8.0],
                         [0.5, -30.0, 25.0, 1.5, -1.0, 0.0]], dtype=torch.float64)
    probs, _ = _check_routing(wide, 2, score="sqrtsoftplus")
    close(probs.sum(1), torch.ones(2, dtype=torch.float64))
    probs, _ = _check_routing(wide, 1, [{5}, {2}], score="sqrtsoftplus")
    close(probs[1, 2].item(), 25.0 ** 0.5, rtol=1e-12, atol=0)  # softplus(x) -> x for large x
    _check_routing(wide, 3, score="sqrtsoftplus", scale=2.0)
    _check_routing(wide, 2, [{0, 5}, {0, 2}], score="sqrtsoftplus",
                   bias=[9.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    _check_routing(wide, 2, num_groups=2, group_topk=1, score="sqrtsoftplus")
    # the balancing loss averages the scores normalised over all experts
    want = [[_sqrtsoftplus(x) for x in row] for row in wide.tolist()]
    want = torch.tensor([[v / sum(row) for v in row] for row in want], dtype=torch.float64)
    close(scores_for_balancing(wide, "sqrtsoftplus"), want, rtol=1e-12, atol=0)
    close(scores_for_balancing(wide.float(), "sqrtsoftplus"), want.float())


def test_group_limited_routing_scores_groups_by_sum_of_top_scores():
    # 3 groups of 2. Group scores (sum of the top topk/group_topk = 2): g0 = 1.0, g1 = 5.5,
    # g2 = 0.1 -> g1. The global top-2 would be {0, 2}; a max-scored group would be g0.
    logits = torch.tensor([[5.0, -4.0, 3.0, 2.5, 0.0, 0.1],
                           [0.0, 0.1, -1.0, -2.0, 1.0, 0.9]], dtype=torch.float64)
    _check_routing(logits, 2, [{2, 3}, {4, 5}], num_groups=3, group_topk=1)
    # pre-softmax groups sum softmax scores: g0 = e^5 + e^-4 beats g1 = e^3 + e^2.5
    _check_routing(logits, 2, [{0, 1}, {4, 5}], num_groups=3, group_topk=1, pre_softmax=True)
    # group_topk 2 of 3 groups, one expert scored per group (topk / group_topk = 1)
    _check_routing(logits, 2, [{0, 2}, {4, 5}], num_groups=3, group_topk=2)
    # 8 experts, 4 groups, top-4 inside the best 2 groups scored by their top-2 sums
    torch.manual_seed(0)
    wide = torch.randn(6, 8, dtype=torch.float64) * 2
    _check_routing(wide, 4, num_groups=4, group_topk=2)
    _check_routing(wide, 4, num_groups=4, group_topk=2, score="sigmoid")
    _check_routing(wide, 4, num_groups=4, group_topk=2, score="sigmoid",
                   bias=[0.0, 0.3, -0.2, 0.0, 0.5, 0.0, -0.4, 0.1])
    # sigmoid groups rank by summed sigmoid scores, not logits: g0 logits (10, -1) sum 9 >
    # g1 (2, 2) sum 4, but sigmoid sums 1.27 < 1.76 -> g1
    sig = torch.tensor([[10.0, -1.0, 2.0, 2.0]], dtype=torch.float64)
    _check_routing(sig, 2, [{2, 3}], num_groups=2, group_topk=1, score="sigmoid")
    _check_routing(sig, 2, [{0, 1}], num_groups=2, group_topk=1)


def test_sigmoid_expert_bias_changes_choice_not_probs():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, -1.0, 0.5, 0.0]], dtype=torch.float64)
    plain, plain_map = _check_routing(logits, 2, [{2, 3}, {0, 2}], score="sigmoid")
    bias = [5.0, 0.0, 0.0, -3.0]
    probs, routing_map = _check_routing(logits, 2, [{0, 2}, {0, 2}], score="sigmoid", bias=bias)
    s0, s2 = _sigmoid(0.0), _sigmoid(2.0)  # unbiased sigmoid scores of the chosen experts
    close(probs[0], torch.tensor([s0 / (s0 + s2), 0.0, s2 / (s0 + s2), 0.0], dtype=torch.float64))
    close(probs[1], plain[1])  # same choice -> same probs whatever the bias
    _check_routing(logits, 1, [{0}, {0}], score="sigmoid", bias=bias)
    close(topk_routing(logits, 1, "sigmoid", expert_bias=torch.tensor(bias))[0][0, 0].item(),
          _sigmoid(0.0))


def test_expert_capacity():
    assert expert_capacity(10, 4, 2, 1.0) == 5
    assert expert_capacity(10, 4, 2, 1.5) == 8  # ceil(7.5)
    assert expert_capacity(10, 4, 2, 0.3) == 2  # ceil(1.5)
    assert expert_capacity(6, 4, 2, 1.2) == 4  # ceil(3.6)
    assert expert_capacity(16, 8, 1, 1.0) == 2


# 5 tokens, 2 experts. Expert 0 routed by tokens 0, 1, 3, 4; expert 1 by 0, 2, 3.
CAP_PROBS = torch.tensor([[0.2, 0.1], [0.9, 0.0], [0.0, 0.7], [0.3, 0.2], [0.5, 0.0]])


def _rows_of(routing_map, expert):
    return set(torch.nonzero(routing_map[:, expert]).flatten().tolist())


def test_apply_capacity_drop_policies():
    routing_map = CAP_PROBS > 0
    probs, new_map = apply_capacity(CAP_PROBS, routing_map, 2, "probs")
    assert _rows_of(new_map, 0) == {1, 4} and _rows_of(new_map, 1) == {2, 3}  # highest probs
    close(probs, CAP_PROBS * new_map)
    probs, new_map = apply_capacity(CAP_PROBS, routing_map, 2, "position")
    assert _rows_of(new_map, 0) == {0, 1} and _rows_of(new_map, 1) == {0, 2}  # first ones
    close(probs, CAP_PROBS * new_map)
    for policy in ("probs", "position"):  # capacity above every load: nothing dropped
        probs, new_map = apply_capacity(CAP_PROBS, routing_map, 4, policy)
        assert torch.equal(new_map, routing_map)
        close(probs, CAP_PROBS)


def test_apply_capacity_pad_to_capacity():
    base = CAP_PROBS.clone()
    base[0, 1] = 0.0  # expert 1: tokens 2 and 3 only
    routing_map = base > 0
    for policy, kept0 in (("probs", {1, 3, 4}), ("position", {0, 1, 3})):
        probs, new_map = apply_capacity(base, routing_map, 3, policy, pad_to_capacity=True)
        assert new_map.sum(0).tolist() == [3, 3]  # exactly `capacity` rows per expert
        assert _rows_of(new_map, 0) == kept0
        assert _rows_of(new_map, 1) == {0, 2, 3}  # tokens 2, 3, then the first unrouted (0)
        expected = torch.zeros_like(base)
        for t in kept0:
            expected[t, 0] = base[t, 0]
        expected[2, 1], expected[3, 1] = base[2, 1], base[3, 1]  # the filler keeps prob 0
        close(probs, expected)
    probs, new_map = apply_capacity(base, routing_map, 1, "probs", pad_to_capacity=True)
    assert _rows_of(new_map, 0) == {1} and _rows_of(new_map, 1) == {2}


# ---------------------------------------------------------------------------------------------
# Balancing losses by hand.

def _aux_by_hand(scores, routing_map, weights, topk, coeff, seq_ids=None, num_seqs=1):
    """(value, d value / d scores) of the balancing loss with Python loops."""
    tokens, experts = len(scores), len(scores[0])
    seq_ids = seq_ids if seq_ids is not None else [0] * tokens
    per_seq, grads = [], [[0.0] * experts for _ in range(tokens)]
    valid = [b for b in range(num_seqs) if sum(weights[t] for t in range(tokens)
                                                 if seq_ids[t] == b) > 0]
    for b in valid:
        mine = [t for t in range(tokens) if seq_ids[t] == b]
        n = sum(weights[t] for t in mine)
        c = [sum(weights[t] * routing_map[t][i] for t in mine) for i in range(experts)]
        s = [sum(weights[t] * scores[t][i] for t in mine) for i in range(experts)]
        factor = coeff * experts / (topk * n * n)
        per_seq.append(factor * sum(s[i] * c[i] for i in range(experts)))
        for t in mine:
            for i in range(experts):
                grads[t][i] += factor * weights[t] * c[i] / len(valid)
    return sum(per_seq) / len(valid), grads


def _balancing_inputs(tokens, experts, topk, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen, dtype=torch.float64)
    scores = torch.softmax(logits, dim=-1).requires_grad_()
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(
        1, logits.topk(topk, dim=-1).indices, True)
    return scores, routing_map


def _run_aux(kind, scores, routing_map, weights, seq_ids=None, num_seqs=1, coeff=0.01, topk=2):
    scores = scores.detach().clone().requires_grad_()
    local, value = aux_loss(kind, scores, routing_map, weights, topk=topk, coeff=coeff,
                            token_groups=[None], seq_ids=seq_ids, num_seqs=num_seqs)
    close(local.detach(), value)  # one rank: its part is the whole loss
    local.backward()
    return value, scores.grad


def test_aux_loss_by_hand():
    scores, routing_map = _balancing_inputs(7, 4, 2, seed=1)
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 1.0, 1.0], dtype=torch.float64)
    value, grad = _run_aux("aux_loss", scores, routing_map, weights)
    want, want_grad = _aux_by_hand(scores.tolist(), routing_map.int().tolist(), weights.tolist(),
                                   topk=2, coeff=0.01)
    close(value.item(), want, rtol=1e-12, atol=0)
    close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # uniform scores and perfectly balanced counts give exactly coeff
    flat = torch.full((4, 4), 0.25, dtype=torch.float64)
    balanced = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 1, 0, 1]]).bool()
    value, _ = _run_aux("aux_loss", flat, balanced, torch.ones(4, dtype=torch.float64))
    close(value.item(), 0.01)


def test_seq_aux_loss_by_hand():
    scores, routing_map = _balancing_inputs(9, 4, 2, seed=2)
    seq_ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    # sequence 2 has no weighted token: it is left out of the mean
    weights = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    value, grad = _run_aux("seq_aux_loss", scores, routing_map, weights, seq_ids, num_seqs=3)
    want, want_grad = _aux_by_hand(scores.tolist(), routing_map.int().tolist(), weights.tolist(),
                                   topk=2, coeff=0.01, seq_ids=seq_ids.tolist(), num_seqs=3)
    close(value.item(), want, rtol=1e-12, atol=0)
    close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # it differs from the loss over the pooled tokens
    pooled, _ = _run_aux("aux_loss", scores, routing_map, weights)
    assert abs(pooled.item() - value.item()) > 1e-6


def test_z_loss_by_hand():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 4, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    weights = torch.tensor([1.0, 0.0, 1.0, 2.0, 1.0], dtype=torch.float64)
    local, value = z_loss(logits, weights, coeff=0.1, token_groups=[None])
    rows, w = logits.tolist(), weights.tolist()
    lse = [math.log(sum(math.exp(x) for x in row)) for row in rows]
    n = sum(w)
    # (the z-loss runs in fp32 like the router's softmax)
    close(value.item(), 0.1 * sum(w[t] * lse[t] ** 2 for t in range(5)) / n, rtol=1e-6, atol=0)
    close(local.detach(), value)
    local.backward()
    want = [[0.1 * w[t] * 2 * lse[t] * math.exp(x - lse[t]) / n for x in rows[t]] for t in range(5)]
    close(logits.grad, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-8)


def test_weight_zero_tokens_change_nothing():
    scores, routing_map = _balancing_inputs(6, 4, 2, seed=4)
    weights = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    seq_ids = torch.tensor([0, 1, 0, 1, 0, 1])
    extra_scores, extra_map = _balancing_inputs(5, 4, 2, seed=5)  # arbitrary padding tokens
    more_scores = torch.cat([scores.detach(), extra_scores.detach()])
    more_map = torch.cat([routing_map, extra_map])
    more_weights = torch.cat([weights, torch.zeros(5, dtype=torch.float64)])
    # padding rows in both sequences and in a third sequence that only holds padding
    more_seq = torch.cat([seq_ids, torch.tensor([0, 1, 2, 2, 1])])
    for kind in ("aux_loss", "seq_aux_loss"):
        a = (seq_ids, 2) if kind == "seq_aux_loss" else (None, 1)
        b = (more_seq, 3) if kind == "seq_aux_loss" else (None, 1)
        value, grad = _run_aux(kind, scores, routing_map, weights, *a)
        more_value, more_grad = _run_aux(kind, more_scores, more_map, more_weights, *b)
        close(more_value, value, rtol=1e-12, atol=0)
        close(more_grad[:6], grad, rtol=1e-12, atol=0)
        assert (more_grad[6:] == 0).all()
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 4, generator=gen, dtype=torch.float64).requires_grad_()
    padded = torch.cat([logits, 50 * torch.randn(5, 4, generator=gen, dtype=torch.float64)]) \
        .detach().requires_grad_()
    local, value = z_loss(logits, weights, coeff=0.1, token_groups=[None])
    more_local, more_value = z_loss(padded, more_weights, coeff=0.1, token_groups=[None])
    close(more_value, value, rtol=1e-6, atol=0)
    local.backward()
    more_local.backward()
    close(padded.grad[:6], logits.grad, rtol=1e-6, atol=0)
    assert (padded.grad[6:] == 0).all()


# ---------------------------------------------------------------------------------------------
# Dispatcher permutations.

def _expert_by_power(rows, counts):
    """A fake expert e that multiplies its rows by 2^e: the sum over a token's experts then
    spells out exactly which experts it went through, each once."""
    scale = torch.repeat_interleave(2.0 ** torch.arange(len(counts), dtype=rows.dtype),
                                    torch.tensor(counts))
    return rows * scale[:, None]


def test_permute_unpermute_round_trip():
    tokens, experts, topk = 7, 5, 2
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(tokens, experts, generator=gen, dtype=torch.float64)
    probs, routing_map = topk_routing(logits, topk)
    onehot = torch.eye(tokens, dtype=torch.float64)  # token t is the unit vector e_t
    rows, token_index, counts = permute(onehot, routing_map)
    assert counts == routing_map.sum(0).tolist() and rows.shape[0] == tokens * topk
    start = 0
    for e, n in enumerate(counts):  # expert-major, token order inside an expert
        assert token_index[start:start + n].tolist() == \
            [t for t in range(tokens) if routing_map[t, e]]
        start += n
    close(rows, onehot[token_index])
    out = unpermute(_expert_by_power(rows, counts), token_index, torch.ones_like(probs),
                    routing_map, tokens)
    code = [sum(2.0 ** e for e in range(experts) if routing_map[t, e]) for t in range(tokens)]
    close(out, torch.diag(torch.tensor(code, dtype=torch.float64)), rtol=0, atol=0)
    # identity expert, probs 1: every token comes back topk times itself
    x = torch.randn(tokens, 3, generator=gen, dtype=torch.float64)
    rows, token_index, counts = permute(x, routing_map)
    close(unpermute(rows, token_index, torch.ones_like(probs), routing_map, tokens), x * topk)
    # real probs: sum over chosen experts of prob x expert(token)
    out = unpermute(_expert_by_power(rows, counts), token_index, probs, routing_map, tokens)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for e in range(experts):
            if routing_map[t, e]:
                want[t] += probs[t, e] * 2.0 ** e * x[t]
    close(out, want)
    # after a capacity drop a token comes back once per expert that kept it (0 if none)
    dropped_probs, dropped = apply_capacity(probs, routing_map, 1, "position")
    rows, token_index, counts = permute(x, dropped)
    out = unpermute(rows, token_index, torch.ones_like(probs), dropped, tokens)
    close(out, x * dropped.sum(1, keepdim=True).to(x.dtype))
    assert (dropped_probs[~dropped] == 0).all()


def test_chunk_order_by_hand():
    # rows from 2 sources x 3 experts: s0 = [e0: r0 | e1: r1 r2 | e2: -], s1 = [e0: r3 r4 | e1: - |
    # e2: r5] -> expert-major: e0 (r0, r3, r4), e1 (r1, r2), e2 (r5)
    assert chunk_order(torch.tensor([[1, 2, 0], [2, 0, 1]])).tolist() == [0, 3, 4, 1, 2, 5]
    assert chunk_order(torch.tensor([[0, 0], [2, 1], [1, 0]])).tolist() == [0, 1, 3, 2]
    assert chunk_order(torch.tensor([[3], [1]])).tolist() == [0, 1, 2, 3]
    assert chunk_order(torch.tensor([[1, 1, 1]])).tolist() == [0, 1, 2]
    assert chunk_order(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


# ---------------------------------------------------------------------------------------------
# The MoE layer: one process against a plain loop; layouts against one process.

def _moe_config(**overrides):
    base = dict(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=16,
                ffn_hidden_size=16, hidden_dropout=0.0, attention_dropout=0.0, seed=11,
                init_method_std=0.4, num_moe_experts=4, moe_ffn_hidden_size=8,
                moe_router_topk=2)
    base.update(overrides)
    return GPTConfig(**base)


def _full_biases(config):
    """Nonzero expert biases [E, ffn (x2)] and [E, h], the same in every process."""
    gen = torch.Generator().manual_seed(99)
    stride = 2 if config.activation == "swiglu" else 1
    experts = config.num_moe_experts
    return (torch.randn(experts, config.moe_ffn_hidden_size * stride, generator=gen) * 0.3,
            torch.randn(experts, config.hidden_size, generator=gen) * 0.3)


def _build(config, state, ep_size=1, ep_rank=0, etp_size=1, etp_rank=0, tp_rank=0):
    layer = MoELayer(config, PREFIX, state, tpar.model_parallel_seed(config.seed, tp_rank))
    if config.add_bias_linear:
        fc1_bias, fc2_bias = _full_biases(config)
        stride = 2 if config.activation == "swiglu" else 1
        num_local = config.num_moe_experts // ep_size
        with torch.no_grad():
            for e in range(num_local):
                g = ep_rank * num_local + e
                layer.experts.linear_fc1.bias[e].copy_(
                    tpar.split_full(fc1_bias[g], 0, stride, etp_size, etp_rank))
                layer.experts.linear_fc2.bias[e].copy_(fc2_bias[g])
    return layer


def test_one_process_layer_matches_plain_loop():
    for activation in ("swiglu", "gelu"):
        config = _moe_config(activation=activation, moe_ffn_hidden_size=6)
        layer = _build(config, None)
        x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(8))
        out = layer(x)
        tokens = x.reshape(-1, 8)
        probs, routing_map = topk_routing(F.linear(tokens, layer.router.weight), 2)
        fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
        want = torch.zeros_like(tokens)
        for t in range(tokens.shape[0]):
            for e in range(4):
                if routing_map[t, e]:
                    h = fc1.weight[e] @ tokens[t] + fc1.bias[e]
                    if activation == "swiglu":
                        gate, up = h.chunk(2)
                        h = F.silu(gate) * up
                    else:
                        h = F.gelu(h)
                    want[t] += probs[t, e] * (fc2.weight[e] @ h + fc2.bias[e])
        close(out.reshape(-1, 8), want.detach(), rtol=1e-5, atol=1e-6)


def test_attach_loss_adds_scaled_loss_gradient():
    x = torch.randn(3, 4).requires_grad_()
    w = torch.randn(5).requires_grad_()
    y = AttachLoss.apply(x, (w ** 2).sum(), 0.3)
    close(y, x.detach(), rtol=0, atol=0)  # forward unchanged
    upstream = torch.randn(3, 4)
    y.backward(upstream)
    close(x.grad, upstream, rtol=0, atol=0)
    close(w.grad, 0.3 * 2 * w.detach())


def test_router_backward_adds_scaled_aux_and_z_loss():
    config = _moe_config(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.05)
    router = _build(config, None).router
    router.aux_loss_scale = 0.25
    tokens = torch.randn(6, 8, generator=torch.Generator().manual_seed(10))
    w = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    probs, routing_map = router(tokens, w, torch.zeros(6, dtype=torch.long), 1)
    weight = router.weight.detach().clone().requires_grad_()
    logits = tokens @ weight.t()  # [T, E]
    want_probs, want_map = topk_routing(logits.detach(), 2)
    close(probs, want_probs)
    assert torch.equal(routing_map, want_map)
    probs.backward(torch.zeros_like(probs))  # only the attached losses send a gradient
    # the losses written out: coeff E / (k N^2) sum_i S_i c_i and z_coeff sum w lse^2 / N
    n = w.sum()
    counts = (routing_map.float() * w[:, None]).sum(0)
    scores = torch.softmax(logits, dim=-1)
    aux = 0.3 * 4 / (2 * n ** 2) * ((scores * w[:, None]).sum(0) * counts).sum()
    z = 0.05 * (w * torch.logsumexp(logits, dim=-1) ** 2).sum() / n
    (want_grad,) = torch.autograd.grad(0.25 * (aux + z), weight)
    close(router.weight.grad, want_grad)
    close(router.stats["aux_loss"].float(), aux.detach())
    close(router.stats["z_loss"].float(), z.detach())
    close(router.stats["tokens_per_expert"].float(), counts)


def _router_grad_and_aux(types, coeffs):
    """(router weight gradient, recorded balancing loss) of one routed microbatch of 2
    sequences, only the attached losses sending a gradient."""
    router = _build(_moe_config(moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs),
                    None).router
    gen = torch.Generator().manual_seed(21)
    tokens = torch.randn(8, 8, generator=gen)
    w = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    probs, _ = router(tokens, w, torch.arange(2).repeat(4), 2)
    probs.backward(torch.zeros_like(probs))
    return router.weight.grad.clone(), router.stats["aux_loss"].item()


def test_a_list_of_balancing_types_adds_their_losses_each_with_its_coefficient():
    """Megatron-LM's list meaning: every aux-loss type of the list, weighted by the
    coefficient at its place (a single-entry list is the plain value); none adds nothing."""
    aux_grad, aux = _router_grad_and_aux("aux_loss", 0.3)
    seq_grad, seq = _router_grad_and_aux("seq_aux_loss", 0.05)
    both_grad, both = _router_grad_and_aux(("seq_aux_loss", "none", "aux_loss"), (0.05, 0.7, 0.3))
    close(both_grad, aux_grad + seq_grad)
    close(both, aux + seq)
    assert aux > 0 and seq > 0 and abs(aux - seq) > 1e-6
    one = _moe_config(moe_router_load_balancing_type=("seq_aux_loss",), moe_aux_loss_coeff=(0.5,))
    assert (one.moe_router_load_balancing_type, one.moe_aux_loss_coeff) == ("seq_aux_loss", 0.5)
    assert one.balancing_losses() == {"seq_aux_loss": 0.5}
    # Megatron-LM's order, a zero coefficient adds nothing, a repeated type takes its first
    listed = _moe_config(moe_router_load_balancing_type=("global_aux_loss", "aux_loss",
                                                         "seq_aux_loss", "aux_loss"),
                         moe_aux_loss_coeff=(0.1, 0.2, 0.0, 0.4))
    assert list(listed.balancing_losses().items()) == [("aux_loss", 0.2), ("global_aux_loss", 0.1)]
    assert _moe_config(moe_router_load_balancing_type="none",
                       moe_aux_loss_coeff=0.3).balancing_losses() == {}


def test_zero_weight_tokens_do_not_count_in_recorded_losses():
    config = _moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    layer = _build(config, None)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 3, 8, generator=gen)  # [s, b, h]
    mask = torch.ones(3, 4)  # [b, s]
    mask[0, 3] = mask[2, 0] = mask[2, 1] = 0.0
    layer(x, mask)
    stats = {k: v.clone() for k, v in layer.router.stats.items()}
    layer.router.reset_stats()
    noisy = x.clone()
    for s, b in ((3, 0), (0, 2), (1, 2)):
        noisy[s, b] = 40 * torch.randn(8, generator=gen)
    layer(noisy, mask)  # other values at the weight-0 tokens: same statistics
    for k, v in layer.router.stats.items():
        close(v, stats[k], rtol=1e-6, atol=0)
    layer.router.reset_stats()
    kept = x.permute(1, 0, 2)[mask.bool()].reshape(-1, 1, 8)  # only the weighted tokens
    layer(kept)
    for k, v in layer.router.stats.items():
        close(v, stats[k], rtol=1e-6, atol=0)
    assert stats["tokens_per_expert"].sum().item() == 2 * mask.sum().item()
    assert stats["aux_loss"] > 0 and stats["z_loss"] > 0


class _OneProcess:
    """The part of a ParallelState that the per-step MoE helpers read, for one process."""
    device = torch.device("cpu")

    def size(self, name):
        return 1


class _Block(torch.nn.Module):
    """Stands for a transformer layer whose MLP is an MoE layer."""
    is_moe = True

    def __init__(self, layer_number, mlp):
        super().__init__()
        self.layer_number, self.mlp = layer_number, mlp


def test_expert_bias_update_and_take_stats():
    config = _moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_bias_update_rate=0.1, moe_aux_loss_coeff=0.2)
    layer = _build(config, None)
    chunk = torch.nn.ModuleList([_Block(1, layer)])
    gen = torch.Generator().manual_seed(12)
    assert (layer.router.expert_bias == 0).all()
    for _ in range(2):  # two microbatches before the update
        mask = (torch.rand(2, 5, generator=gen) > 0.2).float()
        layer(torch.randn(5, 2, 8, generator=gen), mask)
    totals = layer.router.stats["tokens_per_expert"].clone()
    aux_total = layer.router.stats["aux_loss"].item()
    assert aux_total > 0
    counts = layer.router.bias_counts.clone()  # accumulated over both microbatches
    close(counts, totals)
    assert len(set(counts.tolist())) > 1  # unequal loads to correct
    moe_update_expert_bias([chunk], _OneProcess())
    want = 0.1 * torch.sign(counts.mean() - counts)
    close(layer.router.expert_bias, want.float())
    assert layer.router.bias_counts is None
    aux, z, tokens = moe_take_stats([chunk], _OneProcess(), 2, 4)
    close(aux, torch.tensor([0.0, aux_total], dtype=torch.float64))
    close(z, torch.zeros(2, dtype=torch.float64))
    close(tokens, torch.stack([torch.zeros(4, dtype=torch.float64), totals]))
    assert layer.router.stats["tokens_per_expert"].sum() == 0  # reset


def _qb_by_hand(logits, beta, weights, k):
    """Quantile balancing the long way: (each token's experts, and per expert the
    (m k // E + 1)-th largest of logit - alpha over the m weighted tokens, alpha a token's
    (k+1)-th largest logit - beta)."""
    experts = len(beta)
    chosen, alphas = [], []
    for row in logits:
        shifted = sorted(((x - b, i) for i, (x, b) in enumerate(zip(row, beta))), reverse=True)
        chosen.append({i for _, i in shifted[:k]})
        alphas.append(shifted[k][0])
    counted = [t for t, w in enumerate(weights) if w > 0]
    share = len(counted) * k // experts
    quantiles = [sorted((logits[t][e] - alphas[t] for t in counted), reverse=True)[share]
                 for e in range(experts)]
    return chosen, quantiles


def test_quantile_balancing_by_hand():
    """Each token's experts are the top-k of logits - qb_beta, weighted by the plain score
    function there; after the global batch the bias moves to ema x bias + (1 - ema) x the
    mean quantile of its microbatches, centred (Megatron-LM's); evaluation only routes."""
    config = _moe_config(moe_router_load_balancing_type="quantile_balancing",
                         moe_router_quantile_balancing_ema=0.25, moe_z_loss_coeff=0.01)
    layer = _build(config, None)
    router = layer.router
    chunk = torch.nn.ModuleList([_Block(1, layer)])
    beta = [0.3, -0.1, 0.0, -0.2]
    router.qb_beta.copy_(torch.tensor(beta))
    gen = torch.Generator().manual_seed(31)
    quantiles = []
    for weights in ([1.0] * 9, [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]):
        tokens = torch.randn(9, 8, generator=gen)
        w = torch.tensor(weights)
        probs, routing_map = router(tokens, w, torch.zeros(9, dtype=torch.long), 1)
        logits = (tokens.double() @ router.weight.detach().double().t()).tolist()
        chosen, q = _qb_by_hand(logits, beta, weights, 2)
        quantiles.append(q)
        for t, experts in enumerate(chosen):
            assert set(torch.nonzero(routing_map[t]).flatten().tolist()) == experts, t
            picked = sorted(experts)
            want = _softmax([logits[t][e] for e in picked])  # softmax over the chosen logits
            close(probs[t, picked].double(), torch.tensor(want, dtype=torch.float64),
                  rtol=1e-5, atol=1e-6)
    close(router.qb_sums[-1].item(), 2.0)  # two microbatches counted
    moe_update_qb_beta([chunk], _OneProcess())
    new = [0.25 * b + 0.75 * (q0 + q1) / 2 for b, q0, q1 in zip(beta, *quantiles)]
    new = [v - sum(new) / 4 for v in new]
    close(router.qb_beta, torch.tensor(new, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert router.qb_sums is None and "qb_beta" in router.state_dict()
    router.eval()  # evaluation: routed by the bias, nothing recorded
    tokens = torch.randn(9, 8, generator=gen)
    _, routing_map = router(tokens, torch.ones(9), torch.zeros(9, dtype=torch.long), 1)
    logits = (tokens.double() @ router.weight.detach().double().t()).tolist()
    chosen, _ = _qb_by_hand(logits, router.qb_beta.tolist(), [1.0] * 9, 2)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in routing_map] == chosen
    assert router.qb_sums is None


# --- multi-process parity -------------------------------------------------------------------

def _inputs(rank, shape, hidden, with_mask):
    gen = torch.Generator().manual_seed(1000 + rank)
    s, b = shape
    x = torch.randn(s, b, hidden, generator=gen)
    grad = torch.randn(s, b, hidden, generator=gen)
    mask = None
    if with_mask:
        mask = (torch.rand(b, s, generator=gen) > 0.3).float()
        mask[0, 0] = 0.0  # at least one weight-0 token
    return x, grad, mask


def _run(layer, x, grad, mask, scale):
    layer.router.aux_loss_scale = scale
    x = x.clone().requires_grad_()
    out = layer(x, mask)
    out.backward(grad)
    stats = {k: v.clone() for k, v in layer.router.stats.items()}
    layer.router.reset_stats()
    return out.detach(), x.grad, stats


def _summed(param, state, name):
    """``param``'s grad summed over group ``name`` (zeros where a rank has none)."""
    grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
    if state.size(name) > 1:
        dist.all_reduce(grad, group=state.group(name))
    return grad


def _check_router_and_experts(what, config, layer, ref, state):
    """Router grad summed over every rank (each routed its own tokens), expert weights and
    grads (summed over expert-DP; fc2's bias over ETP too) against the ETP shard of this EP
    rank's experts in the one-process reference."""
    router_grad = _summed(layer.router.weight, state, "tp")
    if state.size("dp_cp") > 1:
        dist.all_reduce(router_grad, group=state.group("dp_cp"))
    close(router_grad, ref.router.weight.grad, msg=lambda m: f"{what} router grad: {m}")
    ep_size, ep_rank = state.size("ep"), state.rank("ep")
    etp_size, etp_rank = state.size("etp"), state.rank("etp")
    stride = 2 if config.activation == "swiglu" else 1
    num_local = config.num_moe_experts // ep_size
    mine = slice(ep_rank * num_local, (ep_rank + 1) * num_local)
    fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
    rfc1, rfc2 = ref.experts.linear_fc1, ref.experts.linear_fc2
    pairs = [("fc1.weight", fc1.weight, rfc1.weight, 1, stride),
             ("fc2.weight", fc2.weight, rfc2.weight, 2, 1)]
    if config.add_bias_linear:
        pairs += [("fc1.bias", fc1.bias, rfc1.bias, 1, stride), ("fc2.bias", fc2.bias, rfc2.bias,
                                                                   None, 1)]
    for name, p, rp, dim, st in pairs:
        grad = _summed(p, state, "edp")
        if dim is None:  # fc2's bias: whole on every ETP rank, added (and its grad) on one
            dim, st, shards = 1, 1, 1
            if etp_size > 1:
                dist.all_reduce(grad, group=state.group("etp"))
        else:
            shards = etp_size
        shard = lambda t: tpar.split_full(t[mine], dim, st, shards, etp_rank % shards)
        close(p.detach(), shard(rp.detach()), rtol=0, atol=0, msg=lambda m: f"{what} {name}: {m}")
        close(grad, shard(rp.grad), msg=lambda m: f"{what} {name} grad: {m}")


def _check_parity(case, state, rank):
    """TP = CP = 1: every rank holds its own microbatch. Against one process running each
    rank's microbatch in turn, or (``joint``, global_aux_loss) all of them as one batch."""
    config = _moe_config(**case["config"])
    world = dist.get_world_size()
    scale = case.get("scale", 1.0)
    shape, with_mask = case.get("shape", (5, 2)), case.get("mask", False)
    inputs = [_inputs(r, shape, config.hidden_size, with_mask) for r in range(world)]
    ref = _build(config, None)
    if case.get("joint"):
        # global_aux_loss: the DP ranks' parts sum to one loss per microbatch, world of them
        b = shape[1]
        cat = lambda i, dim: torch.cat([inp[i] for inp in inputs], dim) \
            if inputs[0][i] is not None else None
        out, x_grad, stats = _run(ref, cat(0, 1), cat(1, 1), cat(2, 0), scale * world)
        ref_runs = [(out[:, r * b:(r + 1) * b], x_grad[:, r * b:(r + 1) * b], stats)
                    for r in range(world)]
    else:
        ref_runs = [_run(ref, *inp, scale) for inp in inputs]
    layer = _build(config, state, state.size("ep"), state.rank("ep"), state.size("etp"),
                   state.rank("etp"))
    out, x_grad, stats = _run(layer, *inputs[rank], scale)
    what = case["name"]
    if config.moe_expert_capacity_factor is not None:  # the case does drop tokens
        capacity = expert_capacity(shape[0] * shape[1], config.num_moe_experts,
                                   config.moe_router_topk, config.moe_expert_capacity_factor)
        assert max(run[2]["tokens_per_expert"].max() for run in ref_runs) > capacity, what
    close(out, ref_runs[rank][0], msg=lambda m: f"{what} output: {m}")
    close(x_grad, ref_runs[rank][1], msg=lambda m: f"{what} input grad: {m}")
    counts = stats["tokens_per_expert"].clone()
    if case.get("joint"):
        dist.all_reduce(counts)
    for key, value in (("aux_loss", stats["aux_loss"]), ("z_loss", stats["z_loss"]),
                       ("tokens_per_expert", counts)):
        close(value, ref_runs[rank][2][key], msg=lambda m: f"{what} {key}: {m}")
    if config.moe_aux_loss_coeff:
        assert stats["aux_loss"] > 0, what
    _check_router_and_experts(what, config, layer, ref, state)
    return what


def _check_token_split(case, state, rank):
    """TP (with or without SP) or CP ranks sharing one microbatch: output, gradients and the
    recorded balancing losses equal one process running the whole microbatch."""
    config = _moe_config(**case["config"])
    s, b = case.get("shape", (6, 3))
    scale = case.get("scale", 1.0)
    x, grad, mask = _inputs(0, (s, b), config.hidden_size, True)  # the same microbatch
    full_mask = mask
    ref = _build(config, None)
    ref_out, ref_x_grad, ref_stats = _run(ref, x, grad, mask, scale)
    layer = _build(config, state, state.size("ep"), state.rank("ep"), state.size("etp"),
                   state.rank("etp"), tp_rank=state.rank("tp"))
    part = slice(None)  # tp: both ranks hold the whole microbatch, the layer splits it
    if case["split"] == "sp":
        part = slice(rank * s // 2, (rank + 1) * s // 2)  # [s/tp, b, h]; the layer cuts the mask
    elif case["split"] == "cp":
        part = slice(rank * s // 2, (rank + 1) * s // 2)
        mask = mask[:, part]  # [b, s/cp] of this CP rank
    out, x_grad, stats = _run(layer, x[part], grad[part], mask, scale)
    what = case["name"]
    close(out, ref_out[part], msg=lambda m: f"{what} output: {m}")
    close(x_grad, ref_x_grad[part], msg=lambda m: f"{what} input grad: {m}")
    for key in ("aux_loss", "z_loss"):  # the whole microbatch's value on every rank
        close(stats[key], ref_stats[key], rtol=1e-6, atol=0, msg=lambda m: f"{what} {key}: {m}")
    assert stats["z_loss"] > 0 and (stats["aux_loss"] > 0) == (config.moe_aux_loss_coeff > 0)
    counts = stats["tokens_per_expert"].clone()  # this rank's tokens only
    dist.all_reduce(counts)
    close(counts, ref_stats["tokens_per_expert"])
    # weight-0 tokens are not counted
    assert ref_stats["tokens_per_expert"].sum() == config.moe_router_topk * full_mask.sum()
    _check_router_and_experts(what, config, layer, ref, state)
    return what


def _parity_worker(rank, world, cases):
    done = []
    for case in cases:
        sizes = case["sizes"]
        state = initialize_model_parallel(
            sizes.get("tp", 1), sizes.get("cp", 1), 1, sizes.get("ep", 1), sizes.get("etp", 1),
            device=torch.device("cpu"))
        check = _check_token_split if "split" in case else _check_parity
        done.append(check(case, state, rank))
    return done


def _names(cases):
    return [c["name"] for c in cases]


LOSSES = dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
SINKHORN = dict(moe_router_load_balancing_type="sinkhorn", moe_z_loss_coeff=0.1)

CASES_2 = [
    dict(name="ep2 alltoall gelu", sizes=dict(ep=2),
         config=dict(moe_token_dispatcher_type="alltoall")),
    dict(name="ep2 allgather swiglu", sizes=dict(ep=2),
         config=dict(moe_token_dispatcher_type="allgather", activation="swiglu")),
    dict(name="ep2 alltoall capacity probs", sizes=dict(ep=2), shape=(6, 2),
         config=dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=0.5)),
    dict(name="ep2 allgather capacity position padded", sizes=dict(ep=2), shape=(6, 2),
         config=dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=0.75,
                     moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True,
                     activation="swiglu")),
    dict(name="ep2 alltoall aux + z loss", sizes=dict(ep=2), mask=True, scale=0.7,
         config=dict(moe_token_dispatcher_type="alltoall", activation="swiglu", **LOSSES)),
    dict(name="ep2 allgather seq aux loss sigmoid", sizes=dict(ep=2), mask=True, scale=1.3,
         config=dict(moe_token_dispatcher_type="allgather", **LOSSES,
                     moe_router_load_balancing_type="seq_aux_loss",
                     moe_router_score_function="sigmoid")),
    dict(name="ep2 alltoall global aux loss", sizes=dict(ep=2), mask=True, scale=0.6,
         joint=True, config=dict(moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.5,
                                 moe_router_load_balancing_type="global_aux_loss")),
    dict(name="tp2 ep2 split tokens", sizes=dict(tp=2, ep=2), split="tp",
         config=dict(moe_token_dispatcher_type="alltoall", **LOSSES)),
    dict(name="tp2 sequence parallel seq aux", sizes=dict(tp=2), split="sp", scale=0.5,
         config=dict(sequence_parallel=True, moe_router_load_balancing_type="seq_aux_loss",
                     **LOSSES)),
    dict(name="tp2 etp2 sequence parallel alltoall", sizes=dict(tp=2, etp=2), split="sp",
         config=dict(sequence_parallel=True, moe_token_dispatcher_type="alltoall",
                     activation="swiglu", **LOSSES)),
    dict(name="tp2 etp2 split tokens allgather", sizes=dict(tp=2, etp=2), split="tp",
         config=dict(moe_token_dispatcher_type="allgather", **LOSSES)),
    dict(name="cp2 ep2 allgather seq aux", sizes=dict(cp=2, ep=2), split="cp",
         config=dict(moe_token_dispatcher_type="allgather", activation="swiglu",
                     moe_router_load_balancing_type="seq_aux_loss", **LOSSES)),
    # Sinkhorn balances each microbatch's weighted tokens, wherever they are held
    dict(name="ep2 alltoall sinkhorn", sizes=dict(ep=2), mask=True,
         config=dict(moe_token_dispatcher_type="alltoall", **SINKHORN)),
    dict(name="tp2 sequence parallel sinkhorn", sizes=dict(tp=2), split="sp",
         config=dict(sequence_parallel=True, **SINKHORN)),
    dict(name="tp2 ep2 split tokens sinkhorn top-1", sizes=dict(tp=2, ep=2), split="tp",
         config=dict(moe_token_dispatcher_type="alltoall", moe_router_topk=1, **SINKHORN)),
    dict(name="cp2 ep2 sinkhorn", sizes=dict(cp=2, ep=2), split="cp",
         config=dict(moe_token_dispatcher_type="allgather", **SINKHORN)),
]

CASES_4 = [
    dict(name="ep4 alltoall swiglu", sizes=dict(ep=4),
         config=dict(moe_token_dispatcher_type="alltoall", activation="swiglu")),
    dict(name="ep4 allgather gelu aux", sizes=dict(ep=4), mask=True,
         config=dict(moe_token_dispatcher_type="allgather", **LOSSES)),
    dict(name="ep2 etp2 alltoall swiglu aux", sizes=dict(ep=2, etp=2), mask=True, scale=0.7,
         config=dict(moe_token_dispatcher_type="alltoall", activation="swiglu", **LOSSES)),
    dict(name="ep2 etp2 allgather gelu", sizes=dict(ep=2, etp=2),  # ffn 6: the per-expert loop
         config=dict(moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=6)),
    dict(name="ep2 etp2 alltoall capacity probs padded", sizes=dict(ep=2, etp=2), shape=(6, 2),
         config=dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=0.75,
                     moe_pad_expert_input_to_capacity=True)),
]


def test_moe_layer_parity_world2():
    """EP = 2 (both dispatchers, capacity, all balancing losses) and one microbatch split over
    TP, TP with SP (also with ETP = 2), and CP: every rank against one process."""
    assert run_workers(_parity_worker, 2, CASES_2) == [_names(CASES_2)] * 2


def test_moe_layer_parity_world4():
    """EP = 4 and EP = 2 x ETP = 2, both dispatchers, against one process."""
    assert run_workers(_parity_worker, 4, CASES_4) == [_names(CASES_4)] * 4
