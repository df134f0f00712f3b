#!/usr/bin/env bash
# Each model path added since the last GPU run, trained for 10 iterations by pretrain_gpt.py on
# one device (mock data, bf16 on CUDA): does it run, and does its loss fall. A smoke probe,
# not a check against a reference (tools/gpu_check.py holds those).
#   bash benchmarks/probes/gpu_paths_smoke.sh [cpu]   # the device defaults to cuda
DEVICE=${1:-cuda}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BASE="--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512
 --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 4 --train-iters 10
 --lr 1e-3 --log-interval 5 --eval-iters 0 --mock-data --tokenizer-type NullTokenizer
 --vocab-size 1023 --seed 7"
LLAMA="--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope
 --untie-embeddings-and-output-weights"
if [ "$DEVICE" = cuda ]; then BASE="$BASE --bf16 --distributed-backend nccl"
else BASE="$BASE --distributed-backend gloo"; fi
declare -A RUNS=(
 [megatron_defaults_dropout]=""
 [gated_deltanet]="$LLAMA --group-query-attention --num-query-groups 2
   --experimental-attention-variant gated_delta_net --linear-attention-freq 4
   --linear-conv-kernel-dim 4 --linear-key-head-dim 32 --linear-value-head-dim 32
   --linear-num-key-heads 4 --linear-num-value-heads 8"
 [mla_moe_mtp]="$LLAMA --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01
   --mtp-num-layers 1 --multi-latent-attention --q-lora-rank 64 --kv-lora-rank 64
   --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32"
 [sinkhorn_moe]="$LLAMA --num-experts 4 --moe-router-topk 1
   --moe-router-load-balancing-type sinkhorn"
 [mup]="$LLAMA --use-mup --mup-base-hidden-size 128"
 [muon]="$LLAMA --optimizer muon"
 [fsdp2]="$LLAMA --use-torch-fsdp2"
 [offload_tiled]="$LLAMA --cpu-offloading-num-layers 2 --tiled-logits-chunk-size 128"
)
fail=0
for name in megatron_defaults_dropout gated_deltanet mla_moe_mtp sinkhorn_moe mup muon fsdp2 offload_tiled; do
  start=$(date +%s.%N)
  out=$(cd "$REPO" && MASTER_PORT=29611 timeout 120 python pretrain_gpt.py $BASE ${RUNS[$name]} 2>&1)
  rc=$?
  secs=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
  losses=$(printf '%s\n' "$out" | grep -o "lm loss: [0-9.E+-]*" | tr '\n' ' ')
  if [ $rc -ne 0 ]; then fail=1; echo "FAIL $name rc=$rc ${secs}s"; printf '%s\n' "$out" | tail -15
  else echo "ran  $name ${secs}s $losses"; fi
done
exit $fail
