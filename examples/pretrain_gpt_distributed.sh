#!/usr/bin/env bash
# Multi-node GPU pretraining with torchrun (run this on every node).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node01 bash examples/pretrain_gpt_distributed.sh DATA_PREFIX TOKENIZER_MODEL [extra flags]
# Re-running resumes from RUN_DIR/checkpoints (--save and --load); each layout gets its own
# run folder (runs/gpt_1b/tp2_cp2_pp1_dpN by default; RUN_DIR overrides it). The warmup is 2%
# of ITERS (WARMUP overrides it). To extend a run, raise ITERS and add
# --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler.
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
TP=${TP:-2}
CP=${CP:-2}
PP=${PP:-1}
ITERS=${ITERS:-100000}
WORLD=$(( GPUS_PER_NODE * NNODES ))
MP=$(( TP * CP * PP ))
DP=$(( MP > 0 ? WORLD / MP : 0 ))
RUN_DIR=${RUN_DIR:-runs/gpt_1b/tp${TP}_cp${CP}_pp${PP}_dp${DP}}
DEFAULT_WARMUP=$(( ITERS / 50 > 0 ? ITERS / 50 : 1 ))
WARMUP=${WARMUP:-$(( DEFAULT_WARMUP < ITERS ? DEFAULT_WARMUP : 0 ))}

ARGS=(
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --group-query-attention
    --num-query-groups 4 --ffn-hidden-size 5632 --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
    --tensor-model-parallel-size "$TP" --sequence-parallel --context-parallel-size "$CP"
    --cp-comm-type p2p --pipeline-model-parallel-size "$PP"
    --micro-batch-size 1 --global-batch-size 256 --train-iters "$ITERS" --bf16
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.1
    --adam-beta2 0.95 --clip-grad 1.0 --overlap-grad-reduce
    --data-path "$DATA_PREFIX" --split 990,9,1 --tokenizer-type SentencePieceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000
    --exit-signal-handler --tensorboard-dir "$RUN_DIR/tensorboard"
    "$@"
)
# One process checks the flags for the whole world first: a mistake is one line, exit 2.
python -m megatron_cp.cli.check_args --world-size "$WORLD" "${ARGS[@]}"
torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$REPO/pretrain_gpt.py" "${ARGS[@]}"
