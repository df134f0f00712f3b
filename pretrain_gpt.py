"""Pretrain a GPT model with Megatron-LM's command line (launch with torchrun or srun).

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 ... --data-path PREFIX
"""
import sys

from megatron_cp.training import main

if __name__ == "__main__":
    sys.exit(main())
