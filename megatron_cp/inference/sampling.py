"""Choosing the next token from full-vocabulary logits ``[b, v]``: greedy, or sampling with a
temperature, top-k and top-p (nucleus) filtering, drawn from a seeded generator.

The order is temperature, then top-k, then top-p (on the tempered distribution), as in
Hugging Face ``generate``. Filtered entries become -inf, so they get probability 0.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``greedy``: the argmax (the rest is ignored);
    ``temperature`` > 0 divides the logits; ``top_k`` > 0 keeps the k largest logits (0: all);
    ``top_p`` in (0, 1) keeps the smallest set of most likely tokens whose probability
    reaches p (0 or 1: all)."""
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"--temperature ({self.temperature}) must be > 0; for the most "
                             f"likely token use --greedy")
        if self.top_k < 0:
            raise ValueError(f"--top-k ({self.top_k}) must be >= 0 (0: no top-k filtering)")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"--top-p ({self.top_p}) must lie in [0, 1] (0 or 1: no top-p "
                             f"filtering)")


def top_k_filter(logits, k):
    """``logits`` [..., v] with every entry below the k-th largest set to -inf (ties with the
    k-th are kept); ``k`` <= 0 or >= v keeps everything."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits, p):
    """``logits`` [..., v] keeping only the most likely tokens whose probabilities, taken in
    decreasing order, first reach ``p`` (a token is kept while the probability before it is
    below p, so the most likely one always is); ``p`` <= 0 or >= 1 keeps everything."""
    if p <= 0.0 or p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, dim=-1, descending=True)  # [..., v]
    probs = torch.softmax(ordered.float(), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= p)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits, params, generator=None):
    """The next token ids [b] from full-vocabulary ``logits`` [b, v] under ``params``
    (a :class:`SamplingParams`), drawn from ``generator``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    logits = top_p_filter(top_k_filter(logits, params.top_k), params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
