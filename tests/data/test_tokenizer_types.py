"""Megatron-LM's --tokenizer-type values beyond the original four: Llama2Tokenizer (Megatron-LM
reads it, like GPTSentencePieceTokenizer, with its one sentencepiece wrapper), TikTokenizer
(when the tiktoken package is installed; else refused in one line), and the BERT, multimodal
and SFT tokenizers, refused in one line with the reason. Llama2Tokenizer and TikTokenizer
are checked against megatron-core's own tokenizers."""
import base64
import json

import pytest

from megatron_cp.cli.arguments import parse_args
from megatron_cp.config.data import NOT_BUILT_TOKENIZERS
from megatron_cp.data import tokenizers
from megatron_cp.data.tokenizers import build_tokenizer
from test_data_tokenizers import load_tool, small_corpus
from megatron_cp.startup import run_config
from training_utils import TINY, assert_refused

TEXTS = ("def f(x):\n    return x + 1  # the answer", "  Two  spaces, then é and 日本.",
         "the <s> and </s> in text", "")


def tiktoken_library():
    """megatron-core's TikToken tokenizer module (tiktoken is a test requirement, setup.py's
    dev extra; megatron-core is installed for the tests by scripts/env.sh)."""
    import megatron.core.tokenizers.text.libraries.tiktoken_tokenizer as library
    return library


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama2")
    corpus = small_corpus(str(tmp / "corpus.jsonl"))
    load_tool("train_tokenizer").main(["--input", corpus, "--json-keys", "text",
                                       "--model-prefix", str(tmp / "spm"), "--vocab-size", "300"])
    return str(tmp / "spm.model")


def test_llama2_tokenizer_is_megatron_cores_sentencepiece(spm_model):
    import megatron.core.tokenizers as core
    theirs = core.MegatronTokenizer.from_pretrained(tokenizer_path=spm_model,
                                                    metadata_path={"library": "sentencepiece"})
    ours = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model)
    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    assert (ours.eod, ours.bos, ours.vocab_size) == (theirs.eod, theirs.bos, theirs.vocab_size)
    assert ours.eod == theirs.eos_id != ours.bos
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == theirs.tokenize(text) == plain.tokenize(text), text
        assert ours.bos not in ids and ours.eod not in ids  # nothing is added
        assert ours.detokenize(ids) == theirs.detokenize(ids)


def test_llama2_tokenizer_from_the_command_line(spm_model):
    args = parse_args((TINY + f" --train-iters 4 --tokenizer-type Llama2Tokenizer "
                              f"--tokenizer-model {spm_model}").split())
    assert args.tokenizer_type == "Llama2Tokenizer"
    assert_refused(TINY + " --train-iters 4 --tokenizer-type Llama2Tokenizer",
                   "--tokenizer-type Llama2Tokenizer needs --tokenizer-model")


@pytest.mark.parametrize("kind", sorted(NOT_BUILT_TOKENIZERS))
def test_tokenizers_not_built_are_refused_in_one_line(kind):
    assert_refused(TINY + f" --train-iters 4 --tokenizer-type {kind}",
                   f"--tokenizer-type {kind}: {NOT_BUILT_TOKENIZERS[kind]}")
    with pytest.raises(ValueError, match=kind):
        build_tokenizer(kind)


def test_tiktoken_missing_is_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(tokenizers, "tiktoken_available", lambda: False)
    assert_refused(TINY + f" --train-iters 4 --tokenizer-type TikTokenizer --tokenizer-model "
                          f"{tmp_path / 'vocab.json'}",
                   "--tokenizer-type TikTokenizer needs the tiktoken package, which is not "
                   "installed (megatron_cp does not depend on it): pip install tiktoken")


def test_tiktoken_settings_go_with_tiktokenizer():
    for flag in ("--tiktoken-pattern v1", "--tiktoken-num-special-tokens 16",
                 "--tokenizer-special-tokens <s> </s>"):
        assert_refused(TINY + f" --train-iters 4 {flag}",
                       f"{flag}: read by --tokenizer-type TikTokenizer only")


def _tiktoken_vocab(path, merges=(b"th", b"he", b"the", b" t", b" the", b"in", b"  ")):
    """A TikTokenizer vocabulary .json: the 256 bytes, then a few merges."""
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    with open(path, "w") as f:
        json.dump([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                    "token_str": t.decode("utf-8", "replace")} for i, t in enumerate(tokens)], f)
    return str(path)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_is_megatron_cores(tmp_path, pattern):
    core = tiktoken_library()
    vocab = _tiktoken_vocab(tmp_path / "vocab.json")
    settings = dict(pattern=pattern, vocab_size=16 + 263, num_special_tokens=16)
    theirs = core.TikTokenTokenizer(vocab, **settings)
    ours = build_tokenizer("TikTokenizer", vocab, vocab_size=279, tiktoken_pattern=pattern,
                           tiktoken_num_special_tokens=16)
    assert (ours.eod, ours.bos, ours.vocab_size) == (theirs.eod, theirs.bos_id, theirs.vocab_size)
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == theirs.text_to_ids(text), text
        # the census commit decodes the ids' bytes together (tiktoken's decode); an older
        # megatron-core decodes token by token, which splits multi-byte characters
        assert ours.detokenize(ids) == text
        if text.isascii():
            assert theirs.ids_to_text(ids) == text
    assert ours.tokenize("the </s>")[-1] == ours.eod == 2
    assert ours.token_to_id("<sep>") == 6 and ours.token_to_id(b"the") == 16 + 258


def test_tiktokenizer_from_the_command_line(tmp_path):
    vocab = _tiktoken_vocab(tmp_path / "vocab.json")
    base = TINY.replace("--vocab-size 200", "--vocab-size 279") + \
        f" --train-iters 4 --tokenizer-type TikTokenizer --tokenizer-model {vocab}"
    args = parse_args((base + " --tiktoken-num-special-tokens 16 --tiktoken-pattern v1").split())
    assert (args.tiktoken_pattern, args.tiktoken_num_special_tokens) == ("v1", 16)
    assert run_config(args).model.vocab_size == 279  # the model's vocabulary is the tokenizer's
    assert_refused(base, "--tokenizer-type TikTokenizer needs its 7 special tokens <= "
                         "--tiktoken-num-special-tokens (1000) < its vocabulary")
    assert_refused(base + " --tiktoken-num-special-tokens 16 --tokenizer-special-tokens <s> </s>",
                   "--tokenizer-special-tokens must list each token once and include")


def test_tiktoken_patterns_are_megatron_cores():
    core = tiktoken_library()
    assert tokenizers.TIKTOKEN_PATTERNS == {"v1": core._PATTERN_TIKTOKEN_V1,
                                            "v2": core._PATTERN_TIKTOKEN_V2}
