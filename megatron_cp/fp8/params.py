"""FP8 weights kept between steps (Megatron-LM's ``--fp8-param-gather``).

Without the flag each FP8 linear casts its high-precision weight to FP8 as it runs. With it,
the weight of every FP8 linear (those :func:`~megatron_cp.fp8.model.attach_fp8` gives an
:class:`~megatron_cp.fp8.linear.Fp8Meta`) *is* FP8 between steps: an :class:`Fp8Weight`, one
byte per element plus one fp32 scale, made by the sharded optimizer from the fp32 masters
and all-gathered as bytes. The linear's forward takes that FP8 weight and its scale as they
are (:meth:`Fp8Weight.fp8_pair`); the weight gradient is still a high-precision tensor of the
weight's nominal dtype, accumulated in the fp32 ``main_grad``.

The cast is Megatron-LM's (Transformer Engine's ``cast_master_weights_to_fp8``): each rank
rounds its fp32 master shard to the model's dtype first (so the FP8 weight is exactly the one
a run without the flag casts from its bf16 weight), then

- tensorwise: the scale comes from the whole weight's amax: each shard's amax, MAX over the
  ranks that hold shards of it (the optimizer's sharding group) and over the weight's TP
  group -- the amax one process takes of the whole weight;
- delayed: the scale is the linear's current weight scale (from its amax history); the
  shard's amax enters the step's amax, reduced at the step's end over TP, CP and DP as every
  delayed amax is (:func:`~megatron_cp.fp8.model.end_fp8_step`).

One process (or one data-parallel rank) holds the whole master: its FP8 weight is
``quantize(master)`` with the same rules, so every layout is one process's run.

Anything else that reads an :class:`Fp8Weight` (norms, hashes, conversions, checkpoint
views) sees its dequantized value ``q / scale`` in the nominal dtype; a checkpoint saves
that, with the fp32 masters as the optimizer's main params, which is what Megatron-LM saves
(its dist-ckpt dequantizes FP8 params). Writing into it (``copy_``: a load of weights
only) keeps the written high-precision values as the source of the next masters
(:meth:`Fp8Weight.take_pending`), as Megatron-LM builds the masters of such a load from the
checkpoint's tensors, not from their FP8 rounding.
"""
import torch
from torch.utils._pytree import tree_map

from megatron_cp.fp8.linear import WEIGHT, Fp8Meta
from megatron_cp.fp8.scaling import local_amax, quantize, reduce_max, scale_from_amax

aten = torch.ops.aten


class Fp8Weight(torch.Tensor):
    """A weight stored as float8 ``_data`` (same shape) and an fp32 ``_scale`` (0-d), seen
    by autograd and by the rest of the model as a tensor of its nominal ``dtype`` (the
    model's: bf16, fp16 or fp32), whose value is ``_data / _scale``.

    ``_pending``: high-precision values written into it since the masters were last made
    (the initial weights, or a load of weights only), for the optimizer to build its fp32
    masters from (None once taken)."""

    fp8_storage = True  # marks the params whose bytes live in a uint8 param buffer

    @staticmethod
    def __new__(cls, data, scale, dtype, pending=None, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype,
                                                   device=data.device, requires_grad=requires_grad)

    def __init__(self, data, scale, dtype, pending=None, requires_grad=False):
        self._data = data  # float8 [*shape]
        self._scale = scale  # fp32 []
        self._pending = pending

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"Fp8Weight({tuple(self.shape)}, {self._data.dtype}, nominal {self.dtype})"

    def dequantize(self):
        """The value it stands for, ``_data / _scale``, as a plain tensor of its dtype."""
        return (self._data.to(torch.float32) / self._scale).to(self.dtype)

    @torch._dynamo.disable
    def fp8_pair(self):
        """``(float8 data [*shape], fp32 scale [])`` for the FP8 GEMMs (the scale a copy, so
        a backward keeps the forward's even if the weight is cast again meanwhile). Read
        eagerly under --torch-compile: a compiled layer would otherwise keep the data and
        scale it traced (measured: its losses left the eager run's by 6e-3 at step 3)."""
        return self._data, self._scale.clone()

    def bytes_view(self):
        """The float8 data as uint8 ``[numel]`` (what the param buffer and the all-gather hold)."""
        return self._data.view(-1).view(torch.uint8)

    def move_bytes(self, flat):
        """Keep the data in ``flat`` (uint8 ``[numel]``, a slice of a param buffer) from now on."""
        flat.copy_(self.bytes_view())
        self._data = flat.view(self._data.dtype).view(self.shape)

    def store(self, values):
        """Write high-precision ``values``: kept as the pending source of the masters, and,
        until the optimizer casts the masters, quantized with their own (local) amax."""
        values = values.detach().to(self.dtype)
        self._pending = values.clone()
        self._scale.copy_(scale_from_amax(local_amax(values), self._data.dtype))
        self._data.copy_(quantize(values, self._scale, self._data.dtype))

    def take_pending(self):
        """The pending high-precision values (or the dequantized weight when none), once."""
        pending, self._pending = self._pending, None
        return pending if pending is not None else self.dequantize()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):  # an alias stays an FP8 weight
            t = args[0]
            return Fp8Weight(t._data, t._scale, t.dtype, t._pending)
        if func is aten.as_strided.default and _leading_rows(args) is not None:
            t = args[0]  # FSDP2's view of a gathered weight, its padding rows left out
            return Fp8Weight(t._data[:_leading_rows(args)], t._scale, t.dtype, t._pending)
        if func is aten.copy_.default and isinstance(args[0], Fp8Weight):
            args[0].store(args[1].dequantize() if isinstance(args[1], Fp8Weight) else args[1])
            return args[0]
        if func._schema.is_mutable and any(isinstance(a, Fp8Weight) for a in args[:1]):
            raise AssertionError(f"{func} would write into an FP8 weight; only copy_ may")
        unwrap = lambda t: t.dequantize() if isinstance(t, Fp8Weight) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _leading_rows(args):
    """How many leading rows of ``t`` ``as_strided(t, size, stride, offset)`` is, laid out as
    ``t`` is (None: another view)."""
    t, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else 0
    if offset or not size or size[1:] != tuple(t.shape[1:]) or size[0] > t.shape[0]:
        return None
    return size[0] if stride == t._data[:size[0]].stride() else None


