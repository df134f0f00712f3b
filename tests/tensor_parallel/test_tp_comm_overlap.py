"""--tp-comm-overlap: the sequence-parallel linears with their TP collectives overlapped with
the GEMMs (tensor_parallel/overlap.py) compute what the plain path computes.

The all-gather side's rows are the plain GEMM's rows: equal bit for bit. A sum the overlap
adds in another order (the ring reduce-scatter, the wgrad accumulated per chunk) is held to
the fp32 bound of reordering a sum of n terms: |a - b| <= 2 n eps sum|terms|.
"""
import pytest
import torch

from dist_harness import run_workers
from megatron_cp import tensor_parallel as tpar
from megatron_cp.distributed.initialize import initialize_model_parallel
from training_utils import TINY, assert_refused, max_rel_diff, train_losses

EPS = torch.finfo(torch.float32).eps
SETTINGS = (  # Megatron-LM's defaults, then each sub-flag switched
    tpar.TPCommOverlap(),
    tpar.TPCommOverlap(rs_dgrad=True),
    tpar.TPCommOverlap(ag=False, rs=False),
    tpar.TPCommOverlap(bulk_dgrad=False, bulk_wgrad=False),
)


def _sum_close(actual, expected, abs_terms, num_terms):
    """``actual`` and ``expected`` are one sum of ``num_terms`` terms added in two orders;
    ``abs_terms`` is the sum of the terms' magnitudes."""
    bound = 2 * num_terms * EPS * abs_terms
    excess = ((actual - expected).abs() - bound).max().item()
    assert excess <= 0, f"differs beyond the fp32 reordering bound by {excess:.3e}"


def _pair(cls, overlap, size_in, size_out, group, seed):
    """The same layer twice (same weights): plain, and with ``overlap``."""
    made = [cls(size_in, size_out, tp_group=group, init_method=tpar.normal_init(0.5), seed=seed,
                sequence_parallel=True, tp_comm_overlap=setting) for setting in (None, overlap)]
    with torch.no_grad():
        made[0].bias.normal_(generator=torch.Generator().manual_seed(seed))
        made[1].bias.copy_(made[0].bias)
    return made


