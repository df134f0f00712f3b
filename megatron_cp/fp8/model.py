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
import torch.distributed as dist

from megatron_cp.config.fp8 import BLOCK_LENGTH, check_whole_blocks
from megatron_cp.fp8.grouped import attach_grouped_fp8, end_grouped_step
from megatron_cp.fp8.linear import Fp8Meta
from megatron_cp.fp8.scaling import reduce_max

# the GPUs whose scaled_mm kernels take each block recipe's scales (compute capability)
BLOCK_GPUS = {"blockwise": ((9, 0), (10, 0), "Hopper (compute capability 9.x)"),
              "mxfp8": ((10, 0), (13, 0), "Blackwell (compute capability 10.x to 12.x)")}


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
    (none for MLA's down projections, whole on every rank). Block recipes: token blocks
    reduced over CP; refused where a TP shard would cut a block (:func:`check_block_shard`;
    on a GPU without their kernels the model refuses them first: :func:`check_block_device`)."""
    for linear in _linears(module):
        activation = (tp_group, cp_group)
        weight = (getattr(linear, "tp_group", None),)
        if config.fp8_recipe in BLOCK_LENGTH:
            check_block_shard(config.fp8_recipe, linear, module)
        linear.fp8_meta = Fp8Meta(config, (activation, weight, activation),
                                  token_groups=(cp_group,))
    attach_grouped_fp8(module, config)  # the routed experts' grouped GEMMs (fp8/grouped.py)


def output_fp8(config, padded_vocab, tp_group, cp_group):
    """--fp8-output-proj (MXFP8 only, Megatron-LM's rule): the output layer's
    :class:`Fp8Meta` (its GEMMs run under it, with the word embedding when tied), or None.
    A TP shard of the padded vocabulary must be whole 32-element blocks."""
    if not config.fp8_output_proj:
        return None
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    check_whole_blocks(config.fp8_recipe, f"--fp8-output-proj's padded vocabulary "
                       f"({padded_vocab})", padded_vocab // tp_size,
                       "--tensor-model-parallel-size", tp_size,
                       "raise --make-vocab-size-divisible-by to a multiple of {length}")
    activation = (tp_group, cp_group)
    return Fp8Meta(config, (activation, (tp_group,), activation), token_groups=(cp_group,))


def check_block_device(recipe, capability, gpu_name):
    """A block recipe on a GPU (``capability`` (major, minor); None: not a GPU) whose
    scaled_mm has no kernel for its scales is refused (the CPU runs the exact reference)."""
    if recipe not in BLOCK_GPUS or capability is None:
        return
    low, high, name = BLOCK_GPUS[recipe]
    if not low <= capability < high:
        raise ValueError(f"--fp8-recipe {recipe} needs a {name} GPU for its block-scaled "
                         f"GEMMs; {gpu_name} is compute capability "
                         f"{capability[0]}.{capability[1]}: use --fp8-recipe tensorwise")


def check_block_shard(recipe, linear, module):
    """Blocks along a TP-split dim are the logical tensor's when each TP shard holds whole
    blocks: each of the shard's ``partition_stride`` stacked pieces (SwiGLU's gate and up)
    a multiple of the block length along ``partition_dim``; otherwise refuse."""
    group = getattr(linear, "tp_group", None)
    weight = linear.weight
    if group is None or dist.get_world_size(group) == 1 or \
            not getattr(weight, "tensor_model_parallel", False):
        return
    dim = weight.partition_dim
    piece = weight.shape[dim] // getattr(weight, "partition_stride", 1)
    name = next(n for n, m in module.named_modules() if m is linear)
    check_whole_blocks(recipe, f"{name}'s {'output' if dim == 0 else 'input'} dim", piece,
                       "--tensor-model-parallel-size", dist.get_world_size(group),
                       "use a TP size that leaves each shard whole blocks, or sizes that do "
                       "(e.g. the dim a multiple of {length} x {ranks})")


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
