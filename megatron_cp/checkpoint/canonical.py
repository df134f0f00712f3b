"""The canonical form of a model's tensors, the one every format of ours reads and writes,
and where this rank's piece of a parameter sits in it.

A layout-free checkpoint stores every tensor under its canonical name (global layer
numbers: ``decoder.layers.<global layer>.<...>``) and its global shape, and each rank
describes its piece as boxes (offsets, sizes) of that global tensor:

* TP: a param split along ``partition_dim`` is a plain chunk of the global tensor. A strided
  split (``partition_stride`` s > 1, e.g. SwiGLU's fc1 that stacks the gate and up
  projections) is not one chunk of the full weight, so its canonical form splits the
  partition dim into ``[s, n/s]``: TP rank r then holds the chunk ``[:, r*n/(s*tp) : ...]``,
  and the canonical tensor reshaped back is exactly the full TP=1 weight.
* experts (MoE, ``is_expert``): the canonical tensor has the global expert dimension first
  (``[E, ...]``, EP rank r holding experts ``[r*E/EP, (r+1)*E/EP)``) and is split over the
  expert-TP group like a TP param over TP: ``mlp.experts.linear_fc1.weight`` is
  ``[E, ffn, h]`` (``[E, 2, ffn, h]`` for SwiGLU, as the dense fc1), ``linear_fc2.weight``
  ``[E, h, ffn]``, the biases ``[E, ffn]`` (``[E, 2, ffn]``) and ``[E, h]``;
* vocabulary rows: the padded vocabulary grows with the TP size, so the canonical word
  embedding / output layer holds the real rows only (``vocab_size``); padded rows are zero
  and stay zero, nothing of them is saved.
* the distributed optimizer's shard of a param is a flat range ``[start, stop)`` of the
  local param; :func:`flat_range_boxes` cuts it into at most ``2 * ndim - 1`` boxes, each a
  contiguous run of the flat range, so every box is a view of the 1-D shard.

:func:`tp_spec` says how each parameter name splits over TP / ETP (mirroring the layers' own
split at init), which turns full (TP=1) weights into canonical tensors and back.
"""
import dataclasses
import math
import re
from dataclasses import dataclass

from megatron_cp.checkpoint.fp8_state import is_fp8_buffer

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")  # [padded vocab, h]


def canonical_name(local_name, layer_numbers):
    """``decoder.layers.<local i>.x`` -> ``decoder.layers.<global layer>.x`` (others unchanged)."""
    m = LAYER.match(local_name)
    if not m:
        return local_name
    return f"decoder.layers.{layer_numbers[int(m.group(1))]}.{m.group(2)}"


