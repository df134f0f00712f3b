"""Every value spelling Megatron-LM's parser takes is implemented or refused in one line.

From the census (megatron_cp/cli/megatron_lm_flags.json): each choice of every flag with
choices, and two plausible values of every list-valued flag (``nargs`` '+', '*' or a count),
are added to a tiny valid GPT command line (with the companion flags the value needs, the
tables below) and parsed. Each must be accepted, or refused by our checks with ONE line that
names the flag; never argparse's "invalid choice" / "unrecognized arguments", nor a
traceback. A census flag whose list values are not in :data:`LIST_VALUES` fails the
coverage test, so a new census keeps this test whole."""
import re

import pytest

from megatron_cp.cli.arguments import ArgumentErrors, parse_args
from megatron_cp.cli.megatron_flags import megatron_census
from megatron_cp.data.tokenizers import tiktoken_available
from test_tokenizer_types import _tiktoken_vocab
from training_utils import TINY

BASE = TINY + " --train-iters 10"

# Two values for each list-valued flag (each a list of tokens), plausible for its meaning in
# Megatron-LM. "{data}" is a tiny .bin/.idx prefix written for the test.
LIST_VALUES = {
    "--hierarchical-context-parallel-sizes": (["2", "2"], ["1", "4"]),
    "--recompute-modules": (["core_attn"], ["mlp", "layernorm"]),
    "--gtp-remat-opt-in-modules": (["moe_latent_proj"], ["moe_latent_proj", "moe_latent_proj"]),
    "--mrope-section": (["2", "1", "1"], ["1", "2", "1"]),
    "--offload-modules": (["core_attn"], ["attn_norm", "mlp_norm"]),
    "--profile-ranks": (["0"], ["0", "1"]),
    "--rampup-batch-size": (["4", "4", "16"], ["2", "2", "32"]),
    "--iterations-to-skip": (["3"], ["2", "5"]),
    "--rl-inference-parsers": ([], ["deepseek-r1-reasoning"]),
    "--high-priority-stream-groups": (["dp_cp"], ["dp_cp", "ep_dp"]),
    "--ddp-param-name-patterns-for-fp32-local-accumulation": (["all"], ["*.bias", "*norm*"]),
    "--cp-comm-type": (["a2a"], ["p2p", "a2a"]),
    "--validation-set-names": (["valid_a"], ["valid_a", "valid_b"]),
    "--data-path": (["{data}"], ["0.5", "{data}", "0.5", "{data}"]),
    "--train-data-path": (["{data}"], ["0.5", "{data}", "0.5", "{data}"]),
    "--valid-data-path": (["{data}"], ["0.5", "{data}", "0.5", "{data}"]),
    "--test-data-path": (["{data}"], ["0.5", "{data}", "0.5", "{data}"]),
    "--tokenizer-special-tokens": (["<s>"], ["<s>", "</s>"]),
    "--retriever-report-topk-accuracies": (["1"], ["1", "5", "20"]),
    "--moe-router-load-balancing-type": (["seq_aux_loss"], ["aux_loss", "seq_aux_loss"]),
    "--moe-aux-loss-coeff": (["0.01"], ["0.01", "0.001"]),
    "--cuda-graph-scope": (["attn"], ["attn", "mlp"]),
    "--cuda-graph-modules": (["attn"], ["attn", "mlp"]),
    "--spec": (["local"], ["megatron.core.models.gpt.gpt_layer_specs",
                           "get_gpt_layer_local_spec"]),
}

