"""Attention of a whole (unsplit) sample: the no-CP path of the model's attention.

- A plain causal sample (no documents, token index 0..s-1): ``scaled_dot_product_attention``
  with ``is_causal=True`` (PyTorch picks its fused kernel; GQA via ``enable_gqa``).
- Packed documents: every document is one causal segment of a variable-length call (the
  sample's segment plan, classified once per microbatch by its SequenceLayout): on CUDA one
  padded dense cuDNN call or one flash varlen call, never an s x s mask; on CPU one CPU-flash call per document, which measured
  2.5-9x faster than SDPA with the boolean mask from s = 1k up (one thread, forward +
  backward; benchmarks/local_attention_cpu.py) and only loses at toy sizes (s = 32).
- Attention dropout (training): the plain-PyTorch dropout path of dropout.py, whose mask is
  the same under every layout (no fused kernel takes an external mask).
"""
import torch.nn.functional as F

from megatron_cp.context_parallel.blockwise import planned_attention
from megatron_cp.context_parallel.dropout import dropout_attention
from megatron_cp.context_parallel.kernels import attention_kernel
from megatron_cp.context_parallel.reference import softmax_scale_for
from megatron_cp.context_parallel.layout import SequenceLayout


def local_attention(q, k, v, token_index=None, document_ids=None, softmax_scale=None,
                    kernel=None, dropout=None, layout=None):
    """Attention of a whole sample: q [b, nh, s, d], k/v [b, nkv, s, d] -> [b, nh, s, d].

    token_index [b, s] (None: 0..s-1) and document_ids [b, s] (None: one document) give the
    mask (causal within each document). ``kernel``: an AttentionKernel or its name (None:
    "auto"). ``dropout``: an AttentionDropout (dropout.py) or None. ``layout``: the
    microbatch's SequenceLayout (layout.py) holding the plan of this metadata, worked out
    before the layers (None: planned here, from the metadata on the host). Backward is
    autograd's (SDPA, ``masked_attention`` or the dropout path's).
    """
    kernel = attention_kernel(kernel)
    s = q.shape[2]
    scale = softmax_scale_for(q, softmax_scale)
    if dropout is not None:
        return dropout_attention(q, k, v, token_index, document_ids, dropout, scale)
    if layout is None:
        layout = SequenceLayout(token_index, document_ids)
    kind, plan = layout.local(s, q.device)
    if kind == "sdpa":
        if kernel.name == "auto":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=k.shape[1] != q.shape[1])
        kind, plan = layout.block_plan(s, q.device)
    return planned_attention(q, k, v, kind, plan, scale, kernel)
