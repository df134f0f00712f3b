"""tools/preprocess_data.py end to end: jsonl -> sentencepiece -> .bin/.idx with 2 workers."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_cp.data.indexed_dataset import IndexedDataset
from megatron_cp.data.tokenizers import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tool(name, *args):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def corpus_and_model(tmp_path_factory):
    from pydoc_data.topics import topics

    tmp = tmp_path_factory.mktemp("pre")
    corpus = tmp / "corpus.jsonl"
    keys = sorted(topics)[:30]
    with open(corpus, "w", encoding="utf-8") as f:
        for i, key in enumerate(keys):
            text = "" if i == 7 else topics[key][:2000]  # one empty document, skipped
            f.write(json.dumps({"text": text, "title": key}) + "\n")
            if i == 3:
                f.write("\n")  # blank lines are ignored
    import train_tokenizer  # tools/ is on pytest's path (pytest.ini)
    model = train_tokenizer.train(str(corpus), str(tmp / "sp"), 300)
    return tmp, corpus, model, keys


def test_preprocess_end_to_end_two_workers(corpus_and_model):
    tmp, corpus, model, keys = corpus_and_model
    prefix = str(tmp / "out" / "corpus")
    proc = run_tool("preprocess_data.py", "--input", str(corpus), "--json-keys", "text", "title",
                    "--output-prefix", prefix, "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", model, "--append-eod", "--workers", "2",
                    "--chunk-size", "4", "--log-interval", "10")
    assert "docs/s" in proc.stderr and "MB/s" in proc.stderr
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    records = [json.loads(line) for line in open(corpus, encoding="utf-8") if line.strip()]
    for key in ("text", "title"):
        ds = IndexedDataset(f"{prefix}_{key}_document")
        assert ds.dtype == np.uint16
        expected = [tok.tokenize(r[key]) + [tok.eod] for r in records if r[key]]
        assert len(expected) == (29 if key == "text" else 30)
        assert len(ds) == len(expected) and ds.num_documents == len(expected)
        assert ds.document_indices.tolist() == list(range(len(expected) + 1))
        for i, ids in enumerate(expected):
            assert ds[i].tolist() == ids
        assert tok.detokenize(ds[0][:-1]) == records[0][key]

    # One worker writes the same bytes as two.
    single = str(tmp / "single" / "corpus")
    run_tool("preprocess_data.py", "--input", str(corpus), "--output-prefix", single,
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
             "--append-eod", "--workers", "1")
    for ext in (".bin", ".idx"):
        a = open(f"{prefix}_text_document{ext}", "rb").read()
        assert a == open(f"{single}_text_document{ext}", "rb").read()


def test_preprocess_null_tokenizer_and_bad_key(tmp_path):
    corpus = tmp_path / "ints.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in ("1 2 3", "70000 4")) + "\n")
    prefix = str(tmp_path / "ints")
    run_tool("preprocess_data.py", "--input", str(corpus), "--output-prefix", prefix,
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "80000", "--append-eod")
    ds = IndexedDataset(prefix + "_text_document")
    assert ds.dtype == np.int32  # vocab 80001 >= 65500
    assert [ds[i].tolist() for i in range(2)] == [[1, 2, 3, 80000], [70000, 4, 80000]]

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                           "--input", str(corpus), "--json-keys", "body", "--output-prefix",
                           prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "no key 'body'" in proc.stderr
