"""The MoE layer that replaces a transformer layer's MLP: router -> dispatcher -> grouped
experts -> combine, plus optional shared experts.

Input and output are the dense MLP's ``[s(/tp with SP), b, h]``. Inside, the tokens are
flattened to ``[T, h]`` (row ``t = i * b + j`` is position ``i`` of sequence ``j``). TP ranks
without sequence parallelism hold the same tokens, so each takes a contiguous share of them
and the shares are gathered after: every rank of the TP x CP group then routes distinct
tokens of the microbatch (the group the balancing losses sum over), which is also what
sequence parallelism gives. The router's input jitter (training) is keyed by each token's
global coordinates (layers/hidden_dropout.py), so every layout jitters the same tokens alike.
The expert mesh (EDP x EP x ETP inside a pipeline stage) comes
from the ParallelState: experts are split over EP, their hidden size over ETP.
"""
import torch
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar
from megatron_cp.layers.hidden_dropout import (SITE_JITTER, sequence_shard, site_key,
                                               token_coordinates, token_states)
from megatron_cp.layers.mlp import MLP
from megatron_cp.moe import comm
from megatron_cp.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from megatron_cp.moe.experts import GroupedExperts
from megatron_cp.moe.router import TopKRouter


def _group(state, name):
    return state.group(name) if state is not None and state.size(name) > 1 else None


def _size_rank(state, name):
    return (state.size(name), state.rank(name)) if state is not None else (1, 0)


class MoELayer(torch.nn.Module):
    """x [s(/tp), b, h] (+ loss_mask [b, s] of this CP rank, and for the input jitter the
    Coordinates of x and the layer number) -> [s(/tp), b, h]."""

    def __init__(self, config, prefix, state, rng_tracker, device=None):
        super().__init__()
        self.config, self.rng_tracker = config, rng_tracker
        self.tp_size, self.tp_rank = _size_rank(state, "tp")
        self.tp_group = _group(state, "tp")
        self.sequence_parallel = config.sequence_parallel and self.tp_size > 1
        ep_size, ep_rank = _size_rank(state, "ep")
        etp_size, etp_rank = _size_rank(state, "etp")
        config.validate_experts(ep_size, etp_size)
        self.router = TopKRouter(config, prefix + ".router", [_group(state, "tp_cp")],
                                 _group(state, "dp"), rng_tracker, self.tp_size, device)
        dp_size, dp_rank = _size_rank(state, "dp")  # the microbatch classes (fp8/grouped.py)
        self.experts = GroupedExperts(config, prefix + ".experts", ep_rank, ep_size, etp_rank,
                                      etp_size, device, fp8_groups=(_group(state, "edp"),
                                                                    _group(state, "etp")),
                                      num_classes=dp_size)
        if config.moe_token_dispatcher_type in ("alltoall", "flex"):  # flex: the same exchange
            self.dispatcher = AllToAllDispatcher(config.num_moe_experts, _group(state, "ep"),
                                                 ep_size, _group(state, "etp"), etp_size,
                                                 dp_rank, config.router_pad_multiple(),
                                                 piece=self.tp_rank)
        else:
            self.dispatcher = AllGatherDispatcher(config.num_moe_experts, ep_rank, ep_size,
                                                  _group(state, "ep_etp"), ep_size * etp_size,
                                                  dp_rank, piece=self.tp_rank)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = MLP(config, prefix + ".shared_experts", self.tp_group, device,
                                      ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            if config.moe_shared_expert_gate:
                self.shared_experts.gate_weight = tpar.drawn_weight(
                    (1, config.hidden_size), tpar.normal_init(config.hidden_init_std),
                    tpar.init_seed(config.seed, prefix + ".shared_experts.gate_weight"),
                    config.params_dtype, device)
                self.shared_experts.gate_weight.sequence_parallel = self.sequence_parallel

    def _token_weights(self, loss_mask, length, batch, device):
        """[length * b] weights of this rank's rows of the [s, b] layout (1 without a mask)."""
        if loss_mask is None:
            return torch.ones(length * batch, device=device)
        mask = loss_mask.t()  # [s, b]
        if self.sequence_parallel:
            mask = mask[self.tp_rank * length:(self.tp_rank + 1) * length]  # [s/tp, b]
        return mask.reshape(-1).float()

    def _jitter_states(self, x, coords, jitter_key):
        """int64 [T] hash states of the router's input jitter (row t = i * b + j, as the
        tokens), or None when there is no jitter."""
        if not (self.training and self.config.moe_input_jitter_eps):
            return None
        if coords is None:  # a caller without coordinates: the fallback's
            coords = token_coordinates(None, x, sequence_shard(self.tp_group,
                                                               self.sequence_parallel))
        if jitter_key is None:  # a caller without a key: layer 0's
            jitter_key = site_key(self.config.seed, SITE_JITTER, 0)
        return token_states(jitter_key, coords).reshape(-1)  # [s(/tp), b] -> [T]

    @torch.compiler.disable  # host-side counts and uneven collectives: eager under --torch-compile
    def forward(self, x, loss_mask=None, coords=None, jitter_key=None):
        length, batch, hidden = x.shape
        tokens = x.reshape(-1, hidden)  # [T, h], T = length * b
        weights = self._token_weights(loss_mask, length, batch, x.device)  # [T]
        seq_ids = torch.arange(batch, device=x.device).repeat(length)  # [T]
        jitter = self._jitter_states(x, coords, jitter_key)  # [T] or None
        split = self.tp_size > 1 and not self.sequence_parallel
        if split:  # TP ranks hold the same tokens: each routes its share (module docstring)
            counts = comm.even_counts(tokens.shape[0], self.tp_size)
            start = sum(counts[:self.tp_rank])
            own = slice(start, start + counts[self.tp_rank])
            tokens = comm.split_rows(tokens, counts, self.tp_group)  # [T/tp, h]
            weights, seq_ids = weights[own], seq_ids[own]
            jitter = None if jitter is None else jitter[own]
        probs, routing_map = self.router(tokens, weights, seq_ids, batch, jitter)  # [T', E] each
        out = self.dispatcher(tokens, probs, routing_map, self.experts)  # [T', h]
        if split:
            out = comm.gather_replicated_rows(out, counts, self.tp_group)  # [T, h]
        out = out.view(length, batch, hidden)
        if self.shared_experts is not None:
            if self.training and self.config.recomputes("shared_experts"):
                shared = tpar.checkpoint(self.shared_experts, self.rng_tracker, x)
            else:
                shared = self.shared_experts(x)  # [s(/tp), b, h]
            gate = getattr(self.shared_experts, "gate_weight", None)
            if gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, gate))  # [s(/tp), b, 1] broadcast
            out = out + shared
        return out
