#!/usr/bin/env bash
# The README's main job: a tiny GPT pretrained on CPU over several parallel dimensions.
# Builds its own data (examples/prepare_pydoc_data.sh) unless DATA_DIR already holds it.
#   bash examples/pretrain_gpt_cpu.sh                     # defaults below
#   NPROC=4 TP=2 CP=1 PP=1 ITERS=300 bash examples/pretrain_gpt_cpu.sh   # TP x DP instead
#   bash examples/pretrain_gpt_cpu.sh --log-params-norm  # extra flags go to pretrain_gpt.py
# Defaults: 8 processes = TP=2 (with SP) x CP=2 (ring attention) x PP=2 (1F1B), DP=1.
#
# Re-running resumes: checkpoints are saved to and loaded from RUN_DIR/checkpoints, and a
# run that already reached ITERS says so. Each layout gets its own run folder
# (runs/gpt_cpu/tp2_cp2_pp2_dp1 by default; RUN_DIR overrides it), so changing NPROC/TP/CP/PP
# starts a new run instead of overwriting another layout's checkpoints. To extend a finished
# run, raise ITERS and choose how the learning-rate schedule goes on (the decay length and the
# warmup follow ITERS): add --override-opt_param-scheduler (the new schedule) or
# --use-checkpoint-opt_param-scheduler (the saved one).
#
# Other variables: DATA_DIR (corpus and tokenizer), CP_COMM (CP attention), WARMUP (default
# 10% of ITERS, at least 1), SAVE_INTERVAL, EVAL_INTERVAL, LOG_INTERVAL, and DATA_ARGS, which
# replaces the data flags (e.g. DATA_ARGS="--mock-data --vocab-size 2000" needs no corpus).
set -euo pipefail
# the repository, whatever the working directory (DATA_DIR and RUN_DIR are relative to that)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
DATA_DIR=${DATA_DIR:-data_work}
NPROC=${NPROC:-8}
TP=${TP:-2}
CP=${CP:-2}
PP=${PP:-2}
ITERS=${ITERS:-200}
CP_COMM=${CP_COMM:-p2p}
MP=$(( TP * CP * PP ))
DP=$(( MP > 0 ? NPROC / MP : 0 ))
RUN_DIR=${RUN_DIR:-runs/gpt_cpu/tp${TP}_cp${CP}_pp${PP}_dp${DP}}
# warmup: 10% of the run, at least 1 iteration, always shorter than the decay (ITERS)
DEFAULT_WARMUP=$(( ITERS / 10 > 0 ? ITERS / 10 : 1 ))
WARMUP=${WARMUP:-$(( DEFAULT_WARMUP < ITERS ? DEFAULT_WARMUP : 0 ))}

MODEL_ARGS=(
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4
    --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope
    --normalization RMSNorm --swiglu --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0 --make-vocab-size-divisible-by 64
)
TRAIN_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS"
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP"
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --sequence-parallel
    --context-parallel-size "$CP" --cp-comm-type "$CP_COMM"
    --pipeline-model-parallel-size "$PP" --distributed-backend gloo
)
if [ -n "${DATA_ARGS:-}" ]; then
    read -r -a DATA_ARGS <<< "$DATA_ARGS"
else
    if [ ! -f "$DATA_DIR/pydoc_text_document.idx" ]; then
        bash "$REPO/examples/prepare_pydoc_data.sh" "$DATA_DIR"
    fi
    DATA_ARGS=(
        --data-path "$DATA_DIR/pydoc_text_document" --split 949,50,1
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA_DIR/spm.model"
        --data-cache-path "$DATA_DIR/cache"
    )
fi
OUTPUT_ARGS=(
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-50}" --eval-iters 5
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints"
    --save-interval "${SAVE_INTERVAL:-100}" --tensorboard-dir "$RUN_DIR/tensorboard"
)
ARGS=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
      "${OUTPUT_ARGS[@]}" "$@")

# One process checks the flags first: a mistake is one line and exit status 2, not a
# traceback per rank and torchrun's failure report.
python -m megatron_cp.cli.check_args --world-size "$NPROC" "${ARGS[@]}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "run folder: $RUN_DIR (TP=$TP CP=$CP PP=$PP DP=$DP, $ITERS iterations)"
torchrun --standalone --nproc-per-node "$NPROC" "$REPO/pretrain_gpt.py" "${ARGS[@]}"
