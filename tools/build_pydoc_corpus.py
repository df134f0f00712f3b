"""Write a small English jsonl corpus from Python's bundled documentation.

Every Python installation ships ``pydoc_data.topics.topics`` (~0.5 MB of reference text
in ~80 entries); each entry becomes one line ``{"text": ...}``, in sorted key order so
the corpus is identical on every machine with the same Python version::

    python tools/build_pydoc_corpus.py --output data/pydoc.jsonl
"""
import argparse
import json
import os
import sys


def build_corpus(output):
    """Write the corpus to ``output``; returns (number of documents, characters)."""
    from pydoc_data.topics import topics

    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    num_chars = 0
    with open(output, "w", encoding="utf-8") as f:
        for key in sorted(topics):
            text = topics[key]
            num_chars += len(text)
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return len(topics), num_chars


def main(argv=None):
    """Parse ``--output`` and write the corpus."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="jsonl file to write")
    args = parser.parse_args(argv)
    num_docs, num_chars = build_corpus(args.output)
    print(f"wrote {num_docs} documents ({num_chars} characters) to {args.output}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