def flat_range_boxes(shape, start, stop):
    """Boxes ``(offsets, sizes, flat_start)`` covering the row-major flat range
    ``[start, stop)`` of a tensor of ``shape``; each box is a contiguous run beginning at
    flat index ``flat_start``, and the boxes come in flat order."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    boxes = []
    if start % inner:  # the head: part of one row
        row = start // inner
        head_stop = min(stop, (row + 1) * inner)
        for off, size, flat in flat_range_boxes(shape[1:], start - row * inner, head_stop - row * inner):
            boxes.append(((row,) + off, (1,) + size, flat + row * inner))
        start = head_stop
    full_stop = stop - stop % inner
    if start < full_stop:  # whole rows
        boxes.append(((start // inner,) + zeros, ((full_stop - start) // inner,) + shape[1:], start))
        start = full_stop
    if start < stop:  # the tail: the beginning of one row
        row = start // inner
        for off, size, flat in flat_range_boxes(shape[1:], 0, stop - row * inner):
            boxes.append(((row,) + off, (1,) + size, flat + row * inner))
    return boxes


@dataclass(frozen=True)
class CanonicalSpec:
    """How one local param maps into its canonical tensor.

    ``local_shape``: the canonical view of the local tensor (the partition dim split into
    ``[stride, n/stride]`` when strided); ``global_shape``: the canonical tensor's shape
    (real vocabulary rows only); ``offset``: where the local view starts in it;
    ``row_limit``: rows of dim 0 that exist in the canonical tensor (None: all).
    """
    name: str
    local_shape: tuple
    global_shape: tuple
    offset: tuple
    row_limit: int | None = None

    def boxes(self, start, stop):
        """Boxes ``(global offsets, sizes, flat_start)`` of the local flat range
        ``[start, stop)``, clipped to the real vocabulary rows."""
        out = []
        for off, size, flat in flat_range_boxes(self.local_shape, start, stop):
            global_off = tuple(o + base for o, base in zip(off, self.offset))
            if self.row_limit is not None:
                rows = min(size[0], self.row_limit - global_off[0])
                if rows <= 0:
                    continue  # padding rows only
                size = (rows,) + tuple(size[1:])
            out.append((global_off, tuple(size), flat))
        return out


def param_spec(name, param, tp_size, tp_rank, vocab_size=None):
    """The :class:`CanonicalSpec` of a local param (``name`` already canonical).

    ``tp_size`` / ``tp_rank`` of the group the param is split over (``tensor_model_parallel``
    params only); ``vocab_size`` the real vocabulary (rows beyond it are padding).
    """
    shape = tuple(param.shape)
    offset, global_shape = [0] * len(shape), list(shape)
    if getattr(param, "tensor_model_parallel", False):
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        if stride > 1:  # [.., n, ..] -> [.., stride, n/stride, ..]: TP chunks the second
            shape = shape[:dim] + (stride, shape[dim] // stride) + shape[dim + 1:]
            offset, global_shape = [0] * len(shape), list(shape)
            dim += 1
        global_shape[dim] = shape[dim] * tp_size
        offset[dim] = shape[dim] * tp_rank
    row_limit = None
    if vocab_size is not None and name.endswith(VOCAB_PARAMS):
        row_limit = vocab_size
        global_shape[0] = vocab_size
    return CanonicalSpec(name, shape, tuple(global_shape), tuple(offset), row_limit)


def expert_param_spec(name, param, ep_size, ep_rank, etp_size, etp_rank):
    """The :class:`CanonicalSpec` of a local expert param ``[E_local, ...]``: split over ETP
    (its ``partition_dim`` / ``partition_stride``) and over EP along the expert dim 0."""
    spec = param_spec(name, param, etp_size, etp_rank)
    local = spec.local_shape[0]
    return dataclasses.replace(spec, global_shape=(local * ep_size,) + spec.global_shape[1:],
                               offset=(local * ep_rank,) + spec.offset[1:])


def full_from_canonical(tensor, tp_split):
    """The plain full weight of a canonical tensor: a strided ``[.., s, n/s, ..]`` tensor
    gets its split dim merged back (``tp_split``: (partition_dim, stride) or None)."""
    if not tp_split or tp_split[1] == 1:
        return tensor
    dim, _ = tp_split
    return tensor.reshape(tensor.shape[:dim] + (-1,) + tensor.shape[dim + 2:])


def canonical_from_full(tensor, tp_split):
    """Inverse of :func:`full_from_canonical`."""
    if not tp_split or tp_split[1] == 1:
        return tensor
    dim, stride = tp_split
    n = tensor.shape[dim]
    return tensor.reshape(tensor.shape[:dim] + (stride, n // stride) + tensor.shape[dim + 1:])


def is_expert(name):
    """True for a routed expert's param (``mlp.experts.``; not the shared experts):
    ``[E, ...]``, split over EP along dim 0 and over ETP by :func:`tp_spec`. The experts'
    FP8 buffers (fp8/grouped.py) cover all E experts on every rank: not split."""
    return (".mlp.experts." in name or name.startswith("mlp.experts.")) and \
        not is_fp8_buffer(name)


def is_buffer(name):
    """True for a state-dict entry that is a buffer, not a param (no optimizer state)."""
    return name.endswith(("router.expert_bias", "router.qb_beta")) or is_fp8_buffer(name)


def tp_spec(name, swiglu):
    """(partition_dim, stride) of a TP-sharded parameter name, or None when replicated.

    Mirrors the layers: column-parallel weights (and the Gated DeltaNet's per-head
    parameters) split dim 0 (SwiGLU's fc1 stacks gate and up,
    stride 2), row-parallel weights dim 1, the vocab-parallel embedding and output dim 0.
    Expert params (``[E, ...]``) are split over ETP the same way one dim further in.
    """
    if is_expert(name):
        if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            return 1, 2 if swiglu else 1
        return (2, 1) if name.endswith("linear_fc2.weight") else None
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "eh_proj.weight")):
        return 0, 1  # eh_proj: an MTP depth's column-parallel projection
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return 0, 1
    if name.endswith(("linear_q_proj.weight", "linear_q_up_proj.weight",
                      "linear_kv_up_proj.weight")):
        return 0, 1  # MLA: whole heads per rank (its down projections are replicated)
    if name.endswith(("self_attention.in_proj.weight", "self_attention.conv1d.weight",
                      "self_attention.A_log", "self_attention.dt_bias")):
        return 0, 1  # Gated DeltaNet: grouped per key head (model/gated_delta_net.py)
    if name.endswith("self_attention.out_proj.weight"):
        return 1, 1
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return 0, 2 if swiglu else 1
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1, 1
    return None


def canonical_tensors(full, args, optimizer=None):
    """``{key: canonical tensor}`` of a model held as full weights: ``model.<name>`` from
    ``full`` and ``optimizer.<kind>.<name>`` from ``optimizer`` ({kind: {name: full
    tensor}}); a strided split gets its ``[stride, n/stride]`` dims back."""
    tensors = {f"model.{name}": canonical_from_full(t, tp_spec(name, args["swiglu"]))
               for name, t in full.items()}
    for kind, per in (optimizer or {}).items():
        for name, t in per.items():
            tensors[f"optimizer.{kind}.{name}"] = canonical_from_full(t, tp_spec(name, args["swiglu"]))
    return tensors
