"""--moe-router-padding-for-quantization (alias --moe-router-padding-for-fp8): the padded
routing map against an independent statement of Megatron-LM's rule (moe_utils.py
pad_routing_map at the census commit), the multiple it pads to, its flag rules, and the
runs of microbatch classes the dispatcher hands the FP8 experts."""
from types import SimpleNamespace

import pytest
import torch

from megatron_cp.cli.arguments import parse_args
from megatron_cp.cli.checks import ArgumentErrors
from megatron_cp.config.moe import MoESettings
from megatron_cp.fp8.grouped import runs_of
from megatron_cp.moe.dispatcher import pad_routing_map
from training_utils import TINY


def _megatron_rule(routing_map, multiple):
    """Megatron-LM's rule, stated per expert: while the expert's token count is not a
    multiple of ``multiple``, route to it the first token (in token order) not yet routed to
    it; stop when no such token is left."""
    padded = routing_map.clone()
    for e in range(padded.shape[1]):
        for t in range(padded.shape[0]):
            if int(padded[:, e].sum()) % multiple == 0:
                break
            padded[t, e] = True
    return padded


@pytest.mark.parametrize("tokens,experts,multiple", [(40, 6, 16), (100, 8, 16), (70, 4, 32),
                                                     (10, 3, 16)])
def test_padding_follows_megatron_rule(tokens, experts, multiple):
    generator = torch.Generator().manual_seed(tokens + experts)
    routing_map = torch.rand(tokens, experts, generator=generator) < 0.3
    routing_map[:, 0] = False  # an expert nobody chose stays empty (0 is a multiple)
    padded = pad_routing_map(routing_map, multiple)
    assert torch.equal(padded, _megatron_rule(routing_map, multiple))
    assert bool((padded | ~routing_map).all())  # nothing routed is dropped
    counts = padded.sum(0)
    enough = (-routing_map.sum(0)) % multiple <= (~routing_map).sum(0)
    assert bool(((counts % multiple == 0) | ~enough).all())


def test_pad_multiple_by_recipe():
    """Megatron-LM's get_fp8_align_size: 32 under MXFP8, 16 under the other recipes."""
    for recipe, multiple in (("tensorwise", 16), ("delayed", 16), ("blockwise", 16),
                             ("mxfp8", 32)):
        config = SimpleNamespace(moe_router_padding_for_quantization=True, fp8_recipe=recipe)
        assert MoESettings.router_pad_multiple(config) == multiple
    assert MoESettings.router_pad_multiple(
        SimpleNamespace(moe_router_padding_for_quantization=False, fp8_recipe="delayed")) == 0


MOE = f"{TINY} --train-iters 4 --num-experts 4 --no-bias-gelu-fusion"


@pytest.mark.parametrize("extra,message", [
    ("--moe-router-padding-for-fp8 --moe-token-dispatcher-type alltoall",
     "needs --fp8-format (Megatron-LM's rule)"),
    ("--moe-router-padding-for-quantization --fp8-format hybrid",
     "not supported by --moe-token-dispatcher-type allgather"),
])
def test_padding_flag_rules(extra, message):
    with pytest.raises(ArgumentErrors) as refused:
        parse_args(f"{MOE} {extra}".split(), world_size=1)
    assert len(refused.value.lines) == 1 and message in refused.value.lines[0], refused.value.lines


def test_both_spellings_accepted():
    for flag in ("--moe-router-padding-for-fp8", "--moe-router-padding-for-quantization"):
        args = parse_args(f"{MOE} --fp8-format hybrid --moe-token-dispatcher-type alltoall "
                          f"{flag}".split(), world_size=1)
        assert args.moe_router_padding_for_quantization


def test_runs_of_microbatch_classes():
    """Rows expert-major, each expert's rows in source order; adjacent sources of one class
    (TP / CP peers) merge into one run, DP peers' rows stay apart."""
    by_source = torch.tensor([[2, 0], [1, 3], [4, 1], [0, 2]])  # [S=4, E_local=2]
    assert runs_of(by_source, [0, 0, 1, 1]) == [(0, 0, 3), (0, 1, 4), (1, 0, 3), (1, 1, 3)]
    assert runs_of(by_source, [0, 1, 0, 1]) == [(0, 0, 2), (0, 1, 1), (0, 0, 4), (1, 1, 3),
                                                (1, 0, 1), (1, 1, 2)]
