"""Multi-head latent attention (MLA, DeepSeek-V2/V3; Megatron-LM's ``MLASelfAttention``).

Per token, keys and values come from one compressed latent c_kv (``--kv-lora-rank``
channels) and one rotary key k_pe (``--qk-pos-emb-head-dim`` channels) shared by every
head; queries from a compressed latent c_q (``--q-lora-rank``) or, without it, straight from
the hidden states::

    c_q  = q_layernorm(x W_q_down)                 (or q = x W_q: linear_q_proj)
    q    = c_q W_q_up        -> per head [q_nope (qk_head_dim) | q_pe (qk_pos_emb_head_dim)]
    [c_kv | k_pe] = x W_kv_down
    kv   = kv_layernorm(c_kv) W_kv_up -> per head [k_nope (qk_head_dim) | v (v_head_dim)]
    q_h  = [q_nope_h | rope(q_pe_h)],  k_h = [k_nope_h | rope(k_pe)]
    out  = softmax(q_h k_h^T * scale) v_h  -> linear_proj

with scale = m^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), m = 0.1 mscale_all_dim
ln(rotary_scaling_factor) + 1 (1 when the factor is <= 1), as Megatron-LM computes it for
either --rope-type. The rotary channels turn in interleaved pairs (2i, 2i + 1): Megatron-LM
de-interleaves them and turns halves, which is the same rotation followed by one fixed
permutation of the channels of both q and k, so every score is the same.

``--qk-layernorm`` (Megatron-LM's MLA): q_layernorm normalises the query latent (or, without
q-LoRA, the hidden states entering linear_q_proj, where Megatron-LM fuses the norm into that
projection) and kv_layernorm the key/value latent.

Tensor parallelism. The down projections are replicated (Megatron-LM's ``duplicated``
TELinear): they are small, and splitting them would need a gather of the latent anyway.
Under sequence parallelism they run on this rank's s/tp tokens, so their gradients (and the
latent norms') are partial sums over tokens: marked ``sequence_parallel``, they are summed
over TP. The up projections are column-parallel over heads (they all-gather the latents'
sequence under SP), linear_proj row-parallel. The shared rotary key feeds this rank's heads
only, so its gradient is a partial sum over heads: under SP it is all-gathered (backward
reduce-scatter), otherwise it passes a copy-to-TP region (backward all-reduce).

Core attention is the one every attention layer uses (``AttentionCore``: local or over the
CP group with any --cp-comm-type, packed documents, attention dropout), with key head dim
qk_head_dim + qk_pos_emb_head_dim and value head dim v_head_dim: the kernels and every CP
exchange take the two dims apart (no padding of V; see context_parallel/kernels.py for what
each device runs when they differ).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar
from megatron_cp.fp8.linear import fp8_linear
from megatron_cp.model.attention import AttentionCore
from megatron_cp.layers.fine_grained_offload import offload_group
from megatron_cp.layers.norms import norm_for
from megatron_cp.layers.rotary import RotaryEmbedding, yarn_mscale
from megatron_cp.resilience.weight_hash import check_replicas_equal


class ReplicatedLinear(torch.nn.Module):
    """y = x W^T with W [out, in] whole on every TP rank (drawn from its own seed, as the
    one-process model draws it). ``sequence_parallel``: the input holds this rank's tokens
    only, so W's gradient is summed over TP. ``fp8_meta``: set by
    :func:`megatron_cp.fp8.attach_fp8` (Megatron-LM's down projections are Transformer
    Engine linears, FP8 under its fp8_autocast like the rest of the layer)."""

    def __init__(self, input_size, output_size, *, init_method, seed, sequence_parallel,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.weight = tpar.drawn_weight((output_size, input_size), init_method, seed,
                                        params_dtype, device)
        self.weight.sequence_parallel = sequence_parallel
        self.fp8_meta = None

    def forward(self, x):
        if self.fp8_meta is not None:
            return fp8_linear(x, self.weight, None, self.fp8_meta)
        return F.linear(x, self.weight)


def mla_softmax_scale(config):
    """Megatron-LM's MLA softmax scale: m^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim) with
    m = yarn_mscale(rotary_scaling_factor, mscale_all_dim) (DeepSeek-V2's YaRN correction)."""
    m = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return m * m / (config.qk_head_dim + config.qk_pos_emb_head_dim) ** 0.5


class MultiLatentAttention(AttentionCore):
    """x [s(/tp with SP), b, h] -> [s(/tp), b, h]; the attention heads split over TP, the
    sequence over CP (see the module docstring)."""

    def __init__(self, config, prefix, tp_group, cp_group, rng_tracker, device=None,
                 hierarchical_cp_groups=None, layer_number=0):
        super().__init__()
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        config.validate_parallel(tp_size, cp_size)
        self.tp_group, self.tp_size = tp_group, tp_size
        nh, h = config.num_attention_heads, config.hidden_size
        self.qk_dim, self.pos_dim, self.v_dim = (config.qk_head_dim, config.qk_pos_emb_head_dim,
                                                 config.v_head_dim)
        self.q_head_dim = self.qk_dim + self.pos_dim
        self.head_dim = self.v_dim  # the width of each head's output (kv_cache.py)
        self.sequence_parallel = config.sequence_parallel and tp_size > 1
        self.build_core(config, cp_group, rng_tracker, nh // tp_size, nh // tp_size,
                        tp_rank * (nh // tp_size), hierarchical_cp_groups, layer_number,
                        mla_softmax_scale(config))
        std, seed = config.hidden_init_std, config.seed

        def column(name, in_size, out_size):
            return tpar.ColumnParallelLinear(
                in_size, out_size, tp_group=tp_group, init_method=tpar.normal_init(std),
                seed=tpar.init_seed(seed, f"{prefix}.{name}"), bias=False,
                sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
                device=device, tp_comm_overlap=tpar.overlap_from_config(config))

        def replicated(name, in_size, out_size):
            return ReplicatedLinear(in_size, out_size, init_method=tpar.normal_init(std),
                                    seed=tpar.init_seed(seed, f"{prefix}.{name}"),
                                    sequence_parallel=self.sequence_parallel,
                                    params_dtype=config.params_dtype, device=device)

        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.linear_q_down_proj = replicated("linear_q_down_proj", h, config.q_lora_rank)
            self.linear_q_up_proj = column("linear_q_up_proj", config.q_lora_rank,
                                           nh * self.q_head_dim)
        else:
            self.linear_q_proj = column("linear_q_proj", h, nh * self.q_head_dim)
        self.linear_kv_down_proj = replicated("linear_kv_down_proj", h,
                                              config.kv_lora_rank + self.pos_dim)
        self.linear_kv_up_proj = column("linear_kv_up_proj", config.kv_lora_rank,
                                        nh * (self.qk_dim + self.v_dim))
        self.linear_proj = tpar.RowParallelLinear(
            nh * self.v_dim, h,
            init_method=tpar.normal_init(tpar.scaled_init_std(std, config.num_layers)),
            seed=tpar.init_seed(seed, prefix + ".linear_proj"), tp_group=tp_group,
            bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype, device=device,
            tp_comm_overlap=tpar.overlap_from_config(config))
        self.q_layernorm = self.kv_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = norm_for(config, config.q_lora_rank if self.q_lora else h, device)
            self.kv_layernorm = norm_for(config, config.kv_lora_rank, device)
            for p in (*self.q_layernorm.parameters(), *self.kv_layernorm.parameters()):
                p.sequence_parallel = self.sequence_parallel  # this rank's tokens only
        # --test-mode: the DP group over which every forward checks the latent norms are equal
        self.replica_check_group = None
        self.rotary = RotaryEmbedding(config, self.pos_dim, yarn=config.rope_type == "yarn",
                                      interleaved=True)

    def _check_norms(self, device):
        norms = [(f"{n}.{w}", p) for n, m in (("q_layernorm", self.q_layernorm),
                                               ("kv_layernorm", self.kv_layernorm))
                 for w, p in m.named_parameters()]
        check_replicas_equal(norms, self.replica_check_group, device,
                             f"layer {self.layer_number} attention")

    def latents(self, x):
        """x [s(/tp), b, h] -> (q_in [s(/tp), b, q_lora_rank or h]: the normalised input of
        the query up projection, c_kv [s(/tp), b, kv_lora_rank] normalised, k_pe [s(/tp), b,
        qk_pos_emb_head_dim] not yet rotated): everything the down projections make."""
        if self.q_layernorm is not None and self.replica_check_group is not None:
            self._check_norms(x.device)
        q_in = self.linear_q_down_proj(x) if self.q_lora else x  # [s(/tp), b, q_lora]
        if self.q_layernorm is not None:
            q_in = self.q_layernorm(q_in)
        kv = self.linear_kv_down_proj(x)  # [s(/tp), b, kv_lora + pos]
        c_kv, k_pe = kv.split([kv.shape[-1] - self.pos_dim, self.pos_dim], dim=-1)
        if self.kv_layernorm is not None:
            c_kv = self.kv_layernorm(c_kv)
        return q_in, c_kv, k_pe

    def queries(self, q_in, cos, sin):
        """q_in (see :meth:`latents`) -> q [s, b, nh/tp, qk_head_dim + pos], rotated."""
        up = self.linear_q_up_proj if self.q_lora else self.linear_q_proj
        q = up(q_in)  # [s, b, nh/tp * q_head_dim]
        q = q.view(q.shape[0], q.shape[1], self.local_heads, self.q_head_dim)
        q_nope, q_pe = q.split([self.qk_dim, self.pos_dim], dim=-1)
        return torch.cat([q_nope, self.rotary.rotate(q_pe, cos, sin)], dim=-1)

    def keys_values(self, c_kv, k_pe):
        """c_kv [s, b, kv_lora_rank] (its tokens: whole sequence, or s/tp under SP: the up
        projection gathers them) and the ROTATED shared key k_pe [s, b, 1, pos] (whole
        sequence) -> k [s, b, nh/tp, qk_head_dim + pos], v [s, b, nh/tp, v_head_dim]."""
        kv = self.linear_kv_up_proj(c_kv)  # [s, b, nh/tp * (qk + v)]
        s, b = kv.shape[0], kv.shape[1]
        kv = kv.view(s, b, self.local_heads, self.qk_dim + self.v_dim)
        k_nope, v = kv.split([self.qk_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(s, b, self.local_heads, self.pos_dim)], dim=-1)
        return k, v

    def shared_key(self, k_pe):
        """This rank's k_pe [s(/tp), b, pos] -> the whole sequence's [s, b, 1, pos], with the
        gradient summed over the TP ranks' heads (see the module docstring)."""
        if self.sequence_parallel:
            k_pe = tpar.gather_from_sequence_parallel_region(k_pe, self.tp_group)  # [s, b, pos]
        else:
            k_pe = tpar.copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        return k_pe.unsqueeze(2)  # [s, b, 1, pos]

    def query_key_value(self, x, position_ids):
        """x [s(/tp), b, h] -> q, k [s, b, nh/tp, qk_head_dim + pos], v [s, b, nh/tp,
        v_head_dim], gate None (SelfAttention's signature), rotated by ``position_ids``
        [b, s]."""
        q, k, v, _ = self._query_key_value(x, position_ids)
        return q, k, v, None

    def _query_key_value(self, x, position_ids):
        """:meth:`query_key_value`, and the DiscardedOutput of the up projections and rotary
        with --recompute-modules mla_up_proj in training (else None)."""
        with offload_group(self.offload, "qkv_linear"):  # the down projections
            q_in, c_kv, k_pe = self.latents(x)
        cos, sin = self.rotary.cos_sin(position_ids)  # [s, b, 1, pos/2]
        if self.training and self.config.recomputes("mla_up_proj"):
            rebuild = tpar.DiscardedOutput(self._up_and_rotary)
            q, k, v = rebuild(q_in, c_kv, k_pe, cos, sin)
            return q, k, v, rebuild
        q, k, v = self._up_and_rotary(q_in, c_kv, k_pe, cos, sin, contiguous=False)
        return q, k, v, None

    def _up_and_rotary(self, q_in, c_kv, k_pe, cos, sin, contiguous=True):
        """The latents (see :meth:`latents`) -> q, k, v (see :meth:`query_key_value`), each
        made contiguous when its storage is to be discarded and refilled."""
        k_pe = self.rotary.rotate(self.shared_key(k_pe), cos, sin)  # [s, b, 1, pos]
        k, v = self.keys_values(c_kv, k_pe)
        q = self.queries(q_in, cos, sin)
        return (q.contiguous(), k.contiguous(), v.contiguous()) if contiguous else (q, k, v)

    def forward(self, x, position_ids, token_index=None, document_ids=None, dropout_ids=None,
                layout=None):
        """x [s/tp with SP else s, b, h] -> same shape."""
        q, k, v, rebuild = self._query_key_value(x, position_ids)
        s, b = q.shape[0], q.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, nh/tp, s, d]
        out = self.attend(q, k, v, token_index, document_ids, dropout_ids,
                          layout)  # [b, nh/tp, s, dv]
        if rebuild is not None:  # q, k, v come back when backward reaches the core output
            rebuild.discard_after(out)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.v_dim)
        return self.output_projection(out)  # [s(/tp), b, h]

    def project_out(self, out, gate=None):
        """The attention output [s, b, nh/tp * v_head_dim] through linear_proj (the
        generation cache's call; MLA has no output gate)."""
        return self.linear_proj(out)
