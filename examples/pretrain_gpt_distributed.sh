#!/usr/bin/env bash
# Multi-node GPU pretraining with torchrun (run this on every node).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node01 bash examples/pretrain_gpt_distributed.sh DATA_PREFIX TOKENIZER_MODEL
set -euo pipefail
DATA_PREFIX=$1
TOKENIZER_MODEL=$2
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt_1b}

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --group-query-attention \
    --num-query-groups 4 --ffn-hidden-size 5632 --seq-length 8192 --max-position-embeddings 8192 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 \
    --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 \
    --cp-comm-type p2p --pipeline-model-parallel-size 1 \
    --micro-batch-size 1 --global-batch-size 256 --train-iters 100000 --bf16 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 \
    --adam-beta2 0.95 --clip-grad 1.0 --overlap-grad-reduce \
    --data-path "$DATA_PREFIX" --split 990,9,1 --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$TOKENIZER_MODEL" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --save "$CHECKPOINT_DIR" \
    --load "$CHECKPOINT_DIR" --save-interval 1000 --exit-signal-handler \
    --tensorboard-dir "$CHECKPOINT_DIR/tensorboard"
