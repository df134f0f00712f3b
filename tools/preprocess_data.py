"""Tokenize a jsonl corpus into Megatron's indexed format (``.bin`` + ``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/pydoc --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model --append-eod --workers 4

The command line of megatron_cp.data.preprocess, which does the work and says what it writes
(``--help`` lists Megatron-LM's flags it takes).
"""
from megatron_cp.data.preprocess import main

if __name__ == "__main__":
    main()
