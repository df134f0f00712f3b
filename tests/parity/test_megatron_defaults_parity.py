"""Every layout equals one process under Megatron-LM's defaults, 5 training steps, relative
loss difference <= 1e-5 (fp32, CPU).

The defaults are the flags users pass: hidden and attention dropout 0.1 (masks drawn from
global coordinates, so no layout changes them), learned absolute positions, tied embeddings,
LayerNorm + GeLU with biases, NullTokenizer with --vocab-size 512 (513 entries with EOD)
padded by --make-vocab-size-divisible-by 128 to 640 at TP=1, 768 at TP=2 and 1024 at TP=4,
and no --pipeline-seq-length. Packed documents (--reset-attention-mask --reset-position-ids
--eod-mask-loss) run under every CP comm type with both position embedding types. A
sentencepiece model on real .bin/.idx data checks the padding with another tokenizer.

All layouts of one world size train one after the other inside one set of workers.
"""
import os
import subprocess
import sys

import pytest

from dist_harness import run_workers
from test_data_tokenizers import load_tool, small_corpus
from training_utils import max_rel_diff, train_losses

DEFAULTS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 "
            "--lr-warmup-iters 2 --lr-decay-style cosine "
            "--log-interval 100 --eval-iters 0 --seed 11 "
            "--train-iters 5")
NULL = f"{DEFAULTS} --mock-data --tokenizer-type NullTokenizer --vocab-size 512"
PACKED = "--reset-attention-mask --reset-position-ids --eod-mask-loss"
ROPE = "--position-embedding-type rope"
REFERENCES = {"plain": NULL, "packed": f"{NULL} {PACKED}", "packed_rope": f"{NULL} {PACKED} {ROPE}"}
CP2, CP4 = "--context-parallel-size 2", "--context-parallel-size 4"
TP2, PP2 = "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2"
# name: (world, reference, extra arguments)
LAYOUTS = {
    "tp2": (2, "plain", TP2),
    "tp2_packed": (2, "packed", f"{TP2} {PACKED}"),
    "tp4_sp": (4, "plain", "--tensor-model-parallel-size 4 --sequence-parallel"),
    "tp2_cp2_pp2": (8, "plain", f"{TP2} {CP2} {PP2}"),
    "tp2_sp_cp2_pp2_packed": (8, "packed", f"{TP2} --sequence-parallel {CP2} {PP2} {PACKED}"),
    "cp2_pp2_packed": (4, "packed", f"{CP2} {PP2} {PACKED}"),
    "cp2_pp2_packed_rope": (4, "packed_rope", f"{CP2} {PP2} {PACKED} {ROPE}"),
    # a fixed buffer longer than the position table: pad tokens repeat real positions
    "pp2_fixed_buffer_packed": (2, "packed", f"{PP2} {PACKED} --pipeline-seq-length 40"),
}
for _pos, _ref in (("learned", "packed"), ("rope", "packed_rope")):
    _extra = PACKED if _pos == "learned" else f"{PACKED} {ROPE}"
    LAYOUTS.update({
        f"cp2_p2p_packed_{_pos}": (2, _ref, f"{CP2} --cp-comm-type p2p {_extra}"),
        f"cp2_a2a_packed_{_pos}": (2, _ref, f"{CP2} --cp-comm-type a2a {_extra}"),
        f"cp2_all_gather_packed_{_pos}": (2, _ref, f"{CP2} --cp-comm-type all_gather {_extra}"),
        f"cp4_hybrid_packed_{_pos}": (4, _ref, f"{CP4} --cp-comm-type a2a+p2p "
                                               f"--hierarchical-context-parallel-sizes 2 2 {_extra}"),
        f"cp4_auto_packed_{_pos}": (4, _ref, f"{CP4} --cp-comm-type auto {_extra}"),
    })


def _train_all(rank, world, argvs):
    return {name: train_losses(rank, world, argv) for name, argv in argvs.items()}


@pytest.fixture(scope="module")
def references():
    return run_workers(_train_all, 1, REFERENCES)[0]


@pytest.fixture(scope="module")
def results():
    """{world: {layout: losses of every rank}}, trained lazily per world size."""
    cache = {}

    def get(world):
        if world not in cache:
            argvs = {name: f"{REFERENCES[ref]} {extra}"
                     for name, (w, ref, extra) in LAYOUTS.items() if w == world}
            per_rank = run_workers(_train_all, world, argvs, timeout=600)
            cache[world] = {name: [ranks[name] for ranks in per_rank] for name in argvs}
        return cache[world]
    return get


@pytest.mark.parametrize("name", sorted(LAYOUTS, key=lambda n: (LAYOUTS[n][0], n)))
def test_layout_matches_single_process(references, results, name):
    world, ref, _ = LAYOUTS[name]
    reference = references[ref]
    assert reference[-1] < reference[0], "the tiny model must learn"
    for losses in results(world)[name]:  # every rank reports the same global loss
        diff = max_rel_diff(losses, reference)
        print(f"{name}: max relative loss difference {diff:.2e}")
        assert diff <= 1e-5


def test_sentencepiece_padding_differs_by_tp(tmp_path):
    """A 300-piece sentencepiece model pads to 384 at TP=1 and 512 at TP=2, on real data."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    corpus = small_corpus(str(tmp_path / "corpus.jsonl"), num_docs=40)
    load_tool("train_tokenizer").main(["--input", corpus, "--json-keys", "text", "--model-prefix",
                                       str(tmp_path / "spm"), "--vocab-size", "300"])
    subprocess.run([sys.executable, os.path.join(root, "tools", "preprocess_data.py"), "--input",
                    corpus, "--json-keys", "text", "--append-eod", "--tokenizer-type",
                    "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "spm.model"),
                    "--output-prefix", str(tmp_path / "docs"), "--workers", "1"], check=True)
    argv = (f"{DEFAULTS} --data-path {tmp_path}/docs_text_document --split 98,2,0 "
            f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {tmp_path}/spm.model "
            f"--data-cache-path {tmp_path}/cache")
    reference = run_workers(train_losses, 1, argv)[0]
    for losses in run_workers(train_losses, 2, f"{argv} {TP2}"):
        diff = max_rel_diff(losses, reference)
        print(f"sentencepiece tp2: max relative loss difference {diff:.2e}")
        assert diff <= 1e-5
