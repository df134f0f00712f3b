"""The routed experts of one rank: every local expert's MLP in one grouped matmul.

Weights, one tensor per kind for all local experts (the ``nn.Linear`` [out, in] layout
per expert)::

    linear_fc1.weight  [E_local, ffn/etp (x2 for SwiGLU: [gate; up]), h]
    linear_fc1.bias    [E_local, ffn/etp (x2)]
    linear_fc2.weight  [E_local, h, ffn/etp]
    linear_fc2.bias    [E_local, h]

Expert ``e`` (global index) is drawn whole from its own seed and split over the expert
tensor-parallel (ETP) ranks like a column-parallel fc1 and a row-parallel fc2, so every
EP/ETP layout holds exactly the weights of one process. fc2's partial sums are summed over
ETP by the dispatcher; its bias is added on ETP rank 0 only and its gradient summed over ETP
(``sequence_parallel`` on an expert parameter means "summed over ETP").

``torch.nn.functional.grouped_mm`` runs all experts in one call where this torch has it and
supports the case (CPU; bf16 on CUDA; 16-byte aligned rows); otherwise a loop over experts.
Under FP8 (tensorwise and delayed recipes) each linear carries a
:class:`~megatron_cp.fp8.grouped.GroupedFp8Meta` and runs megatron_cp/fp8/grouped.py's GEMMs,
one scale per expert and microbatch class (the rows' layout comes from the dispatcher as an
:class:`~megatron_cp.fp8.grouped.ExpertRows`).
"""
import torch
import torch.nn.functional as F

from megatron_cp import tensor_parallel as tpar
from megatron_cp.distributed.meta_init import drawn_parameter
from megatron_cp.fp8.grouped import ExpertRows, grouped_fp8_linear
from megatron_cp.layers.fine_grained_offload import offload_group
from megatron_cp.layers.mlp import activate
from megatron_cp.tensor_parallel.layers import _full_then_split, _mark


def grouped_mm_supported(x, weight):
    """Whether ``F.grouped_mm`` can run ``x`` [N, in] against ``weight`` [E, out, in]."""
    if not hasattr(F, "grouped_mm") or x.shape[0] == 0:
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    return all((n * size) % 16 == 0 for n in (weight.shape[1], weight.shape[2]))


def grouped_linear(x, weight, counts, bias=None, expert_ids=None):
    """Rows of ``x`` [N, in], grouped by expert (``counts`` rows each, in order), times each
    expert's ``weight`` [E, out, in]^T (+ its ``bias`` [E, out]) -> [N, out]."""
    if grouped_mm_supported(x, weight):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)  # [E]
        out = F.grouped_mm(x.contiguous(), weight.transpose(-2, -1), offs=offsets)  # [N, out]
    else:
        # unbind: one view per expert (indexing weight[e] in the loop would give every
        # expert's backward a whole [E, out, in] gradient to sum)
        out = torch.cat([F.linear(part, w) for w, part in zip(weight.unbind(0),
                                                              x.split(list(counts)))])  # [N, out]
    return add_expert_bias(out, bias, expert_ids)


def add_expert_bias(out, bias, expert_ids):
    """``out`` [N, out] plus each row's expert's ``bias`` [E, out] (``expert_ids`` [N]), or
    ``out`` when ``bias`` is None."""
    if bias is None:
        return out
    # in fp32: the bias gradient sums many rows (bf16 would lose ~2%)
    return (out.float() + bias.float()[expert_ids]).to(out.dtype)


