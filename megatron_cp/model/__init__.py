"""The GPT model: config, embedding, transformer layers, attention, MLP, norms, rotary."""
from megatron_cp.config.model import GPTConfig, pad_vocab_size  # noqa: F401
from megatron_cp.model.gpt import GPTModel  # noqa: F401
