#!/usr/bin/env bash
# The README's main job: a tiny GPT pretrained on CPU over several parallel dimensions.
# Builds its own data (examples/prepare_pydoc_data.sh) unless DATA_DIR already holds it.
#   bash examples/pretrain_gpt_cpu.sh                     # defaults below
#   NPROC=4 TP=2 CP=1 PP=1 ITERS=300 bash examples/pretrain_gpt_cpu.sh   # TP x DP instead
# Defaults: 8 processes = TP=2 (with SP) x CP=2 (ring attention) x PP=2 (1F1B), DP=1.
set -euo pipefail
DATA_DIR=${DATA_DIR:-data_work}
RUN_DIR=${RUN_DIR:-runs/gpt_cpu}
NPROC=${NPROC:-8}
TP=${TP:-2}
CP=${CP:-2}
PP=${PP:-2}
ITERS=${ITERS:-200}
CP_COMM=${CP_COMM:-p2p}

if [ ! -f "$DATA_DIR/pydoc_text_document.idx" ]; then
    bash examples/prepare_pydoc_data.sh "$DATA_DIR"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

MODEL_ARGS=(
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4
    --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope
    --normalization RMSNorm --swiglu --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0 --make-vocab-size-divisible-by 64
)
TRAIN_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS"
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --sequence-parallel
    --context-parallel-size "$CP" --cp-comm-type "$CP_COMM"
    --pipeline-model-parallel-size "$PP" --distributed-backend gloo
)
DATA_ARGS=(
    --data-path "$DATA_DIR/pydoc_text_document" --split 949,50,1
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA_DIR/spm.model"
    --data-cache-path "$DATA_DIR/cache"
)
OUTPUT_ARGS=(
    --log-interval 10 --eval-interval 50 --eval-iters 5
    --save "$RUN_DIR/checkpoints" --save-interval 100
    --tensorboard-dir "$RUN_DIR/tensorboard"
)
torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@"
