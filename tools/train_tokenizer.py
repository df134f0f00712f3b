"""Train a sentencepiece tokenizer on a text or jsonl corpus.

    python tools/train_tokenizer.py --input data/pydoc.jsonl --json-keys text \\
        --model-prefix data/pydoc_sp --vocab-size 4000 --model-type bpe

writes ``<model-prefix>.model`` and ``.vocab``. The model always has ``</s>`` (the eos
id, which SentencePieceTokenizer uses as eod), ``<unk>`` and ``<s>``. By default text is
kept verbatim: no normalization, repeated spaces kept and ``\\n`` a piece of its own, so
detokenize(tokenize(text)) gives code and indentation back. A ``.jsonl`` input (or
``--input-format jsonl``) reads ``--json-keys`` of every record; other files are read
as plain text, one paragraph (blank-line separated) per training sentence.
"""
import argparse
import json
import os
import sys


def iter_documents(path, json_keys, input_format="auto"):
    """Yield the documents of ``path``: json fields of each record, or plain-text paragraphs."""
    if input_format == "auto":
        input_format = "jsonl" if path.endswith((".jsonl", ".json")) else "text"
    with open(path, encoding="utf-8") as f:
        if input_format == "jsonl":
            for line in f:
                if not line.strip():
                    continue
                record = json.loads(line)
                for key in json_keys:
                    if key not in record:
                        raise ValueError(f"{path}: a record has no key {key!r} (keys: "
                                         f"{sorted(record)}); pass --json-keys")
                    yield record[key]
        else:
            yield from f.read().split("\n\n")


def iter_sentences(documents, max_chars):
    """Training sentences: paragraphs of the documents, cut to at most ``max_chars``."""
    for doc in documents:
        for paragraph in doc.split("\n\n"):
            if not paragraph.strip():
                continue
            for start in range(0, len(paragraph), max_chars):
                yield paragraph[start:start + max_chars]


def train(input_path, model_prefix, vocab_size, model_type="bpe", json_keys=("text",),
          input_format="auto", verbatim=True, byte_fallback=False, character_coverage=1.0):
    """Train and write ``<model_prefix>.model``; returns its path."""
    import sentencepiece

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type {model_type!r} must be bpe or unigram")
    directory = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(directory, exist_ok=True)
    options = dict(
        model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
        character_coverage=character_coverage, byte_fallback=byte_fallback,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,  # eos </s> is the eod token
        max_sentence_length=1 << 16, minloglevel=2, num_threads=2,
    )
    if verbatim:
        options.update(normalization_rule_name="identity", remove_extra_whitespaces=False,
                       user_defined_symbols=["\n"], split_digits=True)
    sentences = iter_sentences(iter_documents(input_path, json_keys, input_format), 4096)
    try:
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=sentences, **options)
    except RuntimeError as err:
        raise ValueError(f"sentencepiece training failed on {input_path} with vocab_size "
                         f"{vocab_size}: {err}. A small corpus needs a smaller --vocab-size") from err
    return model_prefix + ".model"


def main(argv=None):
    """Parse the command line and train."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="corpus: .jsonl or plain text")
    parser.add_argument("--input-format", choices=("auto", "jsonl", "text"), default="auto")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--model-prefix", required=True, help="writes <prefix>.model/.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--byte-fallback", action="store_true",
                        help="add 256 byte pieces so unseen characters are not <unk>")
    parser.add_argument("--character-coverage", type=float, default=1.0)
    parser.add_argument("--normalize", action="store_true",
                        help="sentencepiece's NFKC normalization and whitespace folding "
                             "instead of verbatim text")
    args = parser.parse_args(argv)
    path = train(args.input, args.model_prefix, args.vocab_size, args.model_type,
                 args.json_keys, args.input_format, verbatim=not args.normalize,
                 byte_fallback=args.byte_fallback, character_coverage=args.character_coverage)
    print(f"wrote {path} (vocab size {args.vocab_size}, eod = eos id 2)", file=sys.stderr)


if __name__ == "__main__":
    main()
