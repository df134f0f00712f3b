"""Gated DeltaNet hybrids under context parallelism (context_parallel/gated_delta.py): 5
training steps at CP = 2 and 4 with every --cp-comm-type (a2a: head all-to-all; p2p and
all_gather: conv-tail and state passing; a2a+p2p: both), plain and packed (every document is
zigzagged over 2 x CP chunks, so each crosses shard boundaries), TP2 x CP2 / PP2 x CP2,
EP2 x CP2 (Qwen3-Next's MoE) and CP2 x DP2 with the distributed optimizer, give the
one-process losses. A broken chain (state or conv tail not passed, or passed across
a document boundary) moves the loss far beyond that tolerance."""
import pytest

from dist_harness import run_workers
from test_gdn_model import HYBRID, PACKED, TOLERANCE
from training_utils import assert_refused, max_rel_diff, train_losses

# four key heads (eight value heads): the a2a all-to-all splits them over CP = 4
GDN = HYBRID.replace("--linear-num-key-heads 2 --linear-num-value-heads 4",
                     "--linear-num-key-heads 4 --linear-num-value-heads 8")
CP2, CP4 = "--context-parallel-size 2 --cp-comm-type", "--context-parallel-size 4 --cp-comm-type"
LAYOUTS = {
    "cp2-p2p": f"{CP2} p2p", "cp2-a2a": f"{CP2} a2a",
    "cp4-p2p": f"{CP4} p2p", "cp4-a2a": f"{CP4} a2a",
    "cp4-a2a+p2p": f"{CP4} a2a+p2p --hierarchical-context-parallel-sizes 2 2",
    "tp2-sp-cp2-p2p": f"--tensor-model-parallel-size 2 --sequence-parallel {CP2} p2p",
    "tp2-sp-cp2-a2a": f"--tensor-model-parallel-size 2 --sequence-parallel {CP2} a2a",
    "pp2-cp2-p2p": f"--pipeline-model-parallel-size 2 {CP2} p2p",
    "pp2-cp2-a2a": f"--pipeline-model-parallel-size 2 {CP2} a2a",
}


def _world(layout):
    world = 1
    for flag in ("--context-parallel-size", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size"):
        if flag in layout:
            world *= int(layout.split(flag)[1].split()[0])
    return world


@pytest.fixture(scope="module")
def references():
    return {packed: run_workers(train_losses, 1, f"{GDN} {PACKED if packed else ''}")[0]
            for packed in (False, True)}


@pytest.fixture(scope="module")
def plain_tolerance(references):
    """The tolerance of plain (unpacked) 160-token sequences: 4x the drift of the same single
    process with only its fp32 summation order changed (micro-batches of 1 instead of 2).

    The losses of a parallel layout agree with one process to ~1e-7 (fp32 rounding) for the
    first steps, then the training amplifies that rounding ~2.5x per step (init std 0.1, lr
    3e-3): at step 9 TP2+SP alone (no CP) is off by ~9e-6, one process with micro-batches of
    1 (or 4) by ~4e-6 (~6e-6), TP2+SP x CP2 p2p by ~1.1e-5 (measured). A layout reorders several reductions
    at once (TP's split matmuls, SP, CP's chunk cuts, the gradient all-reduce), each drifting
    like one reordering; 4x covers that. A real bug is off from the first steps and by far
    more (the broken-chain tests: > 1e-4)."""
    reordered = run_workers(train_losses, 1, GDN.replace("--micro-batch-size 2",
                                                         "--micro-batch-size 1"))[0]
    spread = max_rel_diff(reordered, references[False])
    print(f"single-process reordering drift {spread:.2e}")
    return max(TOLERANCE, 4 * spread)


def _check(losses, reference, label, tolerance=TOLERANCE):
    reported = [rank_losses for rank_losses in losses if rank_losses]  # PP: the last stage
    assert reported
    for rank_losses in reported:
        diff = max_rel_diff(rank_losses, reference)
        print(f"{label}: max relative loss difference {diff:.2e} (tolerance {tolerance:.1e})")
        assert diff < tolerance


# plain sequences at CP = 2 and TP2 x CP2 p2p; packed documents (the harder chain: resets at
# global document boundaries inside shards) everywhere
@pytest.mark.parametrize("layout,packed", [
    (layout, packed) for layout in LAYOUTS for packed in (False, True)
    if layout.startswith("cp2") or layout == "tp2-sp-cp2-p2p" or packed],
    ids=lambda v: v if isinstance(v, str) else ("packed" if v else "plain"))
def test_gdn_hybrid_under_context_parallelism_matches_single_process(request, references, layout,
                                                                     packed):
    argv = f"{GDN} {LAYOUTS[layout]} {PACKED if packed else ''}"
    tolerance = TOLERANCE if packed else request.getfixturevalue("plain_tolerance")
    _check(run_workers(train_losses, _world(LAYOUTS[layout]), argv), references[packed],
           f"{layout} packed={packed}", tolerance)


# Qwen3-Next's MoE: top-2 of 4 experts and a gated shared expert
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 "
       "--moe-shared-expert-intermediate-size 24 --moe-shared-expert-gate")


