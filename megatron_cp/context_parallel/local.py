"""Attention of a whole (unsplit) sample: the no-CP path of the model's attention.

- A plain causal sample (no documents, token index 0..s-1): ``scaled_dot_product_attention``
  with ``is_causal=True`` (PyTorch picks its fused kernel; GQA via ``enable_gqa``).
- Packed documents: every document is one causal segment of a variable-length call
  (``masked_attention`` classifies the sample and runs its segment plan): on CUDA one flash
  varlen call, never an s x s mask; on CPU one CPU-flash call per document, which measured
  2.5-9x faster than SDPA with the boolean mask from s = 1k up (one thread, forward +
  backward; benchmarks/local_attention_cpu.py) and only loses at toy sizes (s = 32).
- Attention dropout > 0 with documents keeps SDPA with a boolean mask (flash varlen would
  need its RNG state carried to backward; no fused dropout path exists on CPU).
"""
import torch
import torch.nn.functional as F

from megatron_cp.context_parallel.blockwise import masked_attention
from megatron_cp.context_parallel.kernels import attention_kernel
from megatron_cp.context_parallel.reference import attention_mask, softmax_scale_for
from megatron_cp.context_parallel.segments import is_plain_arange

def _mask_sdpa(q, k, v, token_index, document_ids, scale, dropout_p, gqa):
    """SDPA with the boolean causal/document mask [b, 1, s, s]; rows without a key give 0."""
    mask = attention_mask(token_index, token_index, document_ids, document_ids)  # [b, 1, s, s]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=gqa)
    has_key = mask.any(-1, keepdim=True)  # [b, 1, s, 1]
    return out if bool(has_key.all()) else out.masked_fill(~has_key, 0.0)


def local_attention(q, k, v, token_index=None, document_ids=None, softmax_scale=None,
                    dropout_p=0.0, kernel=None):
    """Attention of a whole sample: q [b, nh, s, d], k/v [b, nkv, s, d] -> [b, nh, s, d].

    token_index [b, s] (None: 0..s-1) and document_ids [b, s] (None: one document) give the
    mask (causal within each document). ``dropout_p`` drops attention probabilities from the
    current RNG state (the caller forks the tensor-parallel RNG around it). ``kernel``: an
    AttentionKernel or its name (None: "auto"). Backward is autograd's (SDPA or
    ``masked_attention``).
    """
    kernel = attention_kernel(kernel)
    b, s = q.shape[0], q.shape[2]
    scale = softmax_scale_for(q, softmax_scale)
    gqa = k.shape[1] != q.shape[1]
    plain = document_ids is None and is_plain_arange(token_index, s)
    if plain and (kernel.name == "auto" or dropout_p > 0):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              scale=scale, enable_gqa=gqa)
    if token_index is None:
        token_index = torch.arange(s, device=q.device).expand(b, s)
    if dropout_p > 0:
        return _mask_sdpa(q, k, v, token_index, document_ids, scale, dropout_p, gqa)
    return masked_attention(q, k, v, token_index, token_index, document_ids, document_ids, scale,
                            kernel)
