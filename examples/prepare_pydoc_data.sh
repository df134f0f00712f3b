#!/usr/bin/env bash
# Build a small English corpus from Python's bundled docs (pydoc_data.topics, on every
# machine), train a sentencepiece tokenizer on it and preprocess it to Megatron's .bin/.idx.
#   bash examples/prepare_pydoc_data.sh [OUT_DIR] [VOCAB_SIZE]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-data_work}
VOCAB=${2:-2000}
mkdir -p "$OUT"
python "$REPO/tools/build_pydoc_corpus.py" --output "$OUT/pydoc.jsonl"
python "$REPO/tools/train_tokenizer.py" --input "$OUT/pydoc.jsonl" --model-prefix "$OUT/spm" \
    --vocab-size "$VOCAB" --model-type bpe
python "$REPO/tools/preprocess_data.py" --input "$OUT/pydoc.jsonl" --json-keys text \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/spm.model" \
    --append-eod --output-prefix "$OUT/pydoc" --workers 2
echo "data ready: $OUT/pydoc_text_document.{bin,idx}, tokenizer $OUT/spm.model"
