"""Multi-head latent attention (--multi-latent-attention): the layer against DeepSeek's
equations written out densely here, key and value head dims that differ through every CP
exchange, 5 training steps of a DeepSeek-V3-shaped model under TP+SP, every CP type, PP and
packed documents against one process, and the flags' rules."""
import math

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_workers
from megatron_cp.context_parallel import (ContextParallelAttention, reference_attention,
                                          zigzag_indices, zigzag_split)
from megatron_cp.model.multi_latent_attention import MultiLatentAttention
from megatron_cp.layers.rotary import yarn_concentration_factor, yarn_frequencies
from megatron_cp.tensor_parallel import RNGStatesTracker
from model_utils import tiny_config
from training_utils import TINY, assert_refused, max_rel_diff, train_losses, train_runs

MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, normalization="RMSNorm", qk_layernorm=True,
           rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_deepseek(x, positions, inv_freq, factor):
    """DeepSeek / Hugging Face's MLA rotary: de-interleave the channels (even ones, then odd
    ones), then turn the halves; x [s, b, n, d], positions [b, s]."""
    d = x.shape[-1]
    x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    angles = positions.t()[..., None, None].double() * inv_freq.double()  # [s, b, 1, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1) * factor
    sin = torch.cat([angles.sin(), angles.sin()], -1) * factor
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * cos + rotated * sin


def _dense_mla(layer, config, x, positions, yarn):
    """MLA from DeepSeek-V2's equations, in float64 with one causal softmax: the test's own
    reference, reading only the layer's weights."""
    w = {n: p.double() for n, p in layer.named_parameters()}
    eps, nh = config.norm_epsilon, config.num_attention_heads
    dq, dp, dv = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    x = x.double()
    s, b, _ = x.shape
    c_q = _rms(x @ w["linear_q_down_proj.weight"].t(), w["q_layernorm.weight"], eps)
    q = (c_q @ w["linear_q_up_proj.weight"].t()).view(s, b, nh, dq + dp)
    ckv_kpe = x @ w["linear_kv_down_proj.weight"].t()
    c_kv = _rms(ckv_kpe[..., :config.kv_lora_rank], w["kv_layernorm.weight"], eps)
    k_pe = ckv_kpe[..., config.kv_lora_rank:][:, :, None]  # [s, b, 1, dp]: one for all heads
    kv = (c_kv @ w["linear_kv_up_proj.weight"].t()).view(s, b, nh, dq + dv)
    f = config.rotary_scaling_factor
    if yarn:
        inv_freq = yarn_frequencies(dp, config.rotary_base, f, 4096, 32.0, 1.0)
        factor = yarn_concentration_factor(f, config.mscale, config.mscale_all_dim)
    else:
        inv_freq = 1.0 / config.rotary_base ** (torch.arange(0, dp, 2).double() / dp)
        factor = 1.0
    q_pe = _rope_deepseek(q[..., dq:], positions, inv_freq, factor)
    k_pe = _rope_deepseek(k_pe, positions, inv_freq, factor).expand(s, b, nh, dp)
    query = torch.cat([q[..., :dq], q_pe], -1)
    key = torch.cat([kv[..., :dq], k_pe], -1)
    mscale = 0.1 * config.mscale_all_dim * math.log(f) + 1.0 if f > 1 else 1.0
    scale = mscale * mscale / math.sqrt(dq + dp)
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) * scale
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), kv[..., dq:])
    return out.reshape(s, b, nh * dv) @ w["linear_proj.weight"].t()


