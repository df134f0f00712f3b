#!/usr/bin/env bash
# DeepSeek-V3-shaped pretraining on 64 GPUs (8 nodes x 8) with torchrun (run this on every node):
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=node01 bash examples/pretrain_deepseek_v3_distributed.sh DATA_PREFIX TOKENIZER_MODEL [extra flags]
# DeepSeek-V3's layer (hidden 7168, 128 heads, multi-latent attention with q-LoRA 1536,
# kv-LoRA 512, head dims 128 + 64 rope / 128 v, YaRN x40; MoE with 2048-wide experts, a
# shared expert, a grouped sigmoid router with expert bias, scaling 2.5) at Megatron-LM's
# 64-GPU proxy depth and width (its tests' deepseekv3_proxy_flex_tp1pp4emp16etp1cp1):
# 14 layers (3 dense first), 64 routed experts of which 8 per token in 4 of 8 groups, and one
# multi-token-prediction depth (loss x 0.1). Layout: TP 2 + SP, PP 4 with 2 virtual stages
# per rank (Megatron-LM's layout string, the MTP depth on the last stage), EP 16 (4 experts
# per rank; EP borrows DP x TP ranks), DP 8, distributed optimizer. Megatron-LM's rank order
# (PP outermost): a stage is 2 whole nodes, so the EP all-to-all spans 2 nodes, not all 8
# as under our default (DP outermost, a DP replica per node).
# The launch (flag check, torchrun, resume from RUN_DIR/checkpoints) is
# examples/pretrain_gpt_distributed.sh's; the flags below come after its own, so they win.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export TP=${TP:-2} CP=${CP:-1} PP=${PP:-4}
export NNODES=${NNODES:-8}
EP=${EP:-16}
export RUN_DIR=${RUN_DIR:-runs/deepseek_v3_proxy/tp${TP}_pp${PP}_ep${EP}}
exec bash "$HERE/pretrain_gpt_distributed.sh" "$1" "$2" \
    --num-layers 14 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 \
    --num-query-groups 128 --seq-length 4096 --max-position-embeddings 4096 \
    --norm-epsilon 1e-6 --make-vocab-size-divisible-by 3232 \
    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 \
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 \
    --mscale 1.0 --mscale-all-dim 1.0 \
    --num-experts 64 --moe-layer-freq '([0]*3+[1]*11)' --moe-ffn-hidden-size 2048 \
    --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 \
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
    --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8 --moe-router-group-topk 4 \
    --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss \
    --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall \
    --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1 \
    --rank-order tp-cp-ep-dp-pp --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 \
    --pipeline-model-parallel-layout 'Et*2|(tt|)*5t|tmL' \
    --micro-batch-size 1 --global-batch-size 512 --lr 1e-5 --min-lr 1e-6 --weight-decay 0.1 \
    --init-method-std 0.02 --use-distributed-optimizer "${@:3}"
