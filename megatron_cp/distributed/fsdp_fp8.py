"""FSDP2's parameter all-gather in FP8 (``--fp8-param-gather`` with ``--use-torch-fsdp2``).

Under FSDP2 each rank keeps only its fp32 rows of a weight (the master, which the optimizer
steps) and a layer's weights are all-gathered just before it runs, and again for its
backward. torch's FSDP2 lets the sharded tensor choose what is gathered: a local tensor
with ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (the extension torchao's float8
training uses) sends what the first returns and rebuilds the unsharded parameter from what
the second gets. :class:`Fp8Master` is that local tensor for the FP8 linears' weights: it
wraps the fp32 rows, and each gather sends them cast to FP8 (rounded to the model's dtype
first, then quantized with the whole weight's scale: one byte per element) and rebuilds an
:class:`~megatron_cp.fp8.params.Fp8Weight` of the model's dtype, which the FP8 linear
computes with as it is.

The scale is the distributed optimizer's (:func:`~megatron_cp.fp8.params.weight_scales`),
set once per step after the update (and at the start and after a load), so the forward's
and the backward's gathers cast alike: tensorwise, the MAX of the rows' amaxes over the
DP x CP ranks and the weight's TP group; delayed, the linear's weight scale, the rows' amax
entering the step's amax. So the FP8 weight is the one the distributed optimizer gathers
and the one one process casts. Between steps nothing but the fp32 rows is kept (FSDP frees
the gathered weight), as with FSDP2's own bf16 gather. A weight whose rows do not split evenly
is gathered as FSDP pads it (zero rows up to equal shards), and the gathered weight is its
first rows, a view. FSDP2 moves such a tensor subclass's rows into new storage at its lazy
initialisation (its reset_sharded_param compares storages of plain tensors only), so the
wrapper runs that before the optimizer takes views of the rows.
"""
import torch
from torch.utils._pytree import tree_flatten, tree_map

from megatron_cp.fp8.params import Fp8Weight
from megatron_cp.fp8.scaling import quantize

aten = torch.ops.aten
# the ops by which FSDP2 cuts, pads, moves and views a sharded param: their results are the
# same rows (or a view of them) and stay an Fp8Master; any other op sees the fp32 rows
_KEEP = {aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
         aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
         aten.as_strided.default, aten.new_zeros.default, aten.empty_like.default,
         aten.zeros_like.default, aten.clone.default, aten._to_copy.default,
         aten._pin_memory.default, aten.copy_.default}


class Fp8Master(torch.Tensor):
    """fp32 rows ``_rows`` of an FP8 linear's weight under FSDP2, with the weight's shared
    fp32 ``_scale`` [] and its ``_meta`` (:class:`~megatron_cp.fp8.linear.Fp8Meta`);
    ``_compute``: the model's dtype (the gathered weight's nominal dtype)."""

    @staticmethod
    def __new__(cls, rows, scale, meta, compute):
        return torch.Tensor._make_wrapper_subclass(cls, rows.shape, strides=rows.stride(),
                                                   dtype=rows.dtype, device=rows.device,
                                                   requires_grad=rows.requires_grad)

    def __init__(self, rows, scale, meta, compute):
        self._rows, self._scale, self._meta, self._compute = rows, scale, meta, compute

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"Fp8Master({tuple(self.shape)}, gathered as {self._meta.fwd_dtype})"

    def _like(self, rows):
        return Fp8Master(rows, self._scale, self._meta, self._compute)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Fp8Master))
        rows = lambda t: t._rows if isinstance(t, Fp8Master) else t  # noqa: E731
        out = func(*tree_map(rows, args), **tree_map(rows, kwargs))
        if func is aten.copy_.default:
            return args[0]
        if func not in _KEEP:
            return out
        wrap = lambda t: first._like(t) if isinstance(t, torch.Tensor) and \
            t.dtype == torch.float32 else t  # noqa: E731
        return tree_map(wrap, out)

    def fp8_rows(self):
        """The rows cast as a gather casts them: float8 ``[rows, ...]``."""
        return quantize(self._rows.to(self._compute), self._scale, self._meta.fwd_dtype)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2's hook: gather the FP8 bytes of the rows (uint8, one per element), padded
        with zero rows to FSDP's equal shards (ceil(rows / ranks) each); the scale goes along
        as metadata."""
        data = self.fp8_rows().view(torch.uint8)  # [r, *rest]
        per_rank = -(-outer_size[0] // mesh.size())
        if data.shape[0] < per_rank:
            pad = data.new_zeros((per_rank - data.shape[0], *data.shape[1:]))
            data = torch.cat([data, pad])  # [per_rank, *rest]
        return (data,), (self._scale.clone(),)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2's hook: the gathered bytes as the FP8 weight (``out``: the one made at the
        first gather, whose data are the same buffer; only its scale is refreshed)."""
        (data,), (scale,) = all_gather_outputs, metadata
        if out is not None:
            out._scale.copy_(scale)
            return None
        weight = Fp8Weight(data.view(self._meta.fwd_dtype), scale, param_dtype)
        return weight, (data,)


def wrap_fp8_masters(module, compute):
    """Before fully_shard: the weight of every FP8 linear of ``module`` (fp32 masters by
    now) becomes an :class:`Fp8Master` parameter (its attributes kept); returns how many."""
    count = 0
    for sub in module.modules():
        meta = getattr(sub, "fp8_meta", None)
        weight = getattr(sub, "weight", None)
        if meta is None or weight is None:
            continue
        scale = torch.ones((), dtype=torch.float32, device=weight.device)
        param = torch.nn.Parameter(Fp8Master(weight.data, scale, meta, compute),
                                   requires_grad=weight.requires_grad)
        for key, value in vars(weight).items():
            setattr(param, key, value)
        sub.weight = param
        count += 1
    return count


def unwrapped(tensor):
    """The fp32 rows of an :class:`Fp8Master` (the tensor itself otherwise)."""
    return tensor._rows if isinstance(tensor, Fp8Master) else tensor