@pytest.mark.parametrize("world,model,layout", [
    (2, MOE, f"--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall {CP2} p2p"),
    (4, "", f"{CP2} a2a --use-distributed-optimizer"),  # DP = 4 / CP = 2
], ids=["ep2-cp2-p2p-moe", "cp2-dp2-a2a-distributed-optimizer"])
def test_gdn_under_context_parallelism_with_experts_or_distributed_optimizer(
        references, plain_tolerance, world, model, layout):
    reference = run_workers(train_losses, 1, f"{GDN} {model}")[0] if model else references[False]
    _check(run_workers(train_losses, world, f"{GDN} {model} {layout}"), reference, layout,
           plain_tolerance)


def _broken_losses(rank, world, argv, broken):
    """Worker: train with one link of the state-passing chain broken."""
    import torch
    from megatron_cp.context_parallel import gated_delta

    def across_documents(gathered, size, rank, step):  # document d's end enters d + 1
        num_docs = gathered.shape[1] // 2

        def run(carry):
            carries = []
            for chunk in range(2 * size):
                carries.append(carry)
                owner, half = gated_delta._owner(chunk, size)
                carry = step(carry, gathered[owner, half * num_docs:(half + 1) * num_docs])
            return carries, carry
        end = run(None)[1]
        carries = run(torch.cat([torch.zeros_like(end[:1]), end[:-1]]))[0]
        return torch.cat([carries[rank], carries[2 * size - 1 - rank]])

    patches = {
        "state not passed": ("_next_state", lambda dv: lambda state, data: data[..., :dv] * 0),
        "conv tail not passed": ("_next_tail", lambda width, shift: lambda tail, window:
                                 window * 0),
        "chain crosses documents": ("_chain", across_documents),
    }
    name, fn = patches[broken]
    setattr(gated_delta, name, fn)
    return train_losses(rank, world, argv)


@pytest.mark.parametrize("broken,packed", [
    ("state not passed", False), ("conv tail not passed", False),
    ("chain crosses documents", True),
])
def test_a_broken_chain_moves_the_loss_beyond_tolerance(references, broken, packed):
    argv = f"{GDN} {CP2} p2p {PACKED if packed else ''}"
    losses = run_workers(_broken_losses, 2, argv, broken)[0]
    diff = max_rel_diff(losses, references[packed])
    print(f"{broken}: max relative loss difference {diff:.2e}")
    assert diff > 10 * TOLERANCE


@pytest.mark.parametrize("extra,line", [
    (f"{CP2} a2a --linear-num-key-heads 1 --linear-num-value-heads 2",
     "--linear-num-key-heads (1) must be divisible by --tensor-model-parallel-size x the "
     "all-to-all size of --cp-comm-type a2a (1 x 2)"),
    (f"{CP4} a2a+p2p --hierarchical-context-parallel-sizes 2 2 --linear-num-key-heads 1 "
     "--linear-num-value-heads 2",
     "--linear-num-key-heads (1) must be divisible by --tensor-model-parallel-size x the "
     "all-to-all size of --cp-comm-type a2a+p2p (1 x 2)"),
])
def test_gdn_all_to_all_needs_divisible_heads(extra, line):
    argv = f"{GDN.replace('--linear-num-key-heads 4 --linear-num-value-heads 8', '')} {extra}"
    assert_refused(argv, line, world_size=_world(extra))


