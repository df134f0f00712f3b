"""Tokenize a jsonl corpus into Megatron's indexed format (``.bin`` + ``.idx``).

Usage (Megatron-LM's flags)::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/pydoc --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model --append-eod --workers 4

writes ``data/pydoc_text_document.bin/.idx`` (one per json key). Every document is one
sequence; documents without tokens are skipped. Lines are tokenized by a
multiprocessing Pool (``imap`` keeps the order) and progress goes to stderr every
``--log-interval`` documents.
"""
import argparse
import json
import multiprocessing
import os
import sys
import time

from megatron_cp.data.indexed_dataset import (IndexedDatasetBuilder, data_file_path,
                                              index_file_path, optimal_dtype)
from megatron_cp.data.tokenizers import TOKENIZER_TYPES, build_tokenizer


class Encoder:
    """Tokenizes one json line; each worker builds its own tokenizer in :meth:`initializer`."""

    tokenizer = None

    def __init__(self, args):
        self.args = args

    def initializer(self):
        """Build the tokenizer once per worker process."""
        Encoder.tokenizer = tokenizer_of(self.args)

    def encode(self, line):
        """``line`` -> ({key: token ids}, bytes read); ids are None for a blank line."""
        if not line.strip():
            return None, len(line.encode("utf-8"))
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.args.input}: a line is not valid JSON ({err}): "
                             f"{line[:80]!r}") from err
        ids = {}
        for key in self.args.json_keys:
            if key not in record:
                raise ValueError(f"{self.args.input}: a record has no key {key!r} (keys: "
                                 f"{sorted(record)}); pass --json-keys with the right field")
            tokens = Encoder.tokenizer.tokenize(record[key])
            if tokens and self.args.append_eod:
                tokens.append(Encoder.tokenizer.eod)
            ids[key] = tokens
        return ids, len(line.encode("utf-8"))


def tokenizer_of(args):
    """The tokenizer that this tool's tokenizer flags name."""
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                           args.merge_file, args.vocab_size,
                           not args.tokenizer_hf_no_include_special_tokens,
                           args.tiktoken_pattern, args.tiktoken_num_special_tokens,
                           args.special_tokens)


def get_args(argv=None):
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, one document per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each json record (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None,
                       help="sentencepiece .model file, or (HuggingFaceTokenizer) a local "
                            "tokenizer folder or tokenizer.json file")
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer vocab size; TikTokenizer's vocabulary (default 2^17)")
    group.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None,
                       help="TikTokenizer's pre-tokenization regex (default v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer: ids below this are special tokens")
    group.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                       dest="special_tokens", help="TikTokenizer's special tokens")
    group.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: encode without the special tokens (bos, ...) "
                            "the tokenizer adds by default, as Megatron-LM's flag")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes <prefix>_<key>_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--chunk-size", type=int, default=32,
                       help="lines handed to a worker at a time")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="report progress every this many documents")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.chunk_size < 1 or args.log_interval < 1:
        parser.error(f"--workers ({args.workers}), --chunk-size ({args.chunk_size}) and "
                     f"--log-interval ({args.log_interval}) must be >= 1")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input} does not exist")
    return args


def output_prefix(prefix, key):
    """Megatron's naming: ``<prefix>_<key>_document``."""
    return f"{prefix}_{key}_document"


def main(argv=None):
    """Run the preprocessing; returns {key: output prefix}."""
    args = get_args(argv)
    encoder = Encoder(args)
    tokenizer = tokenizer_of(args)  # validates the flags before any worker starts
    dtype = optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {key: output_prefix(args.output_prefix, key) for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(data_file_path(p), dtype=dtype)
                for key, p in prefixes.items()}

    start = time.time()
    total_bytes = num_docs = num_skipped = 0
    with open(args.input, encoding="utf-8") as fin:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
            results = pool.imap(encoder.encode, fin, args.chunk_size)
        else:
            pool = None
            encoder.initializer()
            results = map(encoder.encode, fin)
        try:
            for ids, num_bytes in results:
                total_bytes += num_bytes
                if ids is None:
                    continue
                num_docs += 1
                for key, tokens in ids.items():
                    if tokens:
                        builders[key].add_document(tokens)
                    else:
                        num_skipped += 1
                if num_docs % args.log_interval == 0:
                    _log_progress(num_docs, total_bytes, start)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    for key, builder in builders.items():
        builder.finalize(index_file_path(prefixes[key]))
    _log_progress(num_docs, total_bytes, start)
    print(f"done: {num_docs} documents ({num_skipped} empty ones skipped), token dtype "
          f"{dtype.__name__}, vocab size {tokenizer.vocab_size}, eod {tokenizer.eod}; wrote "
          + ", ".join(p + ".bin/.idx" for p in prefixes.values()), file=sys.stderr)
    return prefixes


def _log_progress(num_docs, total_bytes, start):
    elapsed = max(time.time() - start, 1e-9)
    print(f"processed {num_docs} documents ({num_docs / elapsed:.1f} docs/s, "
          f"{total_bytes / elapsed / 1024 / 1024:.2f} MB/s)", file=sys.stderr, flush=True)
