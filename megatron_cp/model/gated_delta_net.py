"""The Gated DeltaNet token mixer (Megatron-LM's ``GatedDeltaNet``, Qwen3-Next's linear
attention): a layer's ``self_attention`` where ``--linear-attention-freq`` marks it.

    x -> in_proj -> q, k, v, z, b, a
      -> causal depthwise conv1d + SiLU over [q | k | v]   (document restarts)
      -> l2norm(q), l2norm(k); beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)
      -> gated delta rule (fp32 state per value head; layers/gated_delta_rule.py)
      -> out_norm(o) * silu(z) per value head -> out_proj

Parameters, as Megatron-LM names and shapes them (no biases, whatever --disable-bias-linear
says, as in Megatron-LM): ``in_proj.weight`` [2 nk dk + 2 nv dv + 2 nv, h],
``conv1d.weight`` [2 nk dk + nv dv, 1, w], ``A_log`` and ``dt_bias`` [nv], ``out_norm``
over dv (the config's norm kind, zero-centred with --apply-layernorm-1p), ``out_proj.weight``
[h, nv dv]. The rows of in_proj and the channels of conv1d are grouped per KEY head, as this
codebase groups QKV per query group: key head j owns [q_j | k_j | v | z | b | a] of its
r = nv/nk value heads (conv1d: [q_j | k_j | v]). A contiguous TP split then hands each rank
whole key heads with their value heads, so TP needs nk % TP == 0 (Megatron-LM's rule too);
Megatron-LM's own order ([q | k | v | z | b | a] over all heads) is a row permutation,
applied by converters. Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` use the per-key-head
grouping of this layout.

Init (each full weight from its own seed, then split: identical under every layout):
in_proj N(0, std), out_proj N(0, std / sqrt(2 L)), conv1d U(-1/sqrt(w), 1/sqrt(w))
(nn.Conv1d's default, Megatron-LM's with no conv init), dt_bias 1, A_log log U(1, 16).

Under context parallelism the layer hands its in_proj rows to
context_parallel/gated_delta.py (head all-to-all, or conv-tail and state passing, by
--cp-comm-type), which calls back :meth:`mix` or the pieces it is made of.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar
from megatron_cp.context_parallel.gated_delta import GatedDeltaContextParallel
from megatron_cp.layers.norms import norm_for
from megatron_cp.layers.gated_delta_rule import (causal_conv1d, chunk_gated_delta_rule, l2norm,
                                                 fla_packed_rows, recurrent_gated_delta_rule)


def _uniform_init(low, high):
    """init_method(tensor, generator): U(low, high) drawn from ``generator``."""
    def init(tensor, generator):
        with torch.no_grad():
            tensor.uniform_(low, high, generator=generator)
    return init


def _split_param(shape, init_method, seed, tp_size, tp_rank, dtype, device):
    """A dim-0 TP-split parameter whose full tensor is drawn from ``seed`` (then this rank's
    contiguous chunk)."""
    param = tpar.drawn_weight(shape, init_method, seed, dtype, device, tp_size=tp_size,
                              tp_rank=tp_rank)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
    return param


class GatedDeltaNet(torch.nn.Module):
    """x [s(/tp with SP), b, h] -> [s(/tp), b, h]; heads split over TP. The forward takes
    the attention's arguments (positions are unused: the conv and recurrence are causal by
    construction); ``document_ids`` [b, s] restart conv and state at document boundaries."""

    def __init__(self, config, prefix, tp_group, device=None, cp_group=None,
                 hierarchical_groups=None, layer_number=0):
        super().__init__()
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        config.validate_parallel(tp_size, cp_size)
        self.cp_size = cp_size  # as SelfAttention's: generation checks it of either mixer
        self.context_parallel = None if cp_size == 1 else GatedDeltaContextParallel(
            cp_group, config.gdn_cp_comm_type(tp_size, cp_size, layer_number),
            hierarchical_groups)
        self.config = config
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv, w = config.linear_key_head_dim, config.linear_value_head_dim, \
            config.linear_conv_kernel_dim
        self.dk, self.dv, self.ratio = dk, dv, nv // nk
        self.local_key_heads, self.local_value_heads = nk // tp_size, nv // tp_size
        # rows of one key head in in_proj: q, k, then its r value heads' v, z, b, a
        self.group_rows = (dk, dk, self.ratio * dv, self.ratio * dv, self.ratio, self.ratio)
        conv_channels = nk * (2 * dk + self.ratio * dv)
        std = config.hidden_init_std
        common = dict(tp_group=tp_group, bias=False, sequence_parallel=config.sequence_parallel,
                      tp_comm_overlap=tpar.overlap_from_config(config),
                      params_dtype=config.params_dtype, device=device)
        self.in_proj = tpar.ColumnParallelLinear(
            config.hidden_size, nk * sum(self.group_rows), init_method=tpar.normal_init(std),
            seed=tpar.init_seed(config.seed, prefix + ".in_proj"), **common)
        self.conv1d = torch.nn.Module()  # Megatron-LM's nn.Conv1d: only its weight is used
        self.conv1d.weight = _split_param(
            (conv_channels, 1, w), _uniform_init(-w ** -0.5, w ** -0.5),
            tpar.init_seed(config.seed, prefix + ".conv1d.weight"), tp_size, tp_rank,
            config.params_dtype, device)
        self.A_log = _split_param(
            (nv,), lambda t, gen: t.copy_(torch.empty(nv).uniform_(1, 16, generator=gen).log()),
            tpar.init_seed(config.seed, prefix + ".A_log"), tp_size, tp_rank,
            config.params_dtype, device)
        self.dt_bias = _split_param((nv,), lambda t, gen: t.fill_(1.0), 0, tp_size, tp_rank,
                                    config.params_dtype, device)
        self.out_norm = norm_for(config, dv, device)
        for p in self.out_norm.parameters():
            p.sequence_parallel = tp_size > 1  # heads differ per TP rank: sum over TP
        self.out_proj = tpar.RowParallelLinear(
            nv * dv, config.hidden_size,
            init_method=tpar.normal_init(tpar.scaled_init_std(std, config.num_layers)),
            seed=tpar.init_seed(config.seed, prefix + ".out_proj"), **common)

    def project(self, x):
        """x [s(/tp), b, h] -> in_proj rows per local key head [b, s, nk/tp, rows] (what a
        context-parallel all-to-all moves: whole key heads with their value heads)."""
        proj = self.in_proj(x).transpose(0, 1)  # [b, s, nk/tp * group rows]
        return proj.reshape(proj.shape[0], proj.shape[1], self.local_key_heads, -1)

    def split(self, proj):
        """proj [b, s, n_k, rows] (n_k key heads) -> mixed [b, s, n_k (2 dk + r dv)] (conv
        input: per key head [q | k | v]), z [b, s, r n_k, dv], b and a [b, s, r n_k]."""
        bsz, s, heads = proj.shape[:3]
        q, k, v, z, b, a = proj.split(self.group_rows, dim=-1)  # each [b, s, n_k, rows]
        mixed = torch.cat([q, k, v], dim=-1).reshape(bsz, s, -1)  # [b, s, channels]
        return (mixed, z.reshape(bsz, s, heads * self.ratio, self.dv),
                b.reshape(bsz, s, -1), a.reshape(bsz, s, -1))

    def conv(self, mixed, first_key_head=0, document_ids=None, initial_tail=None):
        """The causal conv + SiLU of ``mixed`` [b, s, n_k channels] whose key heads start at
        local key head ``first_key_head`` -> (y [b, s, channels], tail [b, channels, w-1])."""
        per_head = 2 * self.dk + self.ratio * self.dv
        start = first_key_head * per_head
        weight = self.conv1d.weight[start:start + mixed.shape[-1]]  # [channels, 1, w]
        return causal_conv1d(mixed, weight, initial_tail=initial_tail, document_ids=document_ids)

    def kernel_inputs(self, mixed):
        """Conv output [b, s, n_k channels] -> q, k [b, s, r n_k, dk] (unit norm, each key
        head repeated for its value heads), v [b, s, r n_k, dv]."""
        bsz, s = mixed.shape[0], mixed.shape[1]
        mixed = mixed.reshape(bsz, s, -1, 2 * self.dk + self.ratio * self.dv)  # [b, s, n_k, .]
        q, k, v = mixed.split((self.dk, self.dk, self.ratio * self.dv), dim=-1)
        q, k = (l2norm(t.float()).repeat_interleave(self.ratio, dim=2) for t in (q, k))
        return q, k, v.reshape(bsz, s, -1, self.dv)

    def gates(self, b, a, first_key_head=0):
        """beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (fp32), each
        [b, s, r n_k], for the value heads of the key heads from ``first_key_head``."""
        start = first_key_head * self.ratio
        heads = slice(start, start + a.shape[-1])
        g = -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads].float())
        return g, torch.sigmoid(b.float())

    def gate_output(self, o, z):
        """o [b, s, n_v, dv] -> out_norm(o) * silu(z), in z's dtype [b, s, n_v, dv]."""
        return (self.out_norm(o) * F.silu(z.float())).to(z.dtype)

    def mix(self, proj, document_ids=None, first_key_head=0, packed_rows=None):
        """The whole sequence in token order: proj [b, s, n_k, rows] -> gated output
        [b, s, r n_k, dv] (conv and state restart at every document of ``document_ids``;
        ``packed_rows``: see :meth:`prepare_layout`)."""
        return self._mix(proj, document_ids, first_key_head, packed_rows=packed_rows)[0]

    def prepare_layout(self, layout, length, device):
        """Work out in the microbatch's SequenceLayout what this layer needs of the documents
        before any layer runs: without CP, FLA's packed rows (``packed_cu_seqlens`` of the
        document ids, on the device and on the host; made only where FLA runs); under
        CP, what its CP path looks up (context_parallel/gated_delta.py). No layer then waits
        on the device for them."""
        if self.context_parallel is not None:
            batch = (layout.token_index if layout.document_ids is None
                     else layout.document_ids).shape[0]
            self.context_parallel.prepare(layout, batch, length, device,
                                          self.in_proj.weight.dtype)
        else:
            fla_packed_rows(layout, layout.document_ids, self.in_proj.weight.dtype)

    def _mix(self, proj, document_ids=None, first_key_head=0, conv_tail=None, state=None,
             output_final_state=False, packed_rows=None):
        """:meth:`mix` continuing ``conv_tail`` [b, channels, w-1] and the fp32 ``state``
        [b, r n_k, dk, dv] (None: a fresh start) -> (gated output, tail, state or None)."""
        mixed, z, b, a = self.split(proj)
        mixed, tail = self.conv(mixed, first_key_head, document_ids, conv_tail)
        q, k, v = self.kernel_inputs(mixed)
        g, beta = self.gates(b, a, first_key_head)
        if proj.shape[1] == 1 and state is not None:  # one decode step: the recurrence itself
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state, output_final_state)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                              output_final_state=output_final_state,
                                              document_ids=document_ids, packed_rows=packed_rows)
        return self.gate_output(o, z), tail, state

    def continue_sequence(self, x, conv_tail=None, state=None):
        """Inference on new tokens x [s, b, h] that continue a sequence whose conv tail
        [b, channels/tp, w-1] (its last w-1 conv inputs) and fp32 recurrent state
        [b, nv/tp, dk, dv] are given (None: the sequence starts here; no SP or CP).
        Returns (out [s, b, h], the tail and the state after the new tokens)."""
        y, tail, state = self._mix(self.project(x), conv_tail=conv_tail, state=state,
                                   output_final_state=True)  # y [b, s, nv/tp, dv]
        return self.out_proj(y.flatten(2).transpose(0, 1)), tail, state  # [s, b, h]

    def forward(self, x, position_ids=None, token_index=None, document_ids=None,
                dropout_ids=None, layout=None):
        proj = self.project(x)  # [b, s(/cp), nk/tp, rows]
        if self.context_parallel is None:
            rows = None if layout is None else \
                fla_packed_rows(layout, document_ids, proj.dtype)
            y = self.mix(proj, document_ids, packed_rows=rows)
        else:
            y = self.context_parallel(self, proj, token_index, document_ids, layout)
        y = y.flatten(2).transpose(0, 1)  # [s(/cp), b, nv/tp * dv]
        return self.out_proj(y)
