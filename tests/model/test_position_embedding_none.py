"""--position-embedding-type none (NoPE), Megatron-LM's meaning: no learned position table and
no rotary embedding, so only the causal mask orders the tokens. Checked: the model has
neither, its output does not depend on the position ids, it trains under TP and resumes from
a checkpoint exactly; Hugging Face export refuses it in one line (no layout there is NoPE);
Megatron-LM's mrope and relative are refused in one line."""
import math

import pytest
import torch

from dist_harness import run_workers
from megatron_cp.checkpoint.hf.convert import pick_layout
from megatron_cp.cli.arguments import parse_args
from megatron_cp.model import GPTModel
from model_utils import tiny_config
from training_utils import TINY, assert_refused, train_runs

NOPE = TINY.replace("--position-embedding-type rope", "--position-embedding-type none")


def _logits(config, position_ids):
    torch.manual_seed(0)
    tokens = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return GPTModel(config).eval()(tokens, position_ids)


def test_nope_model_has_no_positions_and_ignores_position_ids():
    config = tiny_config(position_embedding_type="none")
    model = GPTModel(config)
    assert model.embedding.position_embeddings is None
    assert not [n for n, _ in model.named_parameters() if "position" in n]
    attentions = [m for m in model.modules() if hasattr(m, "rotary")]
    assert attentions and all(m.rotary is None for m in attentions)
    ordered = torch.arange(16).expand(2, 16)
    shuffled = torch.randperm(16, generator=torch.Generator().manual_seed(1)).expand(2, 16)
    torch.testing.assert_close(_logits(config, ordered), _logits(config, shuffled), rtol=0,
                               atol=0)
    for other in ("rope", "learned_absolute"):  # each reads the position ids
        config = tiny_config(position_embedding_type=other)
        assert not torch.allclose(_logits(config, ordered), _logits(config, shuffled))


def test_nope_from_the_command_line():
    args = parse_args((NOPE + " --train-iters 4").split())
    assert args.position_embedding_type == "none"


def test_nope_trains_under_tp_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    base = NOPE + " --tensor-model-parallel-size 2 --log-interval 1 --lr-decay-iters 6"
    straight, saved, resumed = run_workers(train_runs, 2, [
        base + " --train-iters 6",
        base + f" --train-iters 3 --save {ckpt} --save-interval 3",
        base + f" --train-iters 6 --load {ckpt}",
    ])[0]
    assert all(math.isfinite(x) for x in straight) and straight[-1] < straight[0], straight
    assert saved == straight[:3]
    assert resumed == straight[3:], (resumed, straight)


@pytest.mark.parametrize("extra", ["", " --num-experts 4 --moe-router-topk 2"])
def test_hf_export_refuses_nope_in_one_line(extra):
    """A Llama-like NoPE model, dense or MoE (Mixtral): its saved arguments map onto no
    Hugging Face layout."""
    argv = NOPE + " --train-iters 4 --normalization RMSNorm --swiglu --disable-bias-linear"
    args = vars(parse_args((argv + extra).split()))
    with pytest.raises(ValueError) as error:
        pick_layout(args)
    assert "position_embedding_type" in str(error.value) and "\n" not in str(error.value)


def test_qwen3_next_export_refuses_a_nope_hybrid(tmp_path):
    from megatron_cp.checkpoint.hf import qwen3_next as hf_qwen3_next
    args = {**hf_qwen3_next.REQUIRED, "position_embedding_type": "none"}
    with pytest.raises(ValueError, match="position_embedding_type='none' \\(needs 'rope'\\)"):
        hf_qwen3_next.to_hf({}, args, str(tmp_path))


@pytest.mark.parametrize("value", ["mrope", "relative"])
def test_megatron_position_types_not_built_are_refused(value):
    assert_refused(TINY + f" --train-iters 4 --position-embedding-type {value}",
                   f"--position-embedding-type {value}: ")
