"""--torch-compile: every transformer layer compiled on its own (core attention eager) computes
what the eager model computes, and trains under TP + SP + CP + selective recomputation and
under PP x DP + full recomputation to the eager single-process losses (fp32, CPU).

Compiling costs seconds per process on two CPU cores, so the compiled cases are few and tiny.
"""
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from dist_harness import run_workers
from megatron_cp.cli.arguments import build_parser, parse_args
from megatron_cp.model.gpt import GPTModel
from model_utils import tiny_config
from training_utils import TINY, max_rel_diff, train_losses

STEPS = f"{TINY} --train-iters 4"


def test_compiled_layers_match_eager_outputs_and_grads():
    config = tiny_config(normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                         num_query_groups=2, hidden_dropout=0.1)  # Llama-style, with GQA
    eager = GPTModel(config)
    compiled = GPTModel(dataclasses.replace(config, torch_compile=True))
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints unchanged
    b, s = 2, 16
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, config.vocab_size, (b, s), generator=gen) for _ in range(2))
    positions = torch.arange(s).expand(b, s)
    counters.clear()
    losses = []
    for model in (eager, compiled):
        loss = model(tokens, positions, labels, sample_ids=torch.tensor([3, 4]))  # [b, s]
        loss.mean().backward()
        losses.append(loss.detach())
    assert counters["stats"]["unique_graphs"] > 0, "the layers must actually be compiled"
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    eager_params = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        torch.testing.assert_close(param.grad, eager_params[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layers_share_one_graph_whatever_the_depth(dropout):
    """A layer's number must not be a constant of its graph: Dynamo would compile each layer
    again and, past its recompile limit (8), leave the deeper layers eager (a 1.3B model
    lost 13% of its compiled throughput that way on an H200). The graphs a 2-layer model
    compiles serve a model deeper than the limit."""
    graphs = {}
    for layers in (2, torch._dynamo.config.recompile_limit + 2):
        torch._dynamo.reset()
        counters.clear()
        config = tiny_config(num_layers=layers, normalization="RMSNorm", activation="swiglu",
                             add_bias_linear=False, hidden_dropout=dropout, torch_compile=True)
        model = GPTModel(config)
        tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        model(tokens, torch.arange(16).expand(2, 16), tokens, sample_ids=torch.tensor([0, 1])
              ).mean().backward()
        graphs[layers] = counters["stats"]["unique_graphs"]
    assert graphs[2] > 0, "the layers must actually be compiled"
    assert len(set(graphs.values())) == 1, f"graphs compiled by depth: {graphs}"


def test_each_microbatch_layout_reuses_the_graphs():
    """The model hands every layer the microbatch's SequenceLayout (a Python object, new each
    microbatch, read only by the eager core attention): a second microbatch with other
    documents must compile nothing new."""
    torch._dynamo.reset()
    counters.clear()
    config = tiny_config(normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                         torch_compile=True)
    model = GPTModel(config)
    gen = torch.Generator().manual_seed(1)
    graphs = []
    for ends in ((3, 9), (6, 12)):  # each microbatch its own documents
        tokens = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        docs = torch.zeros(2, 16, dtype=torch.long)
        for end in ends:
            docs[:, end:] += 1
        model(tokens, torch.arange(16).expand(2, 16), tokens, document_ids=docs,
              sample_ids=torch.tensor([0, 1])).mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "the layers must actually be compiled"
    assert graphs[1] == graphs[0], f"graphs after each microbatch: {graphs}"


@pytest.fixture(scope="module")
def reference():
    return run_workers(train_losses, 1, STEPS)[0]


@pytest.mark.parametrize("world,extra", [
    (4, "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 "
        "--cp-comm-type p2p --recompute-granularity selective"),
    (4, "--pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1 --overlap-grad-reduce"),  # PP=2 x DP=2
], ids=["tp2sp-cp2-selective", "pp2-dp2-full-recompute"])
def test_compiled_training_matches_eager_single_process(reference, world, extra):
    results = run_workers(train_losses, world, f"{STEPS} --torch-compile {extra}", timeout=600)
    for losses in results:
        diff = max_rel_diff(losses, reference)
        print(f"--torch-compile {extra}: max relative loss difference {diff:.2e}")
        assert diff < 1e-5


def test_flag_is_in_help_and_cuda_graph_modes_are_refused():
    help_text = build_parser().format_help()
    assert "--torch-compile " in help_text and "--torch-compile-mode" in help_text
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --vocab-size 100 "
            "--torch-compile")
    assert parse_args(f"{base} --torch-compile-mode max-autotune-no-cudagraphs".split(),
                      world_size=1).torch_compile_mode == "max-autotune-no-cudagraphs"
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match=rf"^--torch-compile-mode \('{mode}'\) captures CUDA "
                                             rf"graphs.*use --torch-compile-mode 'default'"):
            parse_args(f"{base} --torch-compile-mode {mode}".split(), world_size=1)
