"""Self-attention: QKV column-parallel projection, QK norms, rotary, core attention,
row-parallel output.

Heads are split over TP first (each rank holds num_query_groups/TP groups of heads); the
core attention then runs locally or, with context parallelism, through
``megatron_cp.context_parallel`` over the CP group. Packed documents are handled by
``token_index`` (each token's index in the unsplit sample: causality) and ``document_ids``
(attention stays inside a document). Attention dropout (training) draws its mask from where
each element sits in the run (``DropoutIds``, the layer, the global head), so it is the same
under every layout (context_parallel/dropout.py).
"""
import torch
import torch.distributed as dist

from megatron_cp import tensor_parallel as tpar
from megatron_cp.config.parallel import resolve_comm_type
from megatron_cp.context_parallel import (AttentionDropout, ContextParallelAttention,
                                          attention_kernel, dropout_key, local_attention)
from megatron_cp.layers.fine_grained_offload import offload_group
from megatron_cp.layers.norms import norm_for
from megatron_cp.layers.hidden_dropout import DropoutIds, fresh_samples
from megatron_cp.layers.rotary import RotaryEmbedding
from megatron_cp.resilience.weight_hash import check_replicas_equal


class AttentionCore(torch.nn.Module):
    """What every softmax-attention layer shares after its projections: the core attention
    (local, or over the CP group with the layer's comm type), attention dropout drawn
    from each element's place in the run, and the kernel choice. A layer calls
    :meth:`build_core` once its head counts are known; MLA passes its own softmax scale and
    its key and value head dims may differ."""
    offload = None  # the block's FineGrainedOffload, with --fine-grained-activation-offloading

    def build_core(self, config, cp_group, rng_tracker, local_heads, local_kv_heads, first_head,
                   hierarchical_cp_groups=None, layer_number=0, softmax_scale=None,
                   dynamic_cp_groups=None):
        self.config, self.cp_group, self.rng_tracker = config, cp_group, rng_tracker
        self.local_heads, self.first_head = local_heads, first_head
        self.layer_number, self.softmax_scale = layer_number, softmax_scale
        self.dropout_key = dropout_key(config.seed, layer_number)
        self.cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        # chosen once per layer: "auto" (the device's fused kernels) or "torch" (plain PyTorch)
        self.attention_kernel = attention_kernel(config.attention_kernel)
        self.cp_attention = None  # built once: the comm type and head plan are checked here
        if self.cp_size > 1:
            self.cp_attention = ContextParallelAttention(
                cp_group, config.layer_cp_comm_type(layer_number), local_heads, local_kv_heads,
                hierarchical_cp_groups, config.allow_dummy_heads, softmax_scale,
                kernel=self.attention_kernel)
        # dynamic CP (ParallelState.dynamic_cp_groups): one attention per group size, each
        # checked now; use_cp_size picks the one of the microbatch about to run
        self.cp_attentions = {}
        comm_type = config.layer_cp_comm_type(layer_number)
        for size, group in (dynamic_cp_groups or {}).items():
            if size > 1 and resolve_comm_type(comm_type, local_kv_heads, size)[0] == "a2a+p2p":
                raise ValueError(f"dynamic context parallelism runs --cp-comm-type p2p, a2a or "
                                 f"all_gather on its groups of every size; {comm_type!r} gives "
                                 f"a2a+p2p on {size} ranks: pick one of those")
            self.cp_attentions[size] = None if size == 1 else ContextParallelAttention(
                group, comm_type, local_heads, local_kv_heads, None, config.allow_dummy_heads,
                softmax_scale, kernel=self.attention_kernel)

    def use_cp_size(self, size):
        """Dynamic CP: run the next microbatches on this rank's CP group of ``size`` ranks."""
        self.cp_attention, self.cp_size = self.cp_attentions[size], size

    def _dropout(self, q, ids):
        """This call's AttentionDropout: None in eval mode or with attention_dropout 0."""
        p = self.config.attention_dropout
        if not self.training or p == 0.0:
            return None
        if ids is None:
            ids = DropoutIds(None, None)
        samples = fresh_samples(q.shape[0], q.device) if ids.samples is None else ids.samples
        heads = torch.arange(self.local_heads, device=q.device) + self.first_head  # [nh/tp]
        return AttentionDropout(p, self.dropout_key, samples, heads, ids.positions)

    def prepare_layout(self, layout, length, device):
        """Work out in the microbatch's SequenceLayout (context_parallel/layout.py) what this
        layer's core attention will look up, for ``length`` local tokens: called for every
        layer before the first one runs, so no layer reads the metadata on the host."""
        layout.prepare(self.cp_attention, length, device)

    def core_attention(self, q, k, v, token_index, document_ids, dropout_ids=None, layout=None):
        """q [b, nh/tp, s, dk], k [b, nkv/tp, s, dk], v [b, nkv/tp, s, dv] -> [b, nh/tp, s, dv];
        ``dropout_ids``: a DropoutIds or None; ``layout``: the microbatch's SequenceLayout
        or None (planned in this call)."""
        dropout = self._dropout(q, dropout_ids)
        if self.cp_attention is not None:
            return self.cp_attention(q, k, v, token_index, document_ids, dropout, layout)
        return local_attention(q, k, v, token_index, document_ids, self.softmax_scale,
                               kernel=self.attention_kernel, dropout=dropout, layout=layout)

    def attend(self, q, k, v, token_index, document_ids, dropout_ids, layout=None):
        """:meth:`core_attention`, checkpointed in training with --recompute-granularity
        selective when --recompute-modules holds core_attn (its default)."""
        with offload_group(self.offload, "core_attn"):
            if self.training and self.config.recomputes("core_attn"):
                return tpar.checkpoint(self.core_attention, self.rng_tracker, q, k, v,
                                       token_index, document_ids, dropout_ids, layout)
            return self.core_attention(q, k, v, token_index, document_ids, dropout_ids, layout)

    def output_projection(self, out):
        """linear_proj of the attention output (fine-grained offloading's attn_proj)."""
        with offload_group(self.offload, "attn_proj"):
            return self.linear_proj(out)


