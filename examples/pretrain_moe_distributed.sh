#!/usr/bin/env bash
# Mixture-of-experts pretraining on GPUs with torchrun (run this on every node): a
# Mixtral-style model (8 experts, top-2, every layer MoE) with experts split over EP ranks.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node01 bash examples/pretrain_moe_distributed.sh DATA_PREFIX TOKENIZER_MODEL [extra flags]
# The expert mesh re-views each pipeline stage's ranks as expert-data x EP x ETP, so EP
# borrows data-parallel (and tensor-parallel) ranks: EP x ETP must divide DP x CP x TP.
# Re-running resumes from RUN_DIR/checkpoints; each layout gets its own run folder.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
DATA_PREFIX=$1
TOKENIZER_MODEL=$2
shift 2
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-8}
ITERS=${ITERS:-100000}
WORLD=$(( GPUS_PER_NODE * NNODES ))
MP=$(( TP * PP ))
DP=$(( MP > 0 ? WORLD / MP : 0 ))
RUN_DIR=${RUN_DIR:-runs/moe_8x1b/tp${TP}_pp${PP}_ep${EP}_dp${DP}}
DEFAULT_WARMUP=$(( ITERS / 50 > 0 ? ITERS / 50 : 1 ))
WARMUP=${WARMUP:-$(( DEFAULT_WARMUP < ITERS ? DEFAULT_WARMUP : 0 ))}

ARGS=(
    --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --group-query-attention
    --num-query-groups 8 --ffn-hidden-size 5632 --seq-length 4096 --max-position-embeddings 4096
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 5632
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-router-dtype fp32
    --tensor-model-parallel-size "$TP" --sequence-parallel --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
    --micro-batch-size 1 --global-batch-size 256 --train-iters "$ITERS" --bf16
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.1
    --adam-beta2 0.95 --clip-grad 1.0 --use-distributed-optimizer --overlap-grad-reduce
    --data-path "$DATA_PREFIX" --split 990,9,1 --tokenizer-type SentencePieceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000
    --exit-signal-handler --tensorboard-dir "$RUN_DIR/tensorboard"
    "$@"
)
# One process checks the flags for the whole world first: a mistake is one line, exit 2.
python -m megatron_cp.check_args --world-size "$WORLD" "${ARGS[@]}"
torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$REPO/pretrain_gpt.py" "${ARGS[@]}"
