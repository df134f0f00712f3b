"""Gated DeltaNet hybrids (3 GDN + 1 full-attention layer, Megatron-LM's flags) train to the
one-process losses under TP2 + SP and PP2, with and without packed documents; a broken
kernel (state dropped between chunks, state or conv leaking across documents) moves the loss
far beyond that tolerance, so the parity tests would catch it. Also: the flags' checks and
--attention-output-gate's formula."""
import pytest
import torch

from dist_harness import run_workers
from model_utils import tiny_config
from training_utils import TINY, assert_refused, max_rel_diff, train_losses

# init std 0.1: a dropped state moves the loss by far more than fp32 noise (at 0.02 it
# hides under ~1e-6); seq 160 = three 64-token chunks; heads and key heads split by TP2
HYBRID = (f"{TINY} --train-iters 5 --seq-length 160 --num-layers 4 --swiglu "
          "--disable-bias-linear --normalization RMSNorm --apply-layernorm-1p --qk-layernorm "
          "--group-query-attention --num-query-groups 2 --rotary-percent 0.5 "
          "--attention-output-gate --experimental-attention-variant gated_delta_net "
          "--linear-attention-freq 4 --linear-conv-kernel-dim 4 --linear-key-head-dim 8 "
          "--linear-value-head-dim 8 --linear-num-key-heads 2 --linear-num-value-heads 4 "
          "--init-method-std 0.1")
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss"
TOLERANCE = 1e-5  # fp32 sums of many terms


# the broken kernels' controls train longer: a bug's effect grows with the steps (a state
# leaking across documents moved the loss by 9e-6 after 5 steps, 2.9e-4 after 10), while a
# layout's fp32 drift stays far under TOLERANCE within 5
LONGER = HYBRID.replace("--train-iters 5", "--train-iters 10")


def _references(argv):
    return {packed: run_workers(train_losses, 1, f"{argv} {PACKED if packed else ''}")[0]
            for packed in (False, True)}


@pytest.fixture(scope="module")
def references():
    return _references(HYBRID)


@pytest.fixture(scope="module")
def longer_references():
    return _references(LONGER)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("layout", [
    "--tensor-model-parallel-size 2 --sequence-parallel",
    "--pipeline-model-parallel-size 2",
], ids=["tp2-sp", "pp2"])
def test_hybrid_layout_matches_single_process(references, layout, packed):
    losses = run_workers(train_losses, 2, f"{HYBRID} {layout} {PACKED if packed else ''}")
    for rank_losses in losses:
        if rank_losses:  # PP: the last stage reports them
            diff = max_rel_diff(rank_losses, references[packed])
            print(f"{layout} packed={packed}: max relative loss difference {diff:.2e}")
            assert diff < TOLERANCE


def _broken_losses(rank, world, argv, broken):
    """Worker: train with one of the known GDN bugs patched into the layer."""
    from megatron_cp.layers import gated_delta_rule as rule
    from megatron_cp.model import gated_delta_net
    kernel, conv = rule.chunk_gated_delta_rule, rule.causal_conv1d

    def per_chunk(q, k, v, g, beta, initial_state=None, output_final_state=False,
                  document_ids=None, **kw):  # the state is not carried from chunk to chunk
        outs = [kernel(*(x[:, i:i + 64] for x in (q, k, v, g, beta)), document_ids=None
                       if document_ids is None else document_ids[:, i:i + 64])[0]
                for i in range(0, q.shape[1], 64)]
        return torch.cat(outs, dim=1), None

    patches = {
        "state dropped between chunks": ("chunk_gated_delta_rule", per_chunk),
        "state leaks across documents": ("chunk_gated_delta_rule",
                                         lambda *a, document_ids=None, **kw: kernel(*a, **kw)),
        "conv leaks across documents": ("causal_conv1d",
                                        lambda *a, document_ids=None, **kw: conv(*a, **kw)),
    }
    name, fn = patches[broken]
    setattr(gated_delta_net, name, fn)
    return train_losses(rank, world, argv)


