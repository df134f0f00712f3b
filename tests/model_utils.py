"""Test helpers: tiny configs, full (unsharded) views of sharded params and grads."""
import torch
import torch.distributed as dist

from megatron_cp.model import GPTConfig
from megatron_cp.tensor_parallel import merge_shards


def tiny_config(**overrides):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=120,
                ffn_hidden_size=64, max_position_embeddings=64, hidden_dropout=0.0,
                attention_dropout=0.0, make_vocab_size_divisible_by=32, seed=7)
    base.update(overrides)
    return GPTConfig(**base)


def gather_full(tensor, param, tp_group):
    """The full tensor of a (possibly TP-sharded) param-shaped ``tensor``."""
    if not getattr(param, "tensor_model_parallel", False) or tp_group is None \
            or dist.get_world_size(tp_group) == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=tp_group)
    return merge_shards(parts, param.partition_dim, getattr(param, "partition_stride", 1))


def full_grads(model, tp_group):
    """{name: full gradient}, with sequence-parallel grads summed over TP first."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "sequence_parallel", False) and tp_group is not None:
            dist.all_reduce(g, group=tp_group)
        out[name] = gather_full(g, p, tp_group)
    return out


def full_params(model, tp_group):
    return {name: gather_full(p.data, p, tp_group) for name, p in model.named_parameters()}
