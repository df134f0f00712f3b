#!/usr/bin/env bash
# Mixture-of-experts pretraining on GPUs with torchrun (run this on every node): a
# Mixtral-style model (8 experts, top-2, every layer MoE) with experts split over EP ranks.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node01 bash examples/pretrain_moe_distributed.sh DATA_PREFIX TOKENIZER_MODEL [extra flags]
# The expert mesh re-views each pipeline stage's ranks as expert-data x EP x ETP, so EP
# borrows data-parallel (and tensor-parallel) ranks: EP x ETP must divide DP x CP x TP.
# The launch (flag check, torchrun, resume from RUN_DIR/checkpoints) is
# examples/pretrain_gpt_distributed.sh's; the flags below come after its own, so they win.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export TP=${TP:-1} CP=${CP:-1} PP=${PP:-1}
EP=${EP:-8}
export RUN_DIR=${RUN_DIR:-runs/moe_8x1b/tp${TP}_pp${PP}_ep${EP}}
exec bash "$HERE/pretrain_gpt_distributed.sh" "$1" "$2" \
    --num-layers 16 --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 \
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 5632 \
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss \
    --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-router-dtype fp32 \
    --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1 \
    --use-distributed-optimizer "${@:3}"
