"""A small real corpus for flag sets that ask for fill-in-the-middle data (``--fim-data``).

FIM rewrites the text of real documents, so it cannot run on mock tokens (Megatron-LM refuses
``--mock-data`` with ``--fim-data`` too). :func:`fim_corpus_flags` writes, under a folder, a
GPT-2 byte-level vocabulary (the 256 byte symbols, ``<|endoftext|>`` and Megatron-LM's four
default FIM tokens; no merges) and a few hundred short code-like documents, tokenizes them with
megatron_cp.data.preprocess (tools/preprocess_data.py's work) into ``.bin``/``.idx``, and
returns the data and tokenizer flags that replace the mock data of a flag set
(tools/flag_set_runs.py).
"""
import contextlib
import io
import json
import os

from megatron_cp.data import preprocess

FIM_SPECIAL_TOKENS = ("<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>",
                      "<fim_pad>")
NUM_DOCUMENTS = 300


def byte_symbols():
    """GPT-2's printable symbol of each byte 0..255 (its byte-level BPE alphabet): printable
    Latin-1 bytes stand for themselves, the others for the characters from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _document(i):
    """A short Python-like document, different for each ``i``."""
    name, a, b = f"f{i}", i % 7 + 1, i % 5
    return (f"def {name}(x, y={b}):\n    total = x * {a} + y\n"
            f"    return total - {i % 3}  # case {i}\n")


def fim_corpus_flags(folder):
    """Write the vocabulary and the corpus under ``folder`` (once) and return the flags that
    read them: ``--data-path``, ``--tokenizer-type GPT2BPETokenizer``, ``--vocab-file``,
    ``--merge-file``."""
    vocab_file, merge_file = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    prefix = os.path.join(folder, "fim_corpus")
    flags = ["--data-path", f"{prefix}_text_document", "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", vocab_file, "--merge-file", merge_file]
    if os.path.isfile(f"{prefix}_text_document.idx"):
        return flags
    os.makedirs(folder, exist_ok=True)
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    vocab.update({token: 256 + i for i, token in enumerate(FIM_SPECIAL_TOKENS)})
    with open(vocab_file, "w", encoding="utf-8") as file:
        json.dump(vocab, file, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as file:
        file.write("#version: 0.2\n")
    corpus = os.path.join(folder, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as file:
        for i in range(NUM_DOCUMENTS):
            file.write(json.dumps({"text": _document(i)}) + "\n")
    report = io.StringIO()  # the tool's progress lines: not part of a census table
    with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
        preprocess.main(["--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
                         "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file",
                         merge_file, "--append-eod", "--workers", "1",
                         "--log-interval", str(10 * NUM_DOCUMENTS)])
    return flags