def fp8_weights(chunks):
    """``[(param, Fp8Meta)]`` of the FP8 weights in ``chunks``, in module order (the same on
    every rank of a pipeline stage)."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, Fp8Weight) and getattr(module, "fp8_meta", None) is not None:
                found.append((weight, module.fp8_meta))
    return found


def _dequantized_state(module, state_dict, prefix, local_metadata):
    """State-dict hook: an FP8 weight is saved dequantized, in its nominal dtype."""
    key = prefix + "weight"
    if isinstance(state_dict.get(key), Fp8Weight):
        state_dict[key] = state_dict[key].dequantize()


@torch.no_grad()
def keep_fp8_weights(model):
    """Replace the weight of every FP8 linear of ``model`` (one with an
    :class:`~megatron_cp.fp8.linear.Fp8Meta`) by an :class:`Fp8Weight` holding its values, the
    high-precision ones pending for the optimizer's masters; its other attributes (TP marks)
    stay. Returns how many."""
    count = 0
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        weight = getattr(module, "weight", None)
        # (the routed experts' grouped weights stay in the model's dtype: config/fp8.py notes it)
        if not isinstance(meta, Fp8Meta) or weight is None or isinstance(weight, Fp8Weight):
            continue
        data = torch.empty(weight.shape, dtype=meta.fwd_dtype, device=weight.device)
        scale = torch.ones((), dtype=torch.float32, device=weight.device)
        stored = Fp8Weight(data, scale, weight.dtype)
        stored.store(weight)
        param = torch.nn.Parameter(stored, requires_grad=weight.requires_grad)
        for key, value in vars(weight).items():
            setattr(param, key, value)
        module.weight = param
        module._register_state_dict_hook(_dequantized_state)
        count += 1
    return count


def weight_scales(entries, state):
    """The scale each FP8 weight is cast with this time, for ``entries`` ``[(meta, shard,
    sharding group name)]`` over every FP8 weight of the model chunks (every rank of a stage
    passes them in the same order; ``shard``: this rank's master shard already rounded to the
    model's dtype, or None where it holds none), and the amaxes recorded for the step (see the
    module docstring). Collective over the sharding groups and the weights' TP groups
    (tensorwise only)."""
    amaxes = torch.zeros(len(entries), dtype=torch.float32, device=state.device)  # [n]
    for i, (_, shard, _) in enumerate(entries):
        if shard is not None:
            amaxes[i] = local_amax(shard)
    tensorwise = [i for i, (meta, _, _) in enumerate(entries) if not meta.delayed]
    if tensorwise:  # the whole weight's amax: over its shards' owners, then its TP group
        for name in sorted({entries[i][2] for i in tensorwise}):
            index = [i for i in tensorwise if entries[i][2] == name]
            amaxes[index] = reduce_max(amaxes[index], [state.group(name)])
        tp_groups = [entries[i][0].groups[WEIGHT][0] for i in tensorwise]
        for group in dict.fromkeys(tp_groups):
            index = [i for i, g in zip(tensorwise, tp_groups) if g is group]
            amaxes[index] = reduce_max(amaxes[index], [group])
    scales = []
    for (meta, _, _), amax in zip(entries, amaxes):
        # the weight's amax of the step about to run (tensorwise: whole; delayed: this
        # shard's, reduced at the step's end): set, not accumulated, as a load casts again
        if meta.training:
            meta.step_amax[WEIGHT] = amax
        scales.append(meta.scale[WEIGHT].clone() if meta.delayed
                      else scale_from_amax(amax, meta.fwd_dtype))
    return scales
