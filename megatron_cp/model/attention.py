"""Self-attention: QKV column-parallel projection, RoPE, core attention, row-parallel output.

Heads are split over TP first (each rank holds num_query_groups/TP groups of heads); the
core attention then runs locally or, with context parallelism, through
``megatron_cp.context_parallel`` over the CP group. Packed documents are handled by
``token_index`` (each token's index in the unsplit sample: causality) and ``document_ids``
(attention stays inside a document).
"""
import torch
import torch.distributed as dist

from megatron_cp import tensor_parallel as tpar
from megatron_cp.context_parallel import (ContextParallelAttention, attention_kernel,
                                          local_attention)
from megatron_cp.model.rotary import rotary_cos_sin, rotate


class SelfAttention(torch.nn.Module):
    """Multi-head / grouped-query self-attention over the TP (and CP) groups.

    The fused QKV weight is laid out per query group: [q heads of the group | k | v], so a
    contiguous TP split hands each rank whole groups.
    """

    def __init__(self, config, prefix, tp_group, cp_group, rng_tracker, device=None,
                 hierarchical_cp_groups=None):
        super().__init__()
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.config, self.tp_group, self.cp_group, self.rng_tracker = config, tp_group, cp_group, rng_tracker
        self.cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        config.validate_parallel(tp_size, self.cp_size)
        d, nh, ng = config.kv_channels, config.num_attention_heads, config.num_query_groups
        self.head_dim, self.heads_per_group = d, nh // ng
        self.local_groups = ng // tp_size
        self.local_heads = nh // tp_size
        std = config.init_method_std
        common = dict(tp_group=tp_group, bias=config.add_bias_linear,
                      sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype, device=device)
        self.linear_qkv = tpar.ColumnParallelLinear(
            config.hidden_size, (nh + 2 * ng) * d, init_method=tpar.normal_init(std),
            seed=tpar.init_seed(config.seed, prefix + ".linear_qkv"), **common)
        # rows of one query group: its q heads, k, v (Muon orthogonalises Q, K and V apart)
        self.linear_qkv.weight.qkv_split_shapes = (self.heads_per_group * d, d, d)
        self.linear_proj = tpar.RowParallelLinear(
            nh * d, config.hidden_size,
            init_method=tpar.normal_init(tpar.scaled_init_std(std, config.num_layers)),
            seed=tpar.init_seed(config.seed, prefix + ".linear_proj"), **common)
        self.rotary_dim = int(d * config.rotary_percent)
        # chosen once per layer: "auto" (the device's fused kernels) or "torch" (plain PyTorch)
        self.attention_kernel = attention_kernel(config.attention_kernel)
        self.cp_attention = None  # built once: the comm type and head plan are checked here
        if self.cp_size > 1:
            self.cp_attention = ContextParallelAttention(
                cp_group, config.cp_comm_type, self.local_heads, self.local_groups,
                hierarchical_cp_groups, config.allow_dummy_heads, kernel=self.attention_kernel)

    def core_attention(self, q, k, v, token_index, document_ids):
        """q [b, nh/tp, s, d], k/v [b, ng/tp, s, d] -> [b, nh/tp, s, d]."""
        dropout = self.config.attention_dropout if self.training else 0.0
        if self.cp_attention is not None:
            return self.cp_attention(q, k, v, token_index, document_ids)
        if dropout > 0.0:
            with self.rng_tracker.fork():  # heads differ across TP ranks: so do their masks
                return local_attention(q, k, v, token_index, document_ids, dropout_p=dropout,
                                       kernel=self.attention_kernel)
        return local_attention(q, k, v, token_index, document_ids, kernel=self.attention_kernel)

    def forward(self, x, position_ids, token_index=None, document_ids=None):
        """x [s/tp with SP else s, b, h] -> same shape."""
        qkv = self.linear_qkv(x)  # [s, b, ng/tp * (hpg + 2) * d]
        s, b = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :self.heads_per_group].reshape(s, b, self.local_heads, self.head_dim)
        k = qkv[:, :, :, self.heads_per_group]  # [s, b, ng/tp, d]
        v = qkv[:, :, :, self.heads_per_group + 1]
        if self.config.position_embedding_type == "rope":
            cos, sin = rotary_cos_sin(position_ids, self.rotary_dim, self.config.rotary_base)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # one cos/sin for both
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if self.config.recompute_granularity == "selective":
            out = tpar.checkpoint(self.core_attention, self.rng_tracker, q, k, v, token_index,
                                  document_ids)
        else:
            out = self.core_attention(q, k, v, token_index, document_ids)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)  # [s, b, nh/tp*d]
        return self.linear_proj(out)
