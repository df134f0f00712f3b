"""Tokenizers: NullTokenizer, SentencePiece (trained here, small), GPT-2 BPE on a hand vocab,
and the corpus / tokenizer-training tools."""
import importlib.util
import json
import os

import pytest

from megatron_cp.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool(name):
    """Import tools/<name>.py as a module (tools/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(ROOT, "tools",
                                                                              f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_corpus(path, num_docs=12):
    """A jsonl of a few of Python's bundled documentation topics (deterministic)."""
    from pydoc_data.topics import topics

    with open(path, "w", encoding="utf-8") as f:
        for key in sorted(topics)[:num_docs]:
            f.write(json.dumps({"text": topics[key][:4000], "title": key}) + "\n")
    return path


def test_null_tokenizer_follows_megatron():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.eod == 100 and tok.vocab_size == 101
    assert tok.tokenize("3 1  4\n15") == [3, 1, 4, 15]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="vocab-size"):
        build_tokenizer("NullTokenizer")


def test_unknown_type_and_missing_files_name_the_choices():
    with pytest.raises(ValueError) as err:
        build_tokenizer("NoSuchTokenizer")
    for name in TOKENIZER_TYPES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json")


def test_train_sentencepiece_and_round_trip(tmp_path):
    corpus = small_corpus(str(tmp_path / "corpus.jsonl"))
    train_tokenizer = load_tool("train_tokenizer")
    for model_type in ("bpe", "unigram"):
        prefix = str(tmp_path / f"sp_{model_type}")
        train_tokenizer.main(["--input", corpus, "--json-keys", "text", "--model-prefix", prefix,
                              "--vocab-size", "300", "--model-type", model_type])
        tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=prefix + ".model")
        assert tok.vocab_size == 300
        assert tok.eod == 2  # sentencepiece's eos </s>
        text = "The statement:\n\n    for x in range(10):\n        print(x)\n"
        ids = tok.tokenize(text)
        assert all(0 <= i < 300 for i in ids) and tok.eod not in ids
        assert tok.detokenize(ids) == text  # verbatim: newlines and indentation survive
        alias = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=prefix + ".model")
        assert alias.tokenize(text) == ids and alias.eod == 2


def test_train_tokenizer_on_plain_text(tmp_path):
    from pydoc_data.topics import topics

    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(topics[k][:3000] for k in sorted(topics)[:8]), encoding="utf-8")
    model = load_tool("train_tokenizer").train(str(path), str(tmp_path / "plain"), 250)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert tok.vocab_size == 250 and tok.detokenize(tok.tokenize("import os")) == "import os"


def test_build_pydoc_corpus(tmp_path):
    from pydoc_data.topics import topics

    out = str(tmp_path / "sub" / "pydoc.jsonl")
    load_tool("build_pydoc_corpus").main(["--output", out])
    records = [json.loads(line) for line in open(out, encoding="utf-8")]
    assert len(records) == len(topics)
    assert [r["text"] for r in records] == [topics[k] for k in sorted(topics)]
    assert all(set(r) == {"text"} for r in records)


def test_gpt2_bpe_on_a_hand_written_vocab(tmp_path):
    # Byte-level BPE: 'Ġ' is the space byte. Merges are applied in file order.
    vocab = {"<|endoftext|>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "Ġ": 5, "w": 6, "r": 7,
             "d": 8, "he": 9, "ll": 10, "hell": 11, "hello": 12, "Ġw": 13, "or": 14, "Ġwor": 15}
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    merge_file.write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab_file),
                          merge_file=str(merge_file))
    assert tok.vocab_size == 16 and tok.eod == 0
    # "hello" | "Ġworld" -> Ġwor l d | "Ġhello" -> Ġ hello (no 'Ġ h' merge)
    assert tok.tokenize("hello world hello") == [12, 15, 3, 8, 5, 12]
    assert tok.detokenize([12, 15, 3, 8, 5, 12]) == "hello world hello"
    assert tok.detokenize([0, 12]) == "<|endoftext|>hello"

    del vocab["<|endoftext|>"]
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ValueError, match="endoftext"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab_file),
                        merge_file=str(merge_file))


