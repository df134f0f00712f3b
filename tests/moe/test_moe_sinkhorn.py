"""--moe-router-load-balancing-type sinkhorn (Megatron-LM's S-BASE router): in training each
token's experts are the top-k of the Sinkhorn-balanced scores of its microbatch, its weights
the plain logits' sigmoid (top-1) or softmax over all experts (top-k > 1); no balancing loss;
in evaluation the plain top-k. Checked against a hand-written iteration, against the aux-loss
router (it routes otherwise), for padding (weight-0 tokens move nothing) and, end to end,
under EP = 2 and TP = 2 with sequence parallelism against one process. The MoE layer's own
parity (output and every gradient under EP, TP, SP, CP) is in test_moe_units.py."""
import math

import pytest
import torch

from dist_harness import run_workers
from megatron_cp import tensor_parallel as tpar
from megatron_cp.model import GPTConfig
from megatron_cp.moe import MoELayer
from megatron_cp.moe.balancing import sinkhorn
from megatron_cp.moe.routing import sinkhorn_routing, topk_routing
from training_utils import max_rel_diff, train_runs

close = torch.testing.assert_close

# Every token prefers expert 0, then 1: the plain top-k piles them onto the first experts.
SKEWED = torch.tensor([[4.0, 2.5, 0.3, -1.0],
                       [3.5, 2.0, 0.1, -0.5],
                       [3.0, 2.2, 0.5, 0.0],
                       [3.8, 1.5, -0.2, 0.4],
                       [2.9, 2.4, 0.6, -0.8],
                       [3.2, 1.9, 0.2, 0.9]])


def _sinkhorn_by_hand(logits, tol=1e-4):
    """Megatron-LM's iteration with Python floats: the balanced scores, row by row."""
    cost = [[math.exp(x) for x in row] for row in logits]
    tokens, experts = len(cost), len(cost[0])
    d0, d1 = [1.0] * tokens, [1.0] * experts
    d1_old, error = d1, 1e9
    while error > tol:
        d0 = [1 / tokens / (sum(d1[j] * cost[i][j] for j in range(experts)) + 1e-8)
              for i in range(tokens)]
        d1 = [1 / experts / (sum(d0[i] * cost[i][j] for i in range(tokens)) + 1e-8)
              for j in range(experts)]
        error = sum(abs(a - b) for a, b in zip(d1_old, d1)) / experts
        d1_old = d1
    return [[d1[j] * cost[i][j] * d0[i] for j in range(experts)] for i in range(tokens)]


def _top(row, k):
    return set(sorted(range(len(row)), key=lambda j: -row[j])[:k])


def _probs_by_hand(row, chosen, k):
    """sigmoid (top-1) or softmax over all experts (top-k > 1), kept at ``chosen``."""
    if k == 1:
        scores = [1 / (1 + math.exp(-x)) for x in row]
    else:
        exps = [math.exp(x) for x in row]
        scores = [e / sum(exps) for e in exps]
    return [scores[j] if j in chosen else 0.0 for j in range(len(row))]


@pytest.mark.parametrize("topk", [1, 2])
def test_sinkhorn_routing_by_hand(topk):
    rows = SKEWED.tolist()
    balanced = _sinkhorn_by_hand(rows)
    got = sinkhorn(SKEWED, torch.ones(6), [])
    close(got, torch.tensor(balanced), rtol=1e-5, atol=0)
    probs, routing_map = sinkhorn_routing(SKEWED, topk, got.topk(topk, dim=-1).indices)
    for t, row in enumerate(rows):
        chosen = _top(balanced[t], topk)
        assert set(torch.nonzero(routing_map[t]).flatten().tolist()) == chosen, t
        close(probs[t], torch.tensor(_probs_by_hand(row, chosen, topk)), rtol=1e-6, atol=0)
    # evaluation: the plain top-k of the same scores
    probs, routing_map = sinkhorn_routing(SKEWED, topk)
    for t, row in enumerate(rows):
        chosen = _top(row, topk)
        assert set(torch.nonzero(routing_map[t]).flatten().tolist()) == chosen, t
        close(probs[t], torch.tensor(_probs_by_hand(row, chosen, topk)), rtol=1e-6, atol=0)


