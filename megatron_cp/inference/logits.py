"""From vocab-parallel logits ``[..., v/tp]`` (padded entries -inf) to what inference needs:
the full real-vocabulary logits, or the argmax without gathering the vocabulary."""
import torch
import torch.distributed as dist

from megatron_cp import tensor_parallel as tpar


def full_vocab_logits(logits, vocab_size, tp_group):
    """``[..., v/tp]`` vocab-parallel logits -> ``[..., vocab_size]``: gathered over TP, the
    padding entries dropped."""
    full = tpar.gather_from_tensor_model_parallel_region(logits, tp_group)  # [..., v_padded]
    return full[..., :vocab_size]


def vocab_parallel_argmax(logits, tp_group):
    """``[..., v/tp]`` vocab-parallel logits -> ``[...]`` int64 indices of the maximum over the
    whole vocabulary, the lowest index among equal maxima (as ``torch.argmax`` of the gathered
    row); only the per-rank maxima travel."""
    values, index = logits.max(dim=-1)  # [...], the first maximum of this rank's slice
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if tp_size == 1:
        return index
    index = index + dist.get_rank(tp_group) * logits.shape[-1]  # global vocabulary ids
    all_values = [torch.empty_like(values) for _ in range(tp_size)]
    all_index = [torch.empty_like(index) for _ in range(tp_size)]
    dist.all_gather(all_values, values.contiguous(), group=tp_group)
    dist.all_gather(all_index, index.contiguous(), group=tp_group)
    best = torch.stack(all_values).max(dim=0, keepdim=True).indices  # [1, ...] lowest rank wins
    return torch.stack(all_index).gather(0, best).squeeze(0)