def _train_hf_bpe(tmp_path, special="</s>"):
    """A small byte-level BPE trained here with the ``tokenizers`` library: (Tokenizer, file)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["def main():\n    return 0\n", "hello world, hello tokenizers", "for x in range(3):"]
    tok.train_from_iterator(texts * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[special], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, str(path)


def test_hugging_face_tokenizer_from_folder_and_file(tmp_path):
    from transformers import PreTrainedTokenizerFast

    raw, file = _train_hf_bpe(tmp_path)
    folder = tmp_path / "hf_folder"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>").save_pretrained(str(folder))
    text = "def main():\n    return 'hello world'\n"
    expected = raw.encode(text).ids
    for path in (str(folder), file, str(folder / "tokenizer.json")):
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
        assert tok.eod == raw.token_to_id("</s>"), path
        assert tok.vocab_size == raw.get_vocab_size(), path
        assert tok.tokenize(text) == expected, path
        assert tok.detokenize(tok.tokenize(text)) == text, path
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(folder))._hf
    assert type(hf).__module__.startswith("transformers.")  # a folder goes through AutoTokenizer


def test_hugging_face_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="does not exist.*not downloaded"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="gpt2")
    _, file = _train_hf_bpe(tmp_path, special="<pad>")  # no eos token anywhere
    with pytest.raises(ValueError, match="no eos token"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=file)


def test_preprocess_with_hugging_face_tokenizer(tmp_path):
    from megatron_cp.data.indexed_dataset import IndexedDataset

    raw, file = _train_hf_bpe(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    docs = ["hello world", "def main():\n    return 0\n"]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prefix = str(tmp_path / "out")
    out = load_tool("preprocess_data").main(["--input", str(corpus), "--output-prefix", prefix,
                                             "--tokenizer-type", "HuggingFaceTokenizer",
                                             "--tokenizer-model", file, "--append-eod"])
    dataset = IndexedDataset(out["text"])
    eod = raw.token_to_id("</s>")
    assert [list(map(int, dataset[i])) for i in range(len(docs))] == \
        [raw.encode(d).ids + [eod] for d in docs]


def _bos_adding_folder(tmp_path):
    """A save_pretrained folder whose tokenizer adds a bos token when encoding (as Llama's
    does), and its text."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    raw, _ = _train_hf_bpe(tmp_path)
    raw.add_special_tokens(["<s>"])
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))])
    folder = tmp_path / "bos_folder"
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(folder))
    return str(folder)


def test_hugging_face_special_tokens_as_megatron_lm(tmp_path):
    """Megatron-LM's HuggingFaceTokenizer encodes with ``tokenizer(text).input_ids`` (the
    special tokens included, its default) or, under --tokenizer-hf-no-include-special-tokens,
    ``convert_tokens_to_ids(tokenize(text))``; decoding drops the special tokens only then."""
    from transformers import AutoTokenizer

    from megatron_cp.cli.arguments import parse_args
    from megatron_cp.config.data import DataConfig
    from megatron_cp.config.setting import build_config
    from megatron_cp.data.tokenizers import tokenizer_from_config

    folder = _bos_adding_folder(tmp_path)
    hf = AutoTokenizer.from_pretrained(folder)
    text = "hello world, def main():"
    with_bos, plain = hf(text).input_ids, hf.convert_tokens_to_ids(hf.tokenize(text))
    assert with_bos == [hf.bos_token_id] + plain  # the check is sharp
    base = (f"--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
            f"--micro-batch-size 1 --lr 1e-3 --train-iters 4 --mock-data "
            f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {folder}")
    for flag, ids in (("", with_bos), (" --tokenizer-hf-no-include-special-tokens", plain)):
        for model in (folder, os.path.join(folder, "tokenizer.json")):
            args = parse_args((base + flag).split(), world_size=1)
            args.tokenizer_model = model
            tok = tokenizer_from_config(build_config(DataConfig, args))
            assert tok.tokenize(text) == ids, (flag, model)
            assert tok.detokenize(with_bos) == ("<s>" + text if not flag else text), (flag, model)


def test_preprocess_includes_special_tokens_unless_told(tmp_path):
    from megatron_cp.data.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    folder = _bos_adding_folder(tmp_path)
    hf = AutoTokenizer.from_pretrained(folder)
    corpus = tmp_path / "corpus.jsonl"
    docs = ["hello world", "def main():\n    return 0\n"]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    for name, flags, expected in (
            ("on", [], [hf(d).input_ids + [hf.eos_token_id] for d in docs]),
            ("off", ["--tokenizer-hf-no-include-special-tokens"],
             [hf.convert_tokens_to_ids(hf.tokenize(d)) + [hf.eos_token_id] for d in docs])):
        out = load_tool("preprocess_data").main(
            ["--input", str(corpus), "--output-prefix", str(tmp_path / name), "--tokenizer-type",
             "HuggingFaceTokenizer", "--tokenizer-model", folder, "--append-eod", *flags])
        dataset = IndexedDataset(out["text"])
        assert [list(map(int, dataset[i])) for i in range(len(docs))] == expected, name