@pytest.mark.parametrize("rope_type", ["yarn", "rope"])
def test_layer_matches_deepseek_equations(rope_type):
    """Forward and every weight's gradient equal the dense float64 equations (fp32 layer:
    relative ~1e-5); YaRN with DeepSeek-V3's factor 40, mscale 1, mscale_all_dim 1, so the
    softmax-scale correction (x 1.87) and the rotary concentration are both exercised."""
    config = tiny_config(num_attention_heads=4, hidden_size=32, add_bias_linear=False,
                         rope_type=rope_type, **MLA)
    assert config.rope_type == rope_type
    layer = MultiLatentAttention(config, "decoder.layers.0.self_attention", None, None,
                                 RNGStatesTracker())
    torch.manual_seed(0)
    x = torch.randn(12, 2, 32)
    positions = torch.arange(12).expand(2, 12) + torch.tensor([[0], [37]])  # [b, s]
    for p in layer.parameters():  # norms away from 1, so a wrong norm placement shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    out = layer(x, positions, token_index=torch.arange(12).expand(2, 12))
    ref = _dense_mla(layer, config, x, positions, rope_type == "yarn")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(layer.parameters()), grad)
    ref_grads = torch.autograd.grad(ref, [p for p in layer.parameters()], grad.double(),
                                    allow_unused=False)
    for (name, _), g, r in zip(layer.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_no_q_lora_and_config_defaults():
    """q_lora_rank None: one linear_q_proj (with --qk-layernorm its input, the hidden
    states, is normalised first, as Megatron-LM's fused norm+linear does); rope_type
    defaults to yarn with MLA; Megatron-LM's flag defaults."""
    config = tiny_config(multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=16,
                         qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    assert config.rope_type == "yarn"
    layer = MultiLatentAttention(config, "p", None, None, RNGStatesTracker())
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes["linear_q_proj.weight"] == (4 * 12, 32)
    assert shapes["q_layernorm.weight"] == (32,) and shapes["kv_layernorm.weight"] == (16,)
    assert shapes["linear_kv_down_proj.weight"] == (16 + 4, 32)
    assert shapes["linear_kv_up_proj.weight"] == (4 * (8 + 8), 16)
    assert "linear_q_down_proj.weight" not in shapes
    defaults = tiny_config(multi_latent_attention=True)
    assert (defaults.q_lora_rank, defaults.kv_lora_rank, defaults.qk_head_dim,
            defaults.qk_pos_emb_head_dim, defaults.v_head_dim) == (None, 32, 128, 64, 128)


# --- key and value head dims that differ, through every CP exchange ---------------------

DOCS = [0] * 10 + [1] * 13 + [2] * 9  # documents crossing the shard boundaries (s = 32)


def _cp_attention_worker(rank, world, cases):
    torch.manual_seed(3)
    b, s, nh, dk, dv = 2, 32, 4, 12, 6
    q, k, v = torch.randn(b, nh, s, dk), torch.randn(b, nh, s, dk), torch.randn(b, nh, s, dv)
    docs = torch.tensor(DOCS).expand(b, s)
    dout = torch.randn(b, nh, s, dv)
    cp_group = dist.new_group(list(range(world)))
    inner = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None
    outer = [dist.new_group([0, 2]), dist.new_group([1, 3])] if world == 4 else None
    tokens = zigzag_indices(rank, world, s).expand(b, -1)
    failures = []
    for comm_type, kernel, packed in cases:
        shard = [zigzag_split(t, rank, world, 2).clone().requires_grad_() for t in (q, k, v)]
        hierarchical = (inner[rank // 2], outer[rank % 2]) if comm_type == "a2a+p2p" else None
        attention = ContextParallelAttention(cp_group, comm_type, nh, nh, hierarchical,
                                             softmax_scale=0.3, kernel=kernel)
        local_docs = zigzag_split(docs, rank, world, 1) if packed else None
        out = attention(*shard, tokens, local_docs)
        grads = torch.autograd.grad(out, shard, zigzag_split(dout, rank, world, 2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*full, None, docs if packed else None, 0.3)
        ref_grads = torch.autograd.grad(ref, full, dout)
        pairs = [(out, zigzag_split(ref, rank, world, 2))] + \
            [(g, zigzag_split(r, rank, world, 2)) for g, r in zip(grads, ref_grads)]
        for got, want in pairs:
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                failures.append((comm_type, kernel, packed, (got - want).abs().max().item()))
    return failures


def test_context_parallel_attention_with_narrower_values():
    """dk = 12, dv = 6 (no padding): ring, Ulysses, hybrid and all-gather attention, with the
    CPU kernels and the plain ones, plain and with packed documents, give the reference's
    output and q, k, v gradients."""
    cases = [(c, kernel, packed) for c in ("p2p", "a2a", "all_gather")
             for kernel in ("auto", "torch") for packed in (False, True)]
    assert run_workers(_cp_attention_worker, 2, cases) == [[], []]
    hybrid = [("a2a+p2p", "auto", packed) for packed in (False, True)]
    assert run_workers(_cp_attention_worker, 4, hybrid) == [[]] * 4


# --- 5 training steps: every layout gives the one-process losses ------------------------

# Megatron-LM's DeepSeek-V3 test flags (tests/functional_tests/test_cases/moe/
# gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed), shrunk: one dense layer, then MoE layers
# with a grouped sigmoid router, expert bias and a shared expert
DEEPSEEK = (f"{TINY.replace('--num-layers 2', '--num-layers 4')} --train-iters 5 "
            "--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 8 "
            "--qk-pos-emb-head-dim 4 --v-head-dim 6 --qk-layernorm --normalization RMSNorm "
            "--norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights "
            "--disable-bias-linear --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 "
            "--num-experts 4 --moe-layer-freq ([0]*1+[1]*3) --moe-ffn-hidden-size 16 "
            "--moe-shared-expert-intermediate-size 16 --moe-router-topk 2 "
            "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
            "--moe-router-num-groups 2 --moe-router-group-topk 1 "
            "--moe-router-topk-scaling-factor 2.0 --moe-router-load-balancing-type seq_aux_loss "
            "--moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32 --moe-router-pre-softmax "
            "--moe-token-dispatcher-type alltoall")
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss"
LAYOUTS = {  # world size -> [(name, flags, packed)]
    2: [("tp2-sp", "--tensor-model-parallel-size 2 --sequence-parallel", False),
        ("cp2-p2p", "--context-parallel-size 2 --cp-comm-type p2p", False),
        ("cp2-a2a", "--context-parallel-size 2 --cp-comm-type a2a", False),
        ("pp2", "--pipeline-model-parallel-size 2", False),
        ("cp2-p2p-packed", "--context-parallel-size 2 --cp-comm-type p2p", True)],
    4: [("tp2-cp2-allgather", "--tensor-model-parallel-size 2 --sequence-parallel "
         "--context-parallel-size 2 --cp-comm-type all_gather", False),
        ("cp4-a2a+p2p", "--context-parallel-size 4 --cp-comm-type a2a+p2p "
         "--hierarchical-context-parallel-sizes 2 2", False),
        ("cp2-a2a-packed", "--context-parallel-size 2 --cp-comm-type a2a", True)],
    8: [("tp2-cp2-pp2-packed", "--tensor-model-parallel-size 2 --sequence-parallel "
         "--context-parallel-size 2 --cp-comm-type p2p --pipeline-model-parallel-size 2", True)],
}


@pytest.fixture(scope="module")
def references():
    runs = run_workers(train_runs, 1, [DEEPSEEK, f"{DEEPSEEK} {PACKED}"])[0]
    assert not any(isinstance(run, str) for run in runs), runs
    return {False: runs[0], True: runs[1]}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_deepseek_layouts_match_single_process(references, world):
    """Each layout of this world size in one launch; every rank's lm loss curve equals the
    one-process one to a relative 1e-5 (fp32)."""
    argvs = [f"{DEEPSEEK} {flags} {PACKED if packed else ''}"
             for _, flags, packed in LAYOUTS[world]]
    results = run_workers(train_runs, world, argvs, timeout=300)
    for rank_runs in results:
        for (name, _, packed), losses in zip(LAYOUTS[world], rank_runs):
            assert not isinstance(losses, str), (name, losses)
            diff = max_rel_diff(losses, references[packed])
            print(f"{name}: max relative loss difference {diff:.2e}")
            assert diff < 1e-5, (name, diff)


def test_packed_documents_and_softmax_correction_change_the_loss(references):
    """The references are not blind: packing changes the curve, and so does dropping the
    YaRN softmax-scale correction (--mscale-all-dim 0: scale x 1 instead of x 1.87) beyond
    the layouts' tolerance (~3e-5: the scores of a freshly initialised model are small; YaRN
    against plain rope moves these tiny heads' loss by ~3e-6 only. The layer test above
    checks both exactly.)"""
    assert max_rel_diff(references[True], references[False]) > 1e-3
    # the correction's effect grows with training: 8e-6 after 5 steps, so 10 steps here
    longer = DEEPSEEK.replace("--train-iters 5", "--train-iters 10")
    corrected, uncorrected = run_workers(train_runs, 1, [
        longer, longer.replace("--mscale-all-dim 1.0", "--mscale-all-dim 0")])[0]
    assert max_rel_diff(uncorrected, corrected) > 1e-5


@pytest.mark.parametrize("extra,line", [
    ("--q-lora-rank 8", "--q-lora-rank (8) applies to --multi-latent-attention only"),
    ("--rope-type yarn", "--rope-type ('yarn') applies to --multi-latent-attention only"),
    ("--multi-latent-attention --group-query-attention --num-query-groups 2",
     "--num-query-groups (2): every MLA head has its own key and value"),
    ("--multi-latent-attention --position-embedding-type yarn",
     "--position-embedding-type ('yarn') would rotate the hidden states a second time"),
    ("--multi-latent-attention --qk-pos-emb-head-dim 5", "--qk-pos-emb-head-dim (5) must be even"),
    ("--multi-latent-attention --yarn-beta-fast 16",
     "--yarn-beta-fast (16.0) applies only to --position-embedding-type yarn"),
    ("--mla-down-proj-fusion", "--mla-down-proj-fusion: fuses multi-latent attention's"),
    ("--cache-mla-latents", "--cache-mla-latents: caching MLA's latents"),
])
def test_mla_user_errors(extra, line):
    assert_refused(f"{TINY} --train-iters 1 {extra}", line)


def test_model_flops_count_mla_projections_and_head_dims():
    """The throughput's FLOPs count MLA's own projections and its two head dims."""
    from megatron_cp.observability.training_log import model_flops_per_token
    config = tiny_config(num_layers=1, **MLA)
    plain = tiny_config(num_layers=1, normalization="RMSNorm", qk_layernorm=True)
    h, nh, s = 32, 4, 16
    attention = 2 * (24 * (h + nh * 12) + h * (16 + 4) + 16 * nh * (8 + 6) + nh * 6 * h) \
        + 2 * s * nh * (12 + 6)
    standard = 2 * h * 3 * nh * 8 + 2 * nh * 8 * h + 4 * s * nh * 8
    assert model_flops_per_token(config, s) - model_flops_per_token(plain, s) == \
        3 * (attention - standard)


def test_latent_cache_generation_equals_recomputation():
    """Greedy decoding through the latent cache (kv_lora_rank + qk_pos_emb_head_dim numbers
    per token and layer, not the heads' keys and values) gives the logits and tokens of
    recomputing the whole sequence; several new tokens after a cached prefix too."""
    from megatron_cp.inference.kv_cache import KVCache, cached_chunk_forward
    from megatron_cp.inference.mla_cache import LatentCache
    from megatron_cp.model import GPTModel
    torch.manual_seed(5)
    model = GPTModel(tiny_config(**MLA)).eval()
    tokens = torch.randint(0, 120, (2, 4))
    cache = KVCache([model], 14)
    with torch.no_grad():
        for _ in range(10):
            start = cache.length
            positions = torch.arange(start, tokens.shape[1]).expand(2, -1)
            cached = cached_chunk_forward(model, tokens[:, start:], positions, None,
                                          cache.layers[0])[0, :, :120]  # [b, v]
            whole = model(tokens, torch.arange(tokens.shape[1]).expand(2, -1))[-1, :, :120]
            torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
            tokens = torch.cat([tokens, cached.argmax(-1, keepdim=True)], dim=1)
        layer_cache = cache.layers[0][0]
        assert isinstance(layer_cache, LatentCache)
        assert tuple(layer_cache.latents.shape) == (14, 2, 16 + 4)
        prefix = KVCache([model], 14)
        positions = torch.arange(14).expand(2, -1)
        cached_chunk_forward(model, tokens[:, :6], positions[:, :6], None, prefix.layers[0])
        pieces = cached_chunk_forward(model, tokens[:, 6:], positions[:, 6:], None,
                                      prefix.layers[0])
        torch.testing.assert_close(pieces, model(tokens, positions)[-1:], rtol=1e-5, atol=1e-5)


def test_tp2_checkpoint_resumes_at_tp1(tmp_path, references):
    """A --ckpt-format torch checkpoint of the DeepSeek-shaped MLA model saved at TP2+SP
    (up projections split by heads, down projections replicated) resumes at TP=1 and
    continues the straight run's losses."""
    first = f"{DEEPSEEK} --tensor-model-parallel-size 2 --sequence-parallel --exit-interval 3 " \
            f"--save {tmp_path} --ckpt-format torch"
    run_workers(train_losses, 2, first)
    resumed = run_workers(train_losses, 1, f"{DEEPSEEK} --load {tmp_path}")[0]
    assert max_rel_diff(resumed, references[False][3:]) < 1e-5