_MOE = "--num-experts 4 --moe-router-topk 2 --swiglu"
# Companion flags a flag (any value) or one of its values needs in Megatron-LM, and the
# world size when it is not 1: {flag or (flag, value): (flags, world size)}.
_MUON = "--optimizer muon --bf16"
COMPANIONS = {
    ("--recompute-granularity", "full"): ("--recompute-method uniform --recompute-num-layers 1",
                                          1),
    "--experimental-attention-variant": ("--linear-attention-freq 2 --swiglu", 1),
    "--muon-scale-mode": (_MUON, 1),
    "--muon-fp32-matmul-prec": (_MUON, 1),
    "--muon-tp-mode": (_MUON, 1),
    "--muon-scalar-optimizer": (_MUON, 1),
    ("--optimizer", "muon"): ("--bf16", 1),
    ("--optimizer", "dist_muon"): ("--bf16 --use-distributed-optimizer", 1),
    **{("--weight-decay-incr-style", style): ("--start-weight-decay 0.01 "
                                              "--end-weight-decay 0.1", 1)
       for style in ("linear", "cosine")},
    "--recompute-method": ("--recompute-granularity full --recompute-num-layers 1", 1),
    "--recompute-modules": ("--recompute-granularity selective", 1),
    "--fp8-format": ("--bf16", 1),
    "--fp4-format": ("--bf16", 1),
    "--moe-router-score-function": (_MOE, 1),
    "--moe-router-dtype": (_MOE, 1),
    "--moe-token-dispatcher-type": (_MOE, 1),
    "--moe-flex-dispatcher-backend": (_MOE + " --moe-token-dispatcher-type flex", 1),
    "--moe-token-drop-policy": (_MOE + " --moe-expert-capacity-factor 1.0", 1),
    "--moe-router-load-balancing-type": (_MOE, 1),
    "--moe-aux-loss-coeff": (_MOE, 1),
    ("--moe-router-load-balancing-type", "sinkhorn"): (
        "--num-experts 4 --moe-router-topk 1 --swiglu", 1),
    "--moe-dispatch-fwd-dtype": (_MOE, 1),
    "--moe-combine-bwd-dtype": (_MOE, 1),
    "--lr-wsd-decay-style": ("--lr-decay-style WSD --lr-wsd-decay-iters 4", 1),
    ("--lr-decay-style", "WSD"): ("--lr-wsd-decay-iters 4", 1),
    "--rope-type": ("--multi-latent-attention", 1),
    "--hierarchical-context-parallel-sizes": ("--context-parallel-size 4 --cp-comm-type a2a+p2p",
                                              4),
    "--cp-comm-type": ("--context-parallel-size 2", 2),
        "--offload-modules": ("--fine-grained-activation-offloading", 1),
    "--profile-ranks": ("--profile", 2),
}
if tiktoken_available():  # without tiktoken, TikTokenizer is refused: its settings alone are
    _TIKTOKEN = "--tokenizer-model {tiktoken} --tiktoken-num-special-tokens 16"
    COMPANIONS["--tiktoken-pattern"] = ("--tokenizer-type TikTokenizer " + _TIKTOKEN, 1)
    COMPANIONS[("--tokenizer-type", "TikTokenizer")] = (_TIKTOKEN, 1)
# The data flags replace --mock-data
_REAL_DATA = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"}

# argparse's own messages: never the answer to a value Megatron-LM takes
ARGPARSE = re.compile(r"invalid choice|unrecognized arguments|invalid \w+ value|expected "
                      r"(one|at least one|\d+) argument|the following arguments are required")


def _value(action, choice):
    """The spelling a user types for a census choice (the attention backend's enum)."""
    text = str(choice)
    match = re.fullmatch(r"<\w+\.(\w+): \d+>", text)
    return match.group(1) if match else text


def _cases():
    for action in megatron_census()["actions"]:
        flag = action["flags"][0]
        for choice in action.get("choices") or ():
            yield flag, [_value(action, choice)]
        if action["nargs"] not in (None, 0, "?"):
            for tokens in LIST_VALUES.get(flag, ([f"<no values for {flag}>"],)):
                yield flag, tokens


CASES = list(_cases())


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """A tiny .bin/.idx dataset (token ids below the base's --vocab-size)."""
    import numpy as np

    from megatron_cp.data.indexed_dataset import (IndexedDatasetBuilder, data_file_path,
                                                  index_file_path)
    prefix = str(tmp_path_factory.mktemp("spellings") / "docs")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(64):
        builder.add_document(rng.integers(0, 199, 80, dtype=np.int32), [80])
    builder.finalize(index_file_path(prefix))
    return prefix


def _argv(flag, tokens, data, tmp):
    """The base command line with the flag, its value ``tokens`` and its companions."""
    companions, world = COMPANIONS.get((flag, " ".join(tokens)), COMPANIONS.get(flag, ("", 1)))
    base = BASE.split()
    if flag in _REAL_DATA:
        base.remove("--mock-data")
        base += ["--tokenizer-type", "NullTokenizer"]
    extra = companions.format(data=data, tiktoken=_tiktoken_vocab(tmp / "vocab.json")).split()
    # the flag itself, then its companions (a companion never repeats the flag's own)
    argv = base + [flag] + [t.format(data=data) for t in tokens] + extra
    return argv, world


def test_every_list_valued_flag_has_values():
    listed = {a["flags"][0] for a in megatron_census()["actions"]
              if a["nargs"] not in (None, 0, "?")}
    assert listed == set(LIST_VALUES), (listed ^ set(LIST_VALUES))
    assert all(len(values) == 2 for values in LIST_VALUES.values())


@pytest.mark.parametrize("flag,tokens", CASES,
                         ids=[f"{f}={' '.join(t)}" for f, t in CASES])
def test_value_is_taken_or_refused_in_one_line(flag, tokens, data_prefix, tmp_path):
    argv, world = _argv(flag, tokens, data_prefix, tmp_path)
    aliases = next(a["flags"] for a in megatron_census()["actions"] if a["flags"][0] == flag)
    try:
        parse_args(argv, world_size=world)
    except ArgumentErrors as error:
        lines = error.lines
        assert len(lines) == 1, (argv, lines)
        assert not ARGPARSE.search(lines[0]), (argv, lines[0])
        assert any(name in lines[0] for name in aliases), (argv, lines[0])
        assert "\n" not in lines[0]