class ExpertLinear(torch.nn.Module):
    """The weights of one linear of every local expert: ``weight`` [E_local, out, in] and
    ``bias`` [E_local, out] (or None); ``fp8_meta`` (a GroupedFp8Meta) under FP8."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight = weight  # a parameter (drawn_parameter: perhaps drawn later)
        self.bias = torch.nn.Parameter(bias) if bias is not None else None

    def forward(self, x, rows, bias, expert_ids):
        """x [N, in] laid out as ``rows`` (ExpertRows) -> [N, out]."""
        meta = getattr(self, "fp8_meta", None)
        if meta is None:
            return grouped_linear(x, self.weight, rows.counts, bias, expert_ids)
        return add_expert_bias(grouped_fp8_linear(x, self.weight, meta, rows), bias, expert_ids)


class GroupedExperts(torch.nn.Module):
    """tokens [N, h] sorted by local expert, ``counts`` [E_local] -> [N, h] (a partial sum
    over ETP ranks when ETP > 1)."""
    offload = None  # the block's FineGrainedOffload, with --fine-grained-activation-offloading

    def __init__(self, config, prefix, ep_rank, ep_size, etp_rank, etp_size, device=None,
                 fp8_groups=(None, None), num_classes=1):
        super().__init__()
        # FP8 (fp8/grouped.py): the expert-DP and expert-TP groups (every replica of these
        # experts in the stage) and the number of microbatch classes (the DP size)
        self.fp8_groups, self.num_classes = tuple(fp8_groups), num_classes
        self.config, self.activation = config, config.activation
        self.swiglu = config.activation == "swiglu"
        self.etp_rank = etp_rank
        self.num_local = config.num_moe_experts // ep_size
        self.first = first = ep_rank * self.num_local
        ffn, h, std = config.moe_ffn_hidden_size, config.hidden_size, config.hidden_init_std
        stride = 2 if self.swiglu else 1
        dtype, bias = config.params_dtype, config.add_bias_linear

        def stacked(name, shape, dim, stride, init_std):
            """[E_local, *shard]: each local expert's shard of its own drawn weight."""
            return drawn_parameter(lambda where: torch.stack([_full_then_split(
                shape, dim, stride, etp_size, etp_rank, tpar.normal_init(init_std),
                tpar.init_seed(config.seed, f"{prefix}.{first + e}.{name}"), dtype, where)
                for e in range(self.num_local)]), device)

        zeros = lambda *shape: torch.zeros(self.num_local, *shape, dtype=dtype, device=device)
        self.linear_fc1 = ExpertLinear(stacked("linear_fc1", (ffn * stride, h), 0, stride, std),
                                       zeros(ffn * stride // etp_size) if bias else None)
        self.linear_fc2 = ExpertLinear(
            stacked("linear_fc2", (h, ffn), 1, 1, tpar.scaled_init_std(std, config.num_layers)),
            zeros(h) if bias else None)
        _mark(self.linear_fc1.weight, 1, stride)
        _mark(self.linear_fc2.weight, 2)
        if bias:
            _mark(self.linear_fc1.bias, 1, stride)
            self.linear_fc2.bias.sequence_parallel = etp_size > 1
        for p in self.parameters():
            p.is_expert = True

    @property
    def wants_classes(self):
        """Whether the dispatcher must name each row's microbatch class (tensorwise and
        block FP8)."""
        meta = getattr(self.linear_fc1, "fp8_meta", None)
        return meta is not None and not meta.delayed

    @property
    def wants_token_order(self):
        """Whether each class's rows must come in one process's token order (block FP8's
        wgrad blocks: fp8/grouped_blocks.py)."""
        meta = getattr(self.linear_fc1, "fp8_meta", None)
        return meta is not None and meta.blocks is not None

    def forward(self, tokens, counts, rows=None):
        """``rows``: the rows' layout (ExpertRows: microbatch classes, padding rows), by
        default one class, all real."""
        rows = rows if rows is not None else ExpertRows(counts)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        expert_ids = None
        if fc1.bias is not None:
            expert_ids = torch.repeat_interleave(
                torch.arange(self.num_local, device=tokens.device),
                torch.tensor(counts, device=tokens.device), output_size=tokens.shape[0])  # [N]
        with offload_group(self.offload, "expert_fc1"):
            h = fc1(tokens, rows, fc1.bias, expert_ids)  # [N, ffn/etp (x2)]
        rebuild = None
        with offload_group(self.offload, "moe_act"):
            if self.training and self.config.recomputes("moe_act"):  # rebuilt in backward
                rebuild = tpar.DiscardedOutput(self._activate)
                h = rebuild(h)  # [N, ffn/etp]
            else:
                h = self._activate(h)  # [N, ffn/etp]
        fc2_bias = fc2.bias if self.etp_rank == 0 else None  # once over ETP (module docstring)
        out = fc2(h, rows, fc2_bias, expert_ids)  # [N, h]
        if rebuild is not None:
            rebuild.discard_after(out)
        return out

    def _activate(self, h):
        return activate(h, self.activation)
