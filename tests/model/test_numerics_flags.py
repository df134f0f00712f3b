"""Megatron-LM model flags that change the math, each against its reference, in one process:
--apply-layernorm-1p, --qk-layernorm, YaRN (--position-embedding-type yarn, checked against
Hugging Face transformers' own YaRN), --rotary-interleaved, --squared-relu and
--no-position-embedding; and how their flags parse. Their parallel layouts, training,
checkpoints and export are in test_numerics_parallel.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_cp.cli.arguments import parse_args
from megatron_cp.model import GPTModel
from megatron_cp.layers.mlp import MLP
from megatron_cp.layers.rotary import (RotaryEmbedding, rotary_cos_sin, rotate,
                                      yarn_concentration_factor, yarn_frequencies)
from megatron_cp.moe.experts import GroupedExperts
from megatron_cp.startup import config_from_args
from model_utils import tiny_config
from training_utils import TINY

close = torch.testing.assert_close


def _batch(b=2, s=16, vocab=120, offset=0):
    """tokens, position ids (from ``offset``: beyond 0 the angles are large) and labels."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (b, s), generator=gen)
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    return tokens, torch.arange(offset, offset + s).expand(b, s), labels


def _logits_loss_grads(model, tokens, positions, labels):
    with torch.no_grad():
        logits = model(tokens, positions)
    loss = model(tokens, positions, labels=labels)
    (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)).sum().backward()
    return logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _same_model(a, b):
    """Two models' logits, per-token losses and every gradient agree (fp32)."""
    for x, y in zip(a[:2], b[:2]):
        close(x, y)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        close(a[2][name], b[2][name], msg=lambda m: f"grad {name}: {m}")


def _differ(a, b):
    """Far apart for fp32: by 1e-5 somewhere, where rounding moves these O(0.1) values ~1e-8
    (padded vocabulary entries, -inf in both, aside)."""
    finite = torch.isfinite(a) & torch.isfinite(b)
    return bool((a[finite] - b[finite]).abs().max() > 1e-5)


# ----- --apply-layernorm-1p ---------------------------------------------------------------

@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_is_the_plain_norm_of_one_plus_w(normalization):
    """Every norm (both per layer, the final one and the QK norms) stores w = 0 at init and
    scales by 1 + w: the model with weights w is the plain model with weights 1 + w, in
    outputs and in every gradient (d/dw = d/d(1 + w))."""
    kw = dict(normalization=normalization, qk_layernorm=True)
    zero_centred = GPTModel(tiny_config(layernorm_zero_centered_gamma=True, **kw))
    plain = GPTModel(tiny_config(**kw))
    norms = [n for n in zero_centred.state_dict() if n.endswith("layernorm.weight")]
    assert len(norms) == 4 * 2 + 1  # input, pre-MLP, q and k norms of 2 layers, final norm
    for name in norms:
        assert (zero_centred.state_dict()[name] == 0).all(), name
        assert (plain.state_dict()[name] == 1).all(), name
    batch = _batch()
    _same_model(_logits_loss_grads(zero_centred, *batch), _logits_loss_grads(plain, *batch))
    gen = torch.Generator().manual_seed(0)
    state = {n: t + 0.3 * torch.randn(t.shape, generator=gen) if n in norms or
             n.endswith("layernorm.bias") else t for n, t in zero_centred.state_dict().items()}
    zero_centred.load_state_dict(state)
    plain.load_state_dict({n: t + 1 if n in norms else t for n, t in state.items()})
    for model in (zero_centred, plain):
        model.zero_grad()
    _same_model(_logits_loss_grads(zero_centred, *batch), _logits_loss_grads(plain, *batch))
    # and w is not the scale: the same stored weights in a plain model compute another function
    plain.load_state_dict(state)
    assert _differ(plain(*batch[:2]), zero_centred(*batch[:2]))


# ----- --qk-layernorm -----------------------------------------------------------------------

