"""Which linears run in FP8, and the delayed recipe's once-per-step scale update.

Megatron-LM runs the transformer layers under Transformer Engine's fp8_autocast: every linear
of attention, the MLP, the shared experts, MLA, Gated DeltaNet and the MTP layers, and the
routed experts' grouped GEMMs (fp8/grouped.py, tensorwise and delayed), never the embedding or
the output layer. ``--first-last-layers-bf16`` keeps the first
``--num-layers-at-start-in-bf16`` and the last ``--num-layers-at-end-in-bf16`` decoder layers
(global numbering) in high precision; MTP layers always run in FP8 (Megatron-LM's MTP uses
its global FP8 context).

Delayed scaling's history moves once per global batch: each tensor's step amax is the max
over every microbatch and every rank holding a piece of it, so any DP, TP, CP or PP layout
pushes the same value as one process. (Transformer Engine updates after each microbatch's
forward, which makes the scales depend on how many microbatches a rank runs.)
"""
import torch

from megatron_cp.fp8.grouped import attach_grouped_fp8, end_grouped_step
from megatron_cp.fp8.linear import Fp8Meta
from megatron_cp.fp8.scaling import reduce_max


def fp8_layer(config, layer_number):
    """Whether decoder layer ``layer_number`` (0-based, global) runs its linears in FP8."""
    if not config.fp8:
        return False
    if not config.first_last_layers_bf16:
        return True
    start, end = config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16
    return start <= layer_number < config.num_layers - end


def _linears(module):
    """The linears inside ``module`` that can run in FP8: those that declare an ``fp8_meta``
    (None until attached; tensor_parallel's column/row-parallel linears, MLA's replicated
    down projections)."""
    return [m for m in module.modules() if hasattr(m, "fp8_meta")]


def attach_fp8(module, config, tp_group, cp_group):
    """Give every column/row-parallel linear inside ``module`` (a transformer layer, an MTP
    layer) an :class:`~megatron_cp.fp8.linear.Fp8Meta`: its input's and output gradient's
    amaxes reduced over the model's TP and CP groups (the input is split over the sequence
    under SP and CP, and over the hidden size into a row-parallel linear; the gradient over
    the output size out of a column-parallel one), the weight's over the linear's TP group
    (none for MLA's down projections, whole on every rank)."""
    for linear in _linears(module):
        activation = (tp_group, cp_group)
        weight = (getattr(linear, "tp_group", None),)
        linear.fp8_meta = Fp8Meta(config, (activation, weight, activation))
    attach_grouped_fp8(module, config)  # the routed experts' grouped GEMMs (fp8/grouped.py)


def fp8_metas(chunks):
    """Every Fp8Meta of the model chunks, in module order (the same on every rank of a
    pipeline stage)."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, Fp8Meta)]


@torch.no_grad()
def end_fp8_step(chunks, groups):
    """After a training step's forward and backward: reduce every delayed-scaling linear's
    step amax with MAX over ``groups`` (TP, CP and DP: every rank of the stage), in one flat
    all-reduce per group, then move each linear's state to the next step
    (:meth:`Fp8Meta.end_step`: the delayed history and scales, ``last_amax``)."""
    metas = fp8_metas(chunks)
    delayed = [m for m in metas if m.delayed]
    if delayed:
        flat = torch.stack([m.step_amax for m in delayed])  # [n, 3]
        reduce_max(flat, groups)
        for meta, amax in zip(delayed, flat):
            meta.step_amax.copy_(amax)
    for meta in metas:
        meta.end_step()
    end_grouped_step(chunks, groups)