@pytest.mark.parametrize("broken,packed", [
    ("state dropped between chunks", False),
    ("state leaks across documents", True),
    ("conv leaks across documents", True),
])
def test_a_broken_kernel_moves_the_loss_beyond_tolerance(longer_references, broken, packed):
    losses = run_workers(_broken_losses, 1, f"{LONGER} {PACKED if packed else ''}", broken)[0]
    diff = max_rel_diff(losses, longer_references[packed])
    print(f"{broken}: max relative loss difference {diff:.2e}")
    assert diff > 10 * TOLERANCE  # measured: 1.5e-3, 2.9e-4, ...


def test_packed_documents_change_the_loss(longer_references):
    """The packed batch has documents whose GDN state matters (not a no-op mask)."""
    assert max_rel_diff(longer_references[True], longer_references[False]) > 100 * TOLERANCE


def test_layer_pattern_follows_linear_attention_freq():
    gdn = dict(activation="swiglu", experimental_attention_variant="gdn", num_layers=8,
               linear_num_key_heads=2, linear_num_value_heads=4)
    assert tiny_config(linear_attention_freq="4", **gdn).linear_attention_pattern() == \
        [True, True, True, False] * 2
    assert tiny_config(linear_attention_freq="([0]+[1]*3)*2", **gdn).linear_attention_pattern() \
        == [False, True, True, True] * 2
    assert tiny_config().linear_attention_pattern() == [False, False]


@pytest.mark.parametrize("extra,line", [
    ("--experimental-attention-variant gdn", "--experimental-attention-variant gdn needs "
                                             "--linear-attention-freq"),
    ("--experimental-attention-variant gdn2 --linear-attention-freq 2",
     "--experimental-attention-variant ('gdn2') is not built"),
    ("--linear-attention-freq 2", "--linear-attention-freq (2) places Gated DeltaNet layers"),
    ("--experimental-attention-variant gdn --linear-attention-freq 2 --linear-num-key-heads 3 "
     "--linear-num-value-heads 4", "--linear-num-value-heads (4) must be a multiple of"),
    ("--experimental-attention-variant gdn --linear-attention-freq 2 --linear-num-key-heads 3 "
     "--linear-num-value-heads 6 --tensor-model-parallel-size 2",
     "--linear-num-key-heads (3) must be divisible by --tensor-model-parallel-size (2)"),
    ("--experimental-attention-variant gdn --linear-attention-freq '[1,0,1]'",
     "--linear-attention-freq ([1,0,1]) has 3 entries for --num-layers (2)"),
])
def test_gdn_user_errors(extra, line):
    argv = f"{TINY} --swiglu {extra}".replace("'", "")
    world = 2 if "size 2" in extra else 1
    assert_refused(argv, line, world_size=world)


def test_gdn_needs_swiglu():
    assert_refused(f"{TINY} --experimental-attention-variant gdn --linear-attention-freq 2",
                   "Gated DeltaNet layers run SiLU in their conv and output gate")


def test_attention_output_gate_scales_by_sigmoid_of_the_gate_rows():
    """Gate rows of zero: sigmoid(0) = 1/2, so the gated layer is half the ungated one with
    the same q, k, v rows (before the output projection, which is linear)."""
    from megatron_cp.model.attention import SelfAttention
    from megatron_cp.tensor_parallel import model_parallel_seed
    plain_cfg = tiny_config(num_query_groups=2, add_bias_linear=False)
    gated_cfg = tiny_config(num_query_groups=2, add_bias_linear=False, attention_output_gate=True)
    rng = model_parallel_seed(7, 0, torch.device("cpu"))
    plain = SelfAttention(plain_cfg, "a", None, None, rng)
    gated = SelfAttention(gated_cfg, "a", None, None, rng)
    d, hpg = plain.head_dim, plain.heads_per_group
    with torch.no_grad():
        w = gated.linear_qkv.weight.view(2, 2 * hpg + 2, d, -1)  # per group [q | gate | k | v]
        w[:, hpg:2 * hpg] = 0
        plain.linear_qkv.weight.view(2, hpg + 2, d, -1).copy_(
            torch.cat([w[:, :hpg], w[:, 2 * hpg:]], dim=1))
        gated.linear_proj.weight.copy_(plain.linear_proj.weight)
    x = torch.randn(12, 2, 32)
    positions = torch.arange(12).expand(2, 12)
    torch.testing.assert_close(gated(x, positions), 0.5 * plain(x, positions))
