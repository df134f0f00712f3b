"""Which TP, CP, PP, DP, EP and recompute for this model on these GPUs, and how long a sequence?

    python tools/plan_layout.py <pretrain_gpt.py flags> --num-gpus 8 --gpu-memory-gb 80 \
        [--device gpu|cpu] [--json] [--top 20]

The command line of megatron_cp.planning.plan_layout, which holds the planner and says what it
prints (``--help`` lists the flags).
"""
import sys

from megatron_cp.planning.plan_layout import main

if __name__ == "__main__":
    sys.exit(main())
