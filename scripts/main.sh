#!/usr/bin/env bash
# The main job, from a fresh machine: set up .venv when needed (scripts/env.sh), then train
# the tiny GPT on 8 CPU processes in 4D (examples/pretrain_gpt_cpu.sh; its variables and
# extra flags pass through, e.g. ITERS=300 bash scripts/main.sh --override-opt_param-scheduler).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec bash examples/pretrain_gpt_cpu.sh "$@"
