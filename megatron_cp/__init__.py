"""megatron_cp: a Megatron-style GPT pretraining library over TP/SP, CP, PP, DP and EP."""

__version__ = "0.1.0"