def test_sinkhorn_spreads_what_the_top_k_router_piles_up():
    balanced = sinkhorn(SKEWED, torch.ones(6), [])
    _, sink_map = sinkhorn_routing(SKEWED, 1, balanced.topk(1, dim=-1).indices)
    _, plain_map = topk_routing(SKEWED, 1, pre_softmax=True)
    assert plain_map.sum(0).tolist() == [6, 0, 0, 0]  # every token on expert 0
    assert max(sink_map.sum(0).tolist()) <= 2  # at most two tokens per expert


def test_weight_zero_tokens_move_no_expert_scale():
    """Padding and loss-masked tokens are routed but do not enter the balance: changing
    their logits, or dropping them, leaves the other tokens' scores unchanged."""
    weights = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    base = sinkhorn(SKEWED, weights, [])
    noisy = SKEWED.clone()
    noisy[1], noisy[4] = torch.tensor([9.0, -3.0, 5.0, 1.0]), torch.tensor([-2.0, 7.0, 0.0, 3.0])
    kept = weights.bool()
    close(sinkhorn(noisy, weights, [])[kept], base[kept], rtol=1e-6, atol=0)
    close(sinkhorn(SKEWED[kept], torch.ones(4), [])[:, :], base[kept], rtol=1e-6, atol=0)


def _layer(**overrides):
    config = dict(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=16,
                  ffn_hidden_size=16, hidden_dropout=0.0, attention_dropout=0.0, seed=11,
                  init_method_std=0.4, num_moe_experts=4, moe_ffn_hidden_size=8,
                  moe_router_topk=2, moe_router_load_balancing_type="sinkhorn")
    config.update(overrides)
    config = GPTConfig(**config)
    return MoELayer(config, "decoder.layers.0.mlp", None, tpar.model_parallel_seed(11, 0))


def test_router_balances_in_training_and_takes_the_plain_top_k_in_evaluation():
    router = _layer().router
    tokens = torch.randn(12, 8, generator=torch.Generator().manual_seed(3)) * 2
    weights, seq_ids = torch.ones(12), torch.zeros(12, dtype=torch.long)
    logits = (tokens @ router.weight.t()).detach()
    balanced = _sinkhorn_by_hand(logits.tolist())
    probs, routing_map = router(tokens, weights, seq_ids, 1)
    for t, row in enumerate(logits.tolist()):
        chosen = _top(balanced[t], 2)
        assert set(torch.nonzero(routing_map[t]).flatten().tolist()) == chosen, t
        close(probs[t].detach(), torch.tensor(_probs_by_hand(row, chosen, 2)), rtol=1e-5, atol=0)
    probs.sum().backward()  # the weights' scores carry the router's gradient; no loss attached
    assert router.weight.grad.abs().sum() > 0 and router.stats["aux_loss"] == 0
    router.eval()
    _, routing_map = router(tokens, weights, seq_ids, 1)
    for t, row in enumerate(logits.tolist()):
        assert set(torch.nonzero(routing_map[t]).flatten().tolist()) == _top(row, 2), t


@pytest.mark.parametrize("overrides, named", [
    (dict(moe_aux_loss_coeff=0.01), "moe_aux_loss_coeff (0.01) must be 0"),
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function would have no effect"),
    (dict(moe_router_topk_scaling_factor=2.0, moe_router_pre_softmax=True),
     "moe_router_pre_softmax, moe_router_topk_scaling_factor would have no effect"),
])
def test_settings_sinkhorn_would_ignore_are_refused(overrides, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        _layer(**overrides)


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 1 "
        "--lr-decay-style cosine --hidden-dropout 0 --attention-dropout 0 --log-interval 100 "
        "--eval-iters 0 --seed 11 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 "
        "--num-experts 4 --moe-router-topk 2 --moe-z-loss-coeff 0.01 --moe-ffn-hidden-size 48 "
        "--train-iters 4 --no-bias-gelu-fusion")
SINKHORN = BASE + " --moe-router-load-balancing-type sinkhorn"


def test_sinkhorn_training_equals_one_process_under_ep_and_tp_sp():
    reference, aux = run_workers(train_runs, 1, [SINKHORN, BASE + " --moe-aux-loss-coeff 0.05"])[0]
    assert max_rel_diff(aux, reference) > 1e-4  # another routing: another curve (noise ~1e-7)
    layouts = ["--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
               "--tensor-model-parallel-size 2 --sequence-parallel"]
    results = run_workers(train_runs, 2, [f"{SINKHORN} {layout}" for layout in layouts])[0]
    for layout, losses in zip(layouts, results):
        assert max_rel_diff(losses, reference) <= 1e-5, (layout, losses, reference)
