"""Microbatch padding to the fixed pipeline buffer length.

Activations cross a stage boundary in buffers of one shape fixed by the config, so every
microbatch must have exactly the buffer's sequence length. A shorter one is padded by
EXTENDING ITS LAST DOCUMENT: pad tokens get token/label 0, loss mask 0, the last document's
id, and position ids (and token indices) that continue from its last token. Pad tokens come
after every real token of the sample, so causal attention keeps every real token's output
unchanged, and their loss is masked: the loss and gradients are those of the unpadded batch.
A zero-length extra document is never added (an empty attention row would be NaN in
softmax). A microbatch longer than the buffer is an error naming the flag to raise.

With context parallelism the CP partition pads each packed document to a multiple of
2 x CP itself; the pipeline then passes ``target_length`` to
``megatron_cp.context_parallel.partition_batch`` instead of calling :func:`pad_microbatch`.
"""
import torch

BUFFER_FLAG = "--pipeline-seq-length"
_CONTINUING = ("position_ids", "token_index")  # keep counting up through the padding
_REPEATED = ("document_ids",)  # the pad tokens belong to the last document


def too_long_message(length, target_length, what="microbatch"):
    """The error text for a microbatch that does not fit the pipeline buffer."""
    return (f"{what} has sequence length {length}, longer than the pipeline buffer "
            f"({target_length} tokens per sample, {BUFFER_FLAG}); raise {BUFFER_FLAG} to at "
            f"least {length} or shorten the samples")


def pad_microbatch(batch, target_length):
    """Return ``batch`` (a dict of ``[b, s]`` tensors) padded to ``[b, target_length]``.

    Keys: tokens, labels, loss_mask, position_ids (required), document_ids / token_index
    (optional, None allowed); any other ``[b, s]`` tensor is padded with 0. Non-tensor
    values are kept, except ``cu_seqlens`` whose last boundary grows with the last document.
    """
    tokens = batch["tokens"]
    b, s = tokens.shape
    if s > target_length:
        raise ValueError(too_long_message(s, target_length))
    if s == target_length:
        return batch
    extra = target_length - s
    steps = torch.arange(1, extra + 1, device=tokens.device)  # [extra]
    out = {}
    for key, value in batch.items():
        if not (torch.is_tensor(value) and value.dim() == 2 and tuple(value.shape) == (b, s)):
            out[key] = value
            continue
        if key in _CONTINUING:
            tail = value[:, -1:] + steps.to(value.dtype)  # [b, extra]
        elif key in _REPEATED:
            tail = value[:, -1:].expand(b, extra)  # [b, extra]
        else:  # tokens, labels, loss_mask (0: no loss on padding) and anything else
            tail = value.new_zeros(b, extra)
        out[key] = torch.cat([value, tail], dim=1)  # [b, target_length]
    if out.get("cu_seqlens") is not None:
        grown = []
        for bounds in out["cu_seqlens"]:
            bounds = bounds.clone()
            bounds[-1] += extra
            grown.append(bounds)
        out["cu_seqlens"] = grown
    return out
