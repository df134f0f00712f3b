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


def qwen3_next_hf_model(folder):
    """A tiny transformers Qwen3NextForCausalLM (3 GDN + 1 gated attention layer, MoE with a
    gated shared expert but one dense layer), moved away from its init, saved to ``folder``."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    config = Qwen3NextConfig(
        vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        partial_rotary_factor=0.5, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=1,
        mlp_only_layers=[1], tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from init: norms not at 1, gates not at 1/2
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    return model