def _layer_parity(rank, world, comm_type, packed):
    """Worker: one GDN layer under CP against the same layer on the whole sequence: outputs
    and every parameter and input gradient (CP grads summed over the ranks)."""
    import torch
    import torch.distributed as dist
    from megatron_cp.data.microbatch import prepare_microbatch
    from megatron_cp.model.gated_delta_net import GatedDeltaNet
    from model_utils import tiny_config
    hierarchical = (2, 2) if comm_type == "a2a+p2p" else None
    gdn = dict(activation="swiglu", experimental_attention_variant="gdn",
               linear_attention_freq="2", linear_num_key_heads=4, linear_num_value_heads=8,
               linear_key_head_dim=8, linear_value_head_dim=8, init_method_std=0.1)
    config = tiny_config(cp_comm_type=comm_type, hierarchical_context_parallel_sizes=hierarchical,
                         **gdn)
    cp_group = dist.new_group(list(range(world)))
    groups = None
    if hierarchical:  # built by every rank in the same order: inner [0,1],[2,3]; outer [0,2],[1,3]
        inner = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
        outer = [dist.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
        groups = (inner, outer)
    reference = GatedDeltaNet(tiny_config(**gdn), "layer", None)
    layer = GatedDeltaNet(config, "layer", None, cp_group=cp_group, hierarchical_groups=groups)
    b, s, lengths = 2, 160, [24, 40, 56, 40]  # documents: multiples of 2 x CP (no padding)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(s, b, 32, generator=gen, requires_grad=True)
    weight = torch.randn(s, b, 32, generator=gen)
    docs = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths)).expand(b, s) \
        if packed else None
    terms = _record_gate_terms(reference)
    y_ref = reference(x, document_ids=docs)
    (y_ref * weight).sum().backward()
    tokens = torch.arange(s).expand(b, s)
    batch = dict(tokens=tokens, labels=tokens, loss_mask=torch.ones(b, s),
                 position_ids=tokens, document_ids=docs)
    local = prepare_microbatch(batch, rank, world)
    index = local["token_index"][0]  # the same in both samples
    assert bool((local["token_index"] == index).all())
    x_local = x.detach()[index].requires_grad_()
    y = layer(x_local, token_index=local["token_index"], document_ids=local["document_ids"])
    (y * weight[index]).sum().backward()
    grad_x = torch.zeros_like(x).index_copy(0, index, x_local.grad)
    out = {"y": (y.detach(), y_ref.detach()[index]), "x": (grad_x, x.grad)}
    for (name, p), p_ref in zip(layer.named_parameters(), reference.parameters()):
        out[name] = (p.grad, p_ref.grad)
    for key, (mine, _) in out.items():
        if key != "y":
            dist.all_reduce(mine, group=cp_group)
    return {key: max_rel(*pair) for key, pair in out.items()}, terms()


def _record_gate_terms(layer):
    """Wrap ``layer.gates`` to keep g and a; returns a function giving, after the backward,
    the cancellation of the A_log and dt_bias gradients: per parameter, max over heads of the
    sum over tokens of |term| divided by the largest |gradient| (the sum of the terms).
    dL/dA_log_h = sum_t dL/dg_t g_t and dL/ddt_bias_h = sum_t dL/dg_t dg_t/da_t with
    dg/da = -exp(A_log) sigmoid(a + dt_bias): fp32 rounding of each term (~1e-6 relative, as
    for the other gradients) adds up over sum |term|, not over |sum|."""
    import torch
    gates, kept = layer.gates, {}

    def recording(b, a, first_key_head=0):
        g, beta = gates(b, a, first_key_head)
        g.retain_grad()
        kept.update(g=g, a=a)
        return g, beta

    layer.gates = recording

    def cancellation():
        g, a = kept["g"], kept["a"].float()  # [b, s, heads]
        slope = -layer.A_log.float().exp() * torch.sigmoid(a + layer.dt_bias.float())
        out = {}
        for name, terms in (("A_log", g.grad * g), ("dt_bias", g.grad * slope)):
            out[name] = float(terms.abs().sum((0, 1)).max() / terms.sum((0, 1)).abs().max())
        return out
    return cancellation


def max_rel(a, b):
    """Largest difference relative to the largest magnitude of the reference."""
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("comm_type,world,packed", [
    ("p2p", 2, False), ("p2p", 2, True), ("a2a", 2, True), ("all_gather", 2, True),
    ("p2p", 4, True), ("a2a+p2p", 4, True)])
def test_gdn_layer_under_context_parallelism_matches_whole_sequence(comm_type, world, packed):
    diffs, cancellation = run_workers(_layer_parity, world, comm_type, packed)[0]
    print(comm_type, world, packed, diffs, cancellation)
    # fp32, chunks cut at other places than one process's 64-token chunks: outputs and
    # weight gradients ~1e-6 relative, 1e-5 with room. A_log and dt_bias gradients are, per
    # head, sums over all b x s tokens of terms of both signs: the same per-term precision
    # scaled by how much they cancel (sum |term| / |sum|, measured ~5-20 here)
    for key in ("A_log", "dt_bias"):
        assert diffs.pop(key) < 1e-5 * cancellation[key], (key, cancellation)
    assert max(diffs.values()) < 1e-5, diffs