@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_qk_layernorm_normalises_every_head_before_rotary(normalization):
    """q and k: the --normalization norm over each head's channels with one weight for all
    heads, then rotary; v untouched. GQA: 8 query heads, 2 key heads."""
    config = tiny_config(qk_layernorm=True, normalization=normalization, num_attention_heads=8,
                         num_query_groups=2)
    attention = GPTModel(config).decoder.layers[0].self_attention
    d = config.kv_channels
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (*attention.q_layernorm.parameters(), *attention.k_layernorm.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(16, 2, config.hidden_size, generator=gen)  # [s, b, h]
    _, positions, _ = _batch(offset=30)
    q, k, v, _ = attention.query_key_value(x, positions)
    qkv = F.linear(x, attention.linear_qkv.weight, attention.linear_qkv.bias).view(16, 2, 2, 6, d)

    def norm(t, module):  # the formula, per head over its d channels
        if normalization == "RMSNorm":
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * module.weight
        centred = t - t.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * \
            module.weight + module.bias
    cos, sin = rotary_cos_sin(positions, d, 10000.0)
    q_ref = rotate(norm(qkv[:, :, :, :4].reshape(16, 2, 8, d), attention.q_layernorm), cos, sin)
    k_ref = rotate(norm(qkv[:, :, :, 4], attention.k_layernorm), cos, sin)
    close(q, q_ref)
    close(k, k_ref)
    close(v, qkv[:, :, :, 5])


def test_qk_layernorm_changes_the_output():
    batch = _batch()
    with_norm = GPTModel(tiny_config(qk_layernorm=True))
    without = GPTModel(tiny_config())
    assert _differ(with_norm(*batch[:2]), without(*batch[:2]))
    assert {n for n, _ in with_norm.named_parameters()} - {n for n, _ in without.named_parameters()} \
        == {f"decoder.layers.{i}.self_attention.{q}_layernorm.{w}" for i in range(2)
            for q in "qk" for w in ("weight", "bias")}


# ----- YaRN: Hugging Face transformers is the peer ---------------------------------------

YARN_CASES = [  # head dim, base, factor, original context, beta fast, beta slow, round, mscale, all-dim
    (16, 10000.0, 4.0, 64, 32.0, 1.0, True, 1.0, 0.0),
    (64, 500000.0, 8.0, 4096, 32.0, 1.0, True, 1.0, 0.0),
    (32, 10000.0, 16.0, 256, 16.0, 2.0, False, 0.707, 0.707),
    (128, 1e6, 40.0, 4096, 32.0, 1.0, True, 1.0, 0.6),
    (16, 10000.0, 0.5, 64, 32.0, 1.0, True, 1.0, 0.0),  # a factor <= 1: concentration 1
]


def _yarn_config(d, base, factor, original, fast, slow, round_to_int, mscale, all_dim):
    return tiny_config(hidden_size=4 * d, num_attention_heads=4, rotary_base=base,
                       position_embedding_type="yarn", rotary_scaling_factor=factor,
                       yarn_original_max_position_embeddings=original, yarn_beta_fast=fast,
                       yarn_beta_slow=slow, yarn_correction_range_round_to_int=round_to_int,
                       mscale=mscale, mscale_all_dim=all_dim)


def _hf_yarn(d, base, factor, original, fast, slow, round_to_int, mscale, all_dim):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d,
                       max_position_embeddings=int(original * max(factor, 1)),
                       rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": factor,
                                        "original_max_position_embeddings": original,
                                        "beta_fast": fast, "beta_slow": slow,
                                        "truncate": round_to_int, "mscale": mscale,
                                        "mscale_all_dim": all_dim})


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies_and_cos_sin_match_hugging_face(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    d = case[0]
    hf_config = _hf_yarn(*case)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
    ours = yarn_frequencies(d, case[1], case[2], case[3], case[4], case[5], case[6])
    close(ours, inv_freq, rtol=1e-6, atol=0)  # the same fp32 operations
    assert yarn_concentration_factor(case[2], case[7], case[8]) == pytest.approx(
        attention_factor, rel=1e-12)
    positions = torch.tensor([[0, 1, 7, 63, 64, 1000, 4095], [5, 300, 4096, 9000, 20000, 65535, 2]])
    rotary = RotaryEmbedding(_yarn_config(*case), d)
    cos, sin = rotary.cos_sin(positions)  # [s, b, 1, d/2]
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32),
                                                     positions)  # [b, s, d]: the halves repeat
    for ours_t, theirs in ((cos, hf_cos), (sin, hf_sin)):
        ours_t = ours_t.squeeze(2).transpose(0, 1)  # [b, s, d/2]
        close(ours_t, theirs[..., :d // 2])
        close(ours_t, theirs[..., d // 2:])


def test_yarn_scales_queries_and_keys_by_the_concentration_factor():
    """Rotation keeps lengths, so YaRN's q and k are longer than plain rope's by exactly its
    factor (the attention logits by its square); a factor of 1 is plain rope."""
    case = (8, 10000.0, 8.0, 16, 32.0, 1.0, True, 1.0, 0.0)
    yarn, rope = GPTModel(_yarn_config(*case)), GPTModel(tiny_config())
    factor = yarn_concentration_factor(8.0)
    assert factor == pytest.approx(1 + 0.1 * math.log(8.0))
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(2))
    _, positions, _ = _batch(offset=100)
    q_yarn, k_yarn, _, _ = yarn.decoder.layers[0].self_attention.query_key_value(x, positions)
    q_rope, k_rope, _, _ = rope.decoder.layers[0].self_attention.query_key_value(x, positions)
    close(q_yarn.norm(dim=-1), factor * q_rope.norm(dim=-1))
    close(k_yarn.norm(dim=-1), factor * k_rope.norm(dim=-1))
    batch = _batch(offset=100)
    assert _differ(yarn(*batch[:2]), rope(*batch[:2]))
    unscaled = GPTModel(tiny_config(position_embedding_type="yarn", rotary_scaling_factor=1.0))
    close(unscaled(*batch[:2]), rope(*batch[:2]))


# ----- --rotary-interleaved -----------------------------------------------------------------

def _megatron_interleaved(t, positions, rotary_dim, base=10000.0):
    """Megatron-LM's formula: freqs repeated per pair (f0 f0 f1 f1 ...), t cos + rot(t) sin with
    rot(t) = (-t1, t0, -t3, t2, ...) over the first rotary_dim channels."""
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = positions.t().double()[..., None] * inv  # [s, b, rd/2]
    emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)[:, :, None]  # [s, b, 1, rd]
    x, rest = t[..., :rotary_dim].double(), t[..., rotary_dim:].double()
    turned = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return torch.cat((x * emb.cos() + turned * emb.sin(), rest), dim=-1)


@pytest.mark.parametrize("rotary_dim", [16, 8])  # every channel, and --rotary-percent 0.5
def test_rotary_interleaved_matches_megatron_formula(rotary_dim):
    x = torch.randn(12, 2, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    positions = torch.stack([torch.arange(12) * 37, torch.arange(500, 512)])  # [b, s]
    cos, sin = rotary_cos_sin(positions, rotary_dim, 10000.0)
    leaf = x.clone().requires_grad_()
    out = rotate(leaf, cos, sin, interleaved=True)
    # fp32 angles: an angle near 511 rad is rounded by up to 2^-15 (3e-5) rad, on values ~3
    tol = dict(rtol=1e-4, atol=1e-4)
    close(out, _megatron_interleaved(x, positions, rotary_dim), **tol)
    grad_out = torch.randn_like(x)
    out.backward(grad_out)  # a rotation's transpose turns back
    close(leaf.grad, _megatron_interleaved(grad_out, -positions, rotary_dim), **tol)
    assert _differ(out, rotate(x, cos, sin))  # the half-split pairing is another rotation


def _interleave_qk_rows(qkv_weight, config):
    """The fused QKV weight with the q and k rows of every head reordered so that interleaved
    pair (2i, 2i + 1) holds what half-split pair (i, i + d/2) held."""
    d, ng = config.kv_channels, config.num_query_groups
    hpg = config.num_attention_heads // ng
    w = qkv_weight.view(ng, hpg + 2, d, -1).clone()  # [groups, q heads + k + v, d, h]
    order = torch.stack((torch.arange(d // 2), torch.arange(d // 2, d)), dim=-1).flatten()
    w[:, :hpg + 1] = w[:, :hpg + 1, order]
    return w.view_as(qkv_weight)


def test_rotary_interleaved_model_is_the_half_split_model_with_reordered_heads():
    """q . k does not see the order of a head's channels: the interleaved model equals the
    half-split one whose q and k rows are reordered (the conversion between the two); with
    the same weights it computes another function."""
    kw = dict(add_bias_linear=False)
    half, interleaved = GPTModel(tiny_config(**kw)), GPTModel(tiny_config(rotary_interleaved=True, **kw))
    batch = _batch(offset=20)
    assert _differ(half(*batch[:2]), interleaved(*batch[:2]))
    state = dict(half.state_dict())
    for i in range(2):
        name = f"decoder.layers.{i}.self_attention.linear_qkv.weight"
        state[name] = _interleave_qk_rows(state[name], interleaved.config)
    interleaved.load_state_dict(state)
    close(interleaved(*batch[:2]), half(*batch[:2]))


# ----- --squared-relu -------------------------------------------------------------------------

def test_squared_relu_mlp_and_experts_match_the_formula():
    config = tiny_config(squared_relu=True)
    assert config.activation == "squared_relu"
    mlp = MLP(config, "decoder.layers.0.mlp", None)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    ref = F.linear(torch.pow(F.relu(F.linear(x, fc1.weight, fc1.bias)), 2), fc2.weight, fc2.bias)
    out = mlp(x)
    close(out, ref)
    grads = torch.autograd.grad(out.sum(), (x, fc1.weight), retain_graph=True)
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), (x, fc1.weight))):
        close(got, want)
    assert _differ(out, MLP(tiny_config(), "decoder.layers.0.mlp", None)(x))  # GeLU: same weights
    moe = tiny_config(squared_relu=True, num_moe_experts=2, moe_router_topk=1)
    experts = GroupedExperts(moe, "decoder.layers.0.mlp.experts", 0, 1, 0, 1)
    tokens = x.detach().view(12, 32)
    out = experts(tokens, [5, 7])  # tokens 0-4 to expert 0, 5-11 to expert 1
    for e, rows in ((0, slice(0, 5)), (1, slice(5, 12))):
        h = F.linear(tokens[rows], experts.linear_fc1.weight[e], experts.linear_fc1.bias[e])
        close(out[rows], F.linear(F.relu(h) ** 2, experts.linear_fc2.weight[e],
                                  experts.linear_fc2.bias[e]))


def test_squared_relu_changes_the_model():
    batch = _batch()
    assert _differ(GPTModel(tiny_config(squared_relu=True))(*batch[:2]),
                   GPTModel(tiny_config())(*batch[:2]))


# ----- the flags --------------------------------------------------------------------------

def _parse(extra):
    return parse_args(f"{TINY} --train-iters 4 {extra}".split(), world_size=1)


def test_the_flags_set_the_config():
    args = _parse("--apply-layernorm-1p --qk-layernorm --apply-wd-to-qk-layernorm "
                  "--rotary-interleaved --squared-relu --no-bias-gelu-fusion")
    config = config_from_args(args, 200)
    assert config.layernorm_zero_centered_gamma and config.qk_layernorm
    assert config.rotary_interleaved and config.activation == "squared_relu"
    assert args.apply_wd_to_qk_layernorm
    args = _parse("--position-embedding-type yarn --rotary-scaling-factor 4 --mscale 0.8 "
                  "--mscale-all-dim 0.5 --yarn-original-max-position-embeddings 16 "
                  "--yarn-beta-fast 8 --yarn-beta-slow 2 --no-yarn-correction-range-round-to-int "
                  "--rope-type rope")
    config = config_from_args(args, 200)
    assert (config.position_embedding_type, config.rotary_scaling_factor, config.mscale,
            config.mscale_all_dim, config.yarn_original_max_position_embeddings,
            config.yarn_beta_fast, config.yarn_beta_slow,
            config.yarn_correction_range_round_to_int) == ("yarn", 4.0, 0.8, 0.5, 16, 8.0, 2.0,
                                                           False)
    assert config.rope_type == "rope"  # accepted: the only rotary GPT attention takes
    rounded = _parse("--position-embedding-type yarn --yarn-correction-range-round-to-int")
    assert config_from_args(rounded, 200).yarn_correction_range_round_to_int
    defaults = config_from_args(_parse("--position-embedding-type yarn"), 200)
    assert (defaults.rotary_scaling_factor, defaults.yarn_original_max_position_embeddings,
            defaults.yarn_beta_fast, defaults.yarn_beta_slow, defaults.mscale,
            defaults.mscale_all_dim, defaults.yarn_correction_range_round_to_int) == \
        (1.0, 4096, 32.0, 1.0, 1.0, 0.0, True)  # Megatron-LM's YaRN defaults
    # Megatron-LM's deprecated spelling of --apply-wd-to-qk-layernorm
    assert _parse("--no-weight-decay-cond-type apply_wd_to_qk_layernorm").apply_wd_to_qk_layernorm


@pytest.mark.parametrize("extra,line", [
    ("--squared-relu --swiglu", "--squared-relu (True) and --swiglu ('swiglu') are two MLP "
                                "activations; give one"),
    ("--rotary-scaling-factor 4 --mscale 2", "--rotary-scaling-factor (4.0), --mscale (2.0) apply "
                                             "only to --position-embedding-type yarn (the model "
                                             "has rope)"),
    ("--position-embedding-type yarn --rotary-interleaved",
     "--position-embedding-type yarn rotates every channel of a head in halves, as "
     "Megatron-LM's YaRN does: drop --rotary-interleaved (True)"),
    ("--position-embedding-type yarn --yarn-beta-slow 0", "--yarn-beta-slow (0.0) must be positive"),
    ("--rope-type yarn", "--rope-type ('yarn') applies to --multi-latent-attention only"),
    ("--position-embedding-type yarn --yarn-correction-range-round-to-int "
     "--no-yarn-correction-range-round-to-int", "--yarn-correction-range-round-to-int: "
                                                "contradicts --no-yarn-correction-range-round-"
                                                "to-int; give one"),
    ("--no-position-embedding --position-embedding-type yarn",
     "--no-position-embedding: is Megatron-LM's deprecated spelling, accepted only beside "
     "--position-embedding-type rope"),
])
def test_wrong_combinations_are_one_line_each(extra, line):
    with pytest.raises(ValueError) as err:
        _parse(extra)
    assert str(err.value).startswith(line), str(err.value)


def test_no_position_embedding_beside_rope_is_the_same_model():
    """Megatron-LM's GPT builds a position table only for learned_absolute, and its
    validate_args accepts --no-position-embedding only beside rope: there it changes nothing."""
    args = _parse("--no-position-embedding")
    assert args.compat_notes == ["--no-position-embedding: no learned position table: rotary "
                                 "embeddings (--position-embedding-type rope) have none"]
    config = config_from_args(args, 200)
    assert config == config_from_args(_parse(""), 200)
    assert not any("position_embeddings" in n for n, _ in GPTModel(config).named_parameters())
