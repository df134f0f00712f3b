"""Autoregressive generation from a loaded :class:`~megatron_cp.inference.model.InferenceModel`.

Each step runs the new tokens through the pipeline stages (:mod:`.stages`): with the key/value
cache (:mod:`.kv_cache`) only the tokens not seen yet (the whole prompt on the first step,
then one token), without it the whole sequence again. The last stage gathers the logits of
the last position over TP, chooses the next token (:mod:`.sampling`) and every rank of the
model replica receives it, so all of them hold the same tokens and stop together. Positions
continue from the prompt; with learned absolute positions generation stops at
``max_position_embeddings`` tokens (rotary positions have no table and no such limit).
"""
from dataclasses import dataclass, field

import torch

from megatron_cp.inference.kv_cache import KVCache, cached_chunk_forward
from megatron_cp.inference.logits import full_vocab_logits
from megatron_cp.inference.sampling import sample
from megatron_cp.inference.stages import forward_through_stages


@dataclass
class Generation:
    """``tokens`` [b, prompt + generated] int64 (every rank); after a stop token the sequence
    is filled with it. ``logits``: with ``return_logits``, the full-vocabulary logits [b, v]
    each new token was chosen from (last pipeline stage only; empty elsewhere)."""
    tokens: torch.Tensor
    prompt_length: int
    logits: list = field(default_factory=list)

    def new_tokens(self, row=0, stop_token=None):
        """The generated ids of sequence ``row``, up to (without) the first ``stop_token``."""
        ids = self.tokens[row, self.prompt_length:].tolist()
        return ids[:ids.index(stop_token)] if stop_token in ids else ids


def max_total_length(config, prompt_length, max_new_tokens):
    """Tokens a sequence may reach: prompt + new ones, capped by the position table of learned
    absolute positions. ValueError when the prompt alone does not fit it."""
    total = prompt_length + max_new_tokens
    if config.position_embedding_type != "learned_absolute":
        return total
    if prompt_length > config.max_position_embeddings:
        raise ValueError(f"the prompt has {prompt_length} tokens but the model's learned position "
                         f"table has {config.max_position_embeddings} (max_position_embeddings); "
                         f"shorten the prompt")
    return min(total, config.max_position_embeddings)


@torch.no_grad()
def generate(model, prompt, max_new_tokens, params, seed=0, use_cache=True, stop_token=None,
             return_logits=False):
    """Continue ``prompt`` [b, s] (token ids, the same on every rank of the replica) by up to
    ``max_new_tokens`` tokens chosen under ``params`` (:class:`~.sampling.SamplingParams`),
    sampled from a generator seeded with ``seed``. A sequence ends at ``stop_token`` (None:
    never); generation ends when all have. Returns a :class:`Generation`."""
    config, state, device = model.config, model.state, model.device
    if config.sequence_parallel:
        raise ValueError("generation runs without sequence parallelism: drop --sequence-parallel")
    prompt = torch.as_tensor(prompt, dtype=torch.long, device=device)
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"the prompt must be [batch, tokens] with at least one token, got "
                         f"shape {tuple(prompt.shape)}")
    b, prompt_length = prompt.shape
    limit = max_total_length(config, prompt_length, max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(int(seed))
    cache = KVCache(model.model_chunks, limit) if use_cache else None
    tokens, done = prompt, torch.zeros(b, dtype=torch.bool, device=device)
    out = Generation(tokens, prompt_length)
    while tokens.shape[1] < limit and not bool(done.all()):
        start = cache.length if cache is not None else 0
        new = tokens[:, start:]  # [b, s_new]
        positions = torch.arange(start, tokens.shape[1], device=device).expand(b, -1)  # [b, s_new]

        def run_chunk(c, input_tensor):
            chunk = model.model_chunks[c]
            if cache is not None:
                return cached_chunk_forward(chunk, new, positions, input_tensor, cache.layers[c])
            chunk.set_input_tensor(input_tensor)
            output = chunk(new, positions)  # [s, b, h], or [s, b, v/tp] logits on the last stage
            return output[-1:] if chunk.post_process else output

        logits = forward_through_stages(model, run_chunk, (new.shape[1], b, config.hidden_size))
        next_token = torch.zeros(b, dtype=torch.long, device=device)
        if logits is not None:  # the last stage: [1, b, v/tp]
            full = full_vocab_logits(logits[0], config.vocab_size, state.group("tp"))  # [b, v]
            next_token = sample(full, params, generator)
            if return_logits:
                out.logits.append(full)
        model.agree(next_token)
        if stop_token is not None:
            next_token = torch.where(done, torch.full_like(next_token, stop_token), next_token)
            done |= next_token == stop_token
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
    out.tokens = tokens
    return out