def _run(layer, x, upstream):
    x = x.clone().requires_grad_()
    out = layer(x)
    if layer.tp_comm_overlap is not None:  # the overlapped path ran, not the plain one
        fns = [out.grad_fn] + [fn for fn, _ in out.grad_fn.next_functions]  # (+ bias)
        assert any(type(fn).__name__.endswith("ParallelOverlapBackward") for fn in fns), fns
    out.backward(upstream)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _layers(rank, world):
    group = initialize_model_parallel(tensor_model_parallel_size=world).group("tp")
    s, b, h, ffn = 4 * world, 3, 16, 8 * world
    gen = torch.Generator().manual_seed(100 + rank)
    x_local = torch.randn(s // world, b, h, generator=gen)  # [s/tp, b, h]
    up_col = torch.randn(s, b, ffn // world, generator=gen)  # [s, b, ffn/tp]
    h_local = torch.randn(s, b, ffn // world, generator=gen)  # [s, b, ffn/tp]
    up_row = torch.randn(s // world, b, h, generator=gen)  # [s/tp, b, h]
    x_full = tpar.gather_from_sequence_parallel_region(x_local, group).detach()  # [s, b, h]
    up_row_full = tpar.gather_from_sequence_parallel_region(up_row, group).detach()  # [s, b, h]

    def all_sum(t):
        return tpar.reduce_from_tensor_model_parallel_region(t, group)

    for overlap in SETTINGS:
        plain, lapped = _pair(tpar.ColumnParallelLinear, overlap, h, ffn, group, seed=3)
        ref, got = _run(plain, x_local, up_col), _run(lapped, x_local, up_col)
        assert torch.equal(got[0], ref[0]), "the all-gather side's rows must be the plain rows"
        weight = plain.weight.detach()
        # grad x: this rank's chunk of a sum over TP of grad W, each of ffn/tp terms
        mine = slice(rank * (s // world), (rank + 1) * (s // world))
        dgrad_terms = all_sum(up_col.abs().matmul(weight.abs()))[mine]
        _sum_close(got[1], ref[1], dgrad_terms, ffn)
        # grad W: a sum over the s x b tokens
        wgrad_terms = up_col.abs().reshape(-1, ffn // world).t() @ x_full.abs().reshape(-1, h)
        _sum_close(got[2], ref[2], wgrad_terms, s * b)
        _sum_close(got[3], ref[3], up_col.abs().sum((0, 1)), s * b)

        plain, lapped = _pair(tpar.RowParallelLinear, overlap, ffn, h, group, seed=4)
        ref, got = _run(plain, h_local, up_row), _run(lapped, h_local, up_row)
        weight = plain.weight.detach()
        fwd_terms = all_sum(h_local.abs().matmul(weight.abs().t()))[mine]
        _sum_close(got[0], ref[0], fwd_terms, ffn)
        if overlap.ag:  # grad x: rows of one GEMM either way
            assert torch.equal(got[1], ref[1]), "the backward all-gather's rows must be plain rows"
        else:
            torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
        wgrad_terms = up_row_full.abs().reshape(-1, h).t() @ h_local.abs().reshape(-1, ffn // world)
        _sum_close(got[2], ref[2], wgrad_terms, s * b)
        torch.testing.assert_close(got[3], ref[3], rtol=0, atol=0)  # the bias is outside
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_linears_match_the_plain_path(world):
    assert all(run_workers(_layers, world))


STEPS = f"{TINY} --train-iters 5 --sequence-parallel"
OVERLAP = "--tp-comm-overlap"


def _train_counting_rings(rank, world, argvs):
    """Worker: train each of ``argvs``; per run its losses and how many ring exchanges the
    overlapped linears posted (0: the plain path ran)."""
    from megatron_cp.distributed import ring_exchange
    from megatron_cp.tensor_parallel import overlap
    posts = []

    class CountingRing(ring_exchange.RingExchange):
        def post(self, tensors):
            posts.append(1)
            super().post(tensors)

    overlap.RingExchange = CountingRing
    runs = []
    for argv in argvs:
        del posts[:]
        runs.append((train_losses(rank, world, argv), len(posts)))
    return runs


@pytest.fixture(scope="module")
def reference():
    return run_workers(train_losses, 1, STEPS)[0]


@pytest.mark.parametrize("world,layout", [
    (2, "--tensor-model-parallel-size 2"),
    (4, "--tensor-model-parallel-size 4"),
    (4, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"),
    (4, "--tensor-model-parallel-size 2 --context-parallel-size 2 --tp-comm-overlap-rs-dgrad "
        "--no-tp-comm-bulk-dgrad"),
])
def test_training_with_overlap_gives_the_plain_and_one_process_losses(reference, world, layout):
    plain, lapped = f"{STEPS} {layout}", f"{STEPS} {layout} {OVERLAP}"
    for (plain_losses, plain_posts), (losses, posts) in run_workers(
            _train_counting_rings, world, [plain, lapped]):
        assert plain_posts == 0 and posts > 0, (plain_posts, posts)
        # every loss is a sum over many fp32 terms, some added in another order
        assert max_rel_diff(losses, plain_losses) < 1e-5
        assert max_rel_diff(losses, reference) < 1e-5
    assert reference[-1] < reference[0], "the tiny model must learn"


@pytest.mark.parametrize("argv,world", [
    (f"{TINY} --train-iters 5 --tensor-model-parallel-size 2 {OVERLAP}", 2),  # no SP
    (f"{STEPS} {OVERLAP}", 1),  # TP 1: Megatron-LM turns SP off, then refuses
])
def test_overlap_without_sequence_parallelism_is_refused(argv, world):
    assert_refused(argv, "--tp-comm-overlap (True) overlaps the sequence-parallel", world)
