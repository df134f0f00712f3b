"""Llama 3.1's RoPE scaling (--use-rope-scaling, --rope-scaling-factor) against Hugging Face
transformers' own "llama3" rope type, position interpolation
(--rotary-seq-len-interpolation-factor) against its definition, and how the flags parse and
are refused. Their parallel layouts and training are in tests/parity/test_numerics_parallel.py,
the Hugging Face export and import in tests/checkpoint/test_checkpoint_convert.py."""
import math

import pytest
import torch

from megatron_cp.cli.arguments import parse_args
from megatron_cp.layers.rotary import (LLAMA3_ORIGINAL_MAX_POSITIONS, RotaryEmbedding,
                                       llama3_frequencies, rotary_cos_sin, rotary_frequencies)
from megatron_cp.model import GPTModel
from megatron_cp.startup import config_from_args
from model_utils import tiny_config
from training_utils import TINY

close = torch.testing.assert_close

# head dim, base, factor: every band (kept, blended, divided) appears in each
CASES = [(8, 500000.0, 8.0), (64, 500000.0, 8.0), (128, 500000.0, 32.0), (16, 10000.0, 4.0),
         (32, 1e6, 2.5)]


def _hf_llama3(d, base, factor):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d,
                       max_position_embeddings=LLAMA3_ORIGINAL_MAX_POSITIONS * 4,
                       rope_parameters={"rope_type": "llama3", "rope_theta": base,
                                        "factor": factor, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192})


def _config(d, base, **kw):
    return tiny_config(hidden_size=4 * d, num_attention_heads=4, rotary_base=base, **kw)


@pytest.mark.parametrize("case", CASES)
def test_llama3_frequencies_and_cos_sin_match_hugging_face(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    d, base, factor = case
    hf_config = _hf_llama3(*case)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    ours = llama3_frequencies(d, base, factor)
    close(ours, inv_freq, rtol=1e-6, atol=0)  # fp32 rounding of the same formula
    assert attention_factor == 1.0
    plain = rotary_frequencies(d, base)
    wavelengths = 2 * math.pi / plain
    kept, divided = wavelengths < 2048, wavelengths > 8192
    assert kept.any() and divided.any() and (~kept & ~divided).any(), "every band appears"
    assert torch.equal(ours[kept], plain[kept])
    close(ours[divided], plain[divided] / factor)
    positions = torch.tensor([[0, 1, 7, 2047, 8191, 20000, 131071], [5, 300, 4096, 9000, 2, 3, 4]])
    config = _config(d, base, use_rope_scaling=True, rope_scaling_factor=factor)
    cos, sin = RotaryEmbedding(config, d).cos_sin(positions)  # [s, b, 1, d/2]
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32),
                                                     positions)  # [b, s, d]: the halves repeat
    for ours_t, theirs in ((cos, hf_cos), (sin, hf_sin)):
        ours_t = ours_t.squeeze(2).transpose(0, 1)  # [b, s, d/2]
        close(ours_t, theirs[..., :d // 2], rtol=1e-5, atol=2e-5)  # angles up to ~1e5 rad
        close(ours_t, theirs[..., d // 2:], rtol=1e-5, atol=2e-5)


def test_interpolation_turns_position_p_by_the_angles_of_p_over_the_factor():
    d, base = 16, 10000.0
    positions = torch.arange(0, 64, 2).view(2, 16)
    config = _config(d, base, rotary_seq_len_interpolation_factor=4)
    cos, sin = RotaryEmbedding(config, d).cos_sin(positions)
    # a position that is a multiple of the factor: exactly the plain angle of p / 4
    quarter, whole = rotary_cos_sin(positions // 4, d, base), positions.t() % 4 == 0  # [s, b]
    assert torch.equal(cos[whole], quarter[0][whole]) and torch.equal(sin[whole], quarter[1][whole])
    # the others: the angle of the fractional position, in fp32
    angles = (positions.t().unsqueeze(-1).float() / 4) * rotary_frequencies(d, base)
    close(cos.squeeze(2), angles.cos())
    # with the scaling too (Megatron-LM takes both): the llama3 frequencies, positions / 4
    both = _config(d, base, rotary_seq_len_interpolation_factor=4, use_rope_scaling=True)
    cos, _ = RotaryEmbedding(both, d).cos_sin(positions)
    angles = (positions.t().unsqueeze(-1).float() * 0.25) * llama3_frequencies(d, base, 8.0)
    close(cos.squeeze(2), angles.cos())


def test_the_flags_change_the_model_and_the_factor_matters():
    tokens = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(9000, 9016).expand(2, 16)  # where the slow channels have turned
    outputs = {}
    for name, kw in (("plain", {}), ("llama3-8", dict(use_rope_scaling=True)),
                     ("llama3-16", dict(use_rope_scaling=True, rope_scaling_factor=16.0)),
                     ("interpolated", dict(rotary_seq_len_interpolation_factor=2))):
        # strong weights: attention, and so the angles, shape the output
        model = GPTModel(tiny_config(rotary_base=500000.0, init_method_std=0.3, **kw)).eval()
        with torch.no_grad():
            outputs[name] = model(tokens, positions)[..., :120]  # the real vocabulary
    names = list(outputs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (outputs[a] - outputs[b]).abs().max() > 1e-3, (a, b)


def _parse(extra):
    return parse_args(f"{TINY} --train-iters 4 {extra}".split(), world_size=1)


def test_flags_parse_with_megatron_lms_defaults():
    args = _parse("")
    assert (args.use_rope_scaling, args.rope_scaling_factor,
            args.rotary_seq_len_interpolation_factor) == (False, 8.0, None)
    config = config_from_args(_parse("--use-rope-scaling --rope-scaling-factor 16 "
                                     "--rotary-seq-len-interpolation-factor 2"), 200)
    assert (config.use_rope_scaling, config.rope_scaling_factor,
            config.rotary_seq_len_interpolation_factor) == (True, 16.0, 2)


@pytest.mark.parametrize("extra,line", [
    ("--rope-scaling-factor 4", "--rope-scaling-factor (4.0) applies only with "
                                "--use-rope-scaling; add --use-rope-scaling or drop it"),
    ("--position-embedding-type yarn --use-rope-scaling",
     "--use-rope-scaling (True) scales the plain RoPE of --position-embedding-type rope, not "
     "--position-embedding-type yarn"),
    ("--position-embedding-type learned_absolute --rotary-seq-len-interpolation-factor 2",
     "--rotary-seq-len-interpolation-factor (2) scales the plain RoPE"),
    ("--use-rope-scaling --rope-scaling-factor 0", "--rope-scaling-factor (0.0) must be positive"),
    ("--rotary-seq-len-interpolation-factor 0",
     "--rotary-seq-len-interpolation-factor (0) must be positive"),
    ("--no-rope-freq 4", "--no-rope-freq 4: per-layer RoPE skipping (NoPE layers) is not built"),
])
def test_wrong_values_are_one_line_each(extra, line):
    with pytest.raises(ValueError) as err:
        _parse(extra)
    assert str(err.value).startswith(line), str(err.value)


def test_multi_latent_attention_refuses_the_scaling():
    with pytest.raises(ValueError, match="multi-latent attention's"):
        tiny_config(multi_latent_attention=True, use_rope_scaling=True, q_lora_rank=None,
                    kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8)