def use_cp_size(model, size):
    """Dynamic CP: every attention of ``model`` runs the next microbatch on this rank's CP
    group of ``size`` ranks (ParallelState.dynamic_cp_groups)."""
    for module in model.modules():
        if getattr(module, "cp_attentions", None):
            module.use_cp_size(size)


class SelfAttention(AttentionCore):
    """Multi-head / grouped-query self-attention over the TP (and CP) groups.

    The fused QKV weight is laid out per query group: [q heads of the group | k | v], so a
    contiguous TP split hands each rank whole groups. ``--attention-output-gate`` adds the
    group's gate heads after its q heads, Megatron-LM's [q | gate | k | v]; the attention
    output is multiplied by sigmoid(gate) (in fp32) before the output projection.

    ``--qk-layernorm`` (Megatron-LM's ``q_layernorm`` / ``k_layernorm``): the config's norm
    over each head's ``head_dim`` channels of q and of k, one weight shared by every head,
    after the projection and before rotary. Each TP rank normalises its own heads with the
    replicated weight, so its gradient is a partial sum over heads: marked
    ``sequence_parallel``, it is summed over TP like the sequence-parallel norms' (with or
    without SP).
    """

    def __init__(self, config, prefix, tp_group, cp_group, rng_tracker, device=None,
                 hierarchical_cp_groups=None, layer_number=0, dynamic_cp_groups=None):
        super().__init__()
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_group = tp_group
        cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        config.validate_parallel(tp_size, cp_size)
        d, nh, ng = config.kv_channels, config.num_attention_heads, config.num_query_groups
        self.head_dim, self.heads_per_group = d, nh // ng
        self.local_groups = ng // tp_size
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        # the global index of local head 0 is tp_rank * nh/tp
        self.build_core(config, cp_group, rng_tracker, nh // tp_size, self.local_groups,
                        tp_rank * (nh // tp_size), hierarchical_cp_groups, layer_number,
                        config.softmax_scale,  # None: 1 / sqrt(d); muP sets its own
                        dynamic_cp_groups=dynamic_cp_groups)
        std = config.hidden_init_std
        common = dict(tp_group=tp_group, bias=config.add_bias_linear,
                      sequence_parallel=config.sequence_parallel,
                      tp_comm_overlap=tpar.overlap_from_config(config),
                      params_dtype=config.params_dtype, device=device)
        self.gated = config.attention_output_gate
        q_rows = self.heads_per_group * d * (2 if self.gated else 1)  # q (and gate) heads
        self.linear_qkv = tpar.ColumnParallelLinear(
            config.hidden_size, ng * (q_rows + 2 * d), init_method=tpar.normal_init(std),
            seed=tpar.init_seed(config.seed, prefix + ".linear_qkv"), **common)
        # rows of one query group: its q heads, (gate heads,) k, v (Muon orthogonalises each
        # apart)
        self.linear_qkv.weight.qkv_split_shapes = \
            (self.heads_per_group * d,) * (2 if self.gated else 1) + (d, d)
        self.linear_proj = tpar.RowParallelLinear(
            nh * d, config.hidden_size,
            init_method=tpar.normal_init(tpar.scaled_init_std(std, config.num_layers)),
            seed=tpar.init_seed(config.seed, prefix + ".linear_proj"), **common)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = norm_for(config, d, device)  # over each head's d channels
            self.k_layernorm = norm_for(config, d, device)
            for p in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                p.sequence_parallel = tp_size > 1  # heads differ per TP rank: sum over TP
        # --test-mode: the DP group over which every forward checks the QK norms are equal
        # (Megatron-LM's realtime test; set by the trainer, which holds the DP group)
        self.replica_check_group = None
        self.rotary = None
        if config.position_embedding_type in ("rope", "yarn"):
            self.rotary = RotaryEmbedding(config, d)

    def query_key_value(self, x, position_ids):
        """x [s(/tp), b, h] -> q [s, b, nh/tp, d], k and v [s, b, ng/tp, d], gate [s, b,
        nh/tp * d] or None: projected, q and k normalised (--qk-layernorm) and rotated by
        ``position_ids`` [b, s]."""
        with offload_group(self.offload, "qkv_linear"):
            qkv = self.linear_qkv(x)  # [s, b, ng/tp * (hpg (x2 gated) + 2) * d]
        s, b = qkv.shape[0], qkv.shape[1]
        hpg, q_heads = self.heads_per_group, self.heads_per_group * (2 if self.gated else 1)
        qkv = qkv.view(s, b, self.local_groups, q_heads + 2, self.head_dim)
        q = qkv[:, :, :, :hpg].reshape(s, b, self.local_heads, self.head_dim)
        gate = qkv[:, :, :, hpg:q_heads].reshape(s, b, -1) if self.gated else None  # [s, b, nh/tp*d]
        k = qkv[:, :, :, q_heads]  # [s, b, ng/tp, d]
        v = qkv[:, :, :, q_heads + 1]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
            if self.replica_check_group is not None:
                norms = [(f"{n}.{w}", p) for n, m in (("q_layernorm", self.q_layernorm),
                                                       ("k_layernorm", self.k_layernorm))
                         for w, p in m.named_parameters()]
                check_replicas_equal(norms, self.replica_check_group, q.device,
                                     f"layer {self.layer_number} attention")
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(position_ids)  # one cos/sin for q and k
            q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        return q, k, v, gate

    def forward(self, x, position_ids, token_index=None, document_ids=None, dropout_ids=None,
                layout=None):
        """x [s/tp with SP else s, b, h] -> same shape; ``layout``: the microbatch's
        SequenceLayout (None: the attention plans from the metadata itself)."""
        q, k, v, gate = self.query_key_value(x, position_ids)
        s, b = q.shape[0], q.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        out = self.attend(q, k, v, token_index, document_ids, dropout_ids, layout)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)  # [s, b, nh/tp*d]
        return self.project_out(out, gate)

    def project_out(self, out, gate):
        """The attention output [s, b, nh/tp*d], gated by sigmoid(gate) (fp32) when
        --attention-output-gate gives one, through the output projection -> [s(/tp), b, h]."""
        if gate is not None:
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        return self.output_projection(out)
