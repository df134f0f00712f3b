"""Megatron-LM's own ``--ckpt-format torch_dist`` checkpoints: its names, its stacked layers,
its pickled arguments, read and written without megatron installed.

What Megatron-LM (megatron-core's ``dist_checkpointing``) writes per iteration folder::

    iter_0000010/metadata.json     {"sharded_backend": "torch_dist", ...}: tells it from ours
    iter_0000010/.metadata         the torch.distributed.checkpoint index
    iter_0000010/__0_0.distcp ...  the tensors
    iter_0000010/common.pt         args (an argparse Namespace holding megatron enums),
                                   checkpoint_version 3.0, iteration, optimizer param groups
                                   and step, opt_param_scheduler (counted in samples)

Its tensors differ from ours (:mod:`megatron_cp.checkpoint.canonical`) in four ways (MTP
depths are not stacked: ``mtp.layers.<k>.transformer_layer.<layer name>`` per depth):

- every transformer-layer tensor is stacked over the layers, ``[num_layers, ...]`` under
  ``decoder.layers.<name>`` (no layer number in the key);
- the norms in front of attention and MLP carry Transformer Engine's fused names
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``)
  under both of its layer specs; the older local names are read too;
- the vocabulary rows are padded (make_vocab_size_divisible_by x its TP size) and the padding
  is saved; routed experts live under ``mlp.experts.experts.`` (SequentialMLP);
- every linear layer has an ``_extra_state`` object per layer (and expert), and the
  optimizer's moments are ``optimizer.state.exp_avg.<key>`` in the same stacked form.

FP8: Megatron-LM keeps delayed scaling's amax histories and scales in Transformer Engine's
``_extra_state``, which is written here empty: an export drops our ``fp8_meta`` buffers, and
a load of Megatron-LM's checkpoint into an FP8 run starts every history fresh
(:mod:`megatron_cp.checkpoint.fp8_state`).

The full weights here are plain (unsharded, TP=1) tensors under our names with global layer
numbers (``decoder.layers.3.mlp.linear_fc1.weight``), the form tools/checkpoint_convert.py
works in. This module knows nothing of our own formats; a TrainState's load from it is
:mod:`megatron_cp.checkpoint.megatron_lm_load`.
"""
import argparse
import enum
import io
import json
import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_cp.checkpoint import fp8_state
from megatron_cp.config.census import megatron_census

METADATA_JSON = "metadata.json"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
# our layer-local name -> Megatron's (first: the one written; all: accepted on read)
LAYER_NAMES = {
    "input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight",
                               "input_layernorm.weight"),
    "input_layernorm.bias": ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    "pre_mlp_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    "pre_mlp_layernorm.bias": ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    "mlp.experts.linear_fc1.weight": ("mlp.experts.experts.linear_fc1.weight",
                                      "mlp.experts.linear_fc1.weight"),
    "mlp.experts.linear_fc1.bias": ("mlp.experts.experts.linear_fc1.bias",
                                    "mlp.experts.linear_fc1.bias"),
    "mlp.experts.linear_fc2.weight": ("mlp.experts.experts.linear_fc2.weight",
                                      "mlp.experts.linear_fc2.weight"),
    "mlp.experts.linear_fc2.bias": ("mlp.experts.experts.linear_fc2.bias",
                                    "mlp.experts.linear_fc2.bias"),
}
TOP_NAMES = {"final_layernorm.weight": "decoder.final_layernorm.weight",
             "final_layernorm.bias": "decoder.final_layernorm.bias",
             "embedding.position_embeddings": "embedding.position_embeddings.weight"}
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
# megatron-core saves a GPT MTP depth's transformer layer under this name (not stacked)
MTP_LAYER = "transformer_layer"
# Megatron's optimizer state kinds -> ours
OPTIMIZER_KINDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "main_param"}
# linear layers that carry an _extra_state per layer (routed experts: per layer and expert)
EXTRA_STATE_LAYERS = ("self_attention.linear_qkv", "self_attention.linear_proj",
                      "mlp.linear_fc1", "mlp.linear_fc2", "mlp.shared_experts.linear_fc1",
                      "mlp.shared_experts.linear_fc2")
EXPERT_EXTRA_STATE = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
# scheduler state that Megatron counts in samples (ours: in iterations)
SAMPLE_COUNTS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps",
                 "wsd_decay_steps")


def is_megatron_lm(folder):
    """True if the iteration folder ``folder`` holds a checkpoint written by Megatron-LM
    (megatron-core's dist_checkpointing marks it with ``metadata.json``)."""
    path = os.path.join(folder, METADATA_JSON)
    if not os.path.isfile(path) or not os.path.exists(os.path.join(folder, ".metadata")):
        return False
    with open(path) as file:
        return json.load(file).get("sharded_backend") == "torch_dist"


# --- its pickled arguments, without megatron installed -----------------------------------

class StandIn:
    """What a megatron class pickled in ``common.pt`` becomes: its arguments and state kept,
    an enum member's value as ``.value`` (``str()`` gives ``Class.value``)."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        self.value = args[0] if len(args) == 1 else args

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self):
        return f"{type(self).__name__}.{self.value}"


class _Unpickler(pickle.Unpickler):
    """Maps every ``megatron.*`` class to a :class:`StandIn` subclass of the same name, so
    the arguments read the same whether megatron is installed or not."""

    def find_class(self, module, name):
        if module == "megatron" or module.startswith("megatron."):
            return type(name, (StandIn,), {"__module__": "megatron_cp.standin." + module})
        return super().find_class(module, name)


class _PickleModule:
    """The ``pickle_module`` torch.load takes: pickle with :class:`_Unpickler`."""
    Unpickler = _Unpickler
    load = staticmethod(lambda file, **kw: _Unpickler(file, **kw).load())
    __name__ = "megatron_cp_megatron_pickle"


def read_common(folder):
    """``common.pt`` of a Megatron-LM iteration folder, megatron classes as stand-ins."""
    return torch.load(os.path.join(folder, "common.pt"), map_location="cpu",
                      weights_only=False, pickle_module=_PickleModule)


def _plain(value):
    if isinstance(value, (StandIn, enum.Enum)):
        return getattr(value, "name", None) or str(value.value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def our_args(megatron_args):
    """Our argument dict (the names a checkpoint of ours saves) from Megatron-LM's Namespace.

    Megatron's dests are ours; what differs: ``--disable-bias-linear`` is its
    ``add_bias_linear``; it saves the derived ``kv_channels`` and ``num_query_groups`` (1
    without GQA); its ``bias_gelu_fusion`` (the tanh GELU) is ours, off without biases as its
    arguments.py makes it."""
    m = vars(megatron_args) if isinstance(megatron_args, argparse.Namespace) else dict(megatron_args)
    args = {k: _plain(v) for k, v in m.items()}
    bias = m.get("add_bias_linear", True)
    args["disable_bias_linear"] = not bias
    args["bias_gelu_fusion"] = bool(bias and m.get("bias_gelu_fusion", True))
    # a Megatron-LM older than the flag averaged microbatch means, its later default
    args.setdefault("calculate_per_token_loss", False)
    heads = m["num_attention_heads"]
    if not m.get("group_query_attention"):
        args["num_query_groups"] = heads
    if m.get("kv_channels") == m["hidden_size"] // heads:
        args["kv_channels"] = None
    if m.get("num_experts") is None:
        args["num_experts"] = None
    freq = m.get("moe_layer_freq", 1)
    args["moe_layer_freq"] = str(freq)
    args["params_dtype"] = str(m.get("params_dtype", torch.float32))
    return args


def megatron_census_defaults():
    """Megatron-LM's argument defaults by dest, from the flag census (None where the
    default is an object the census could only print, e.g. an enum)."""
    return {action["dest"]: None if isinstance(action.get("default"), str)
            and action["default"].startswith("<") else action.get("default")
            for action in megatron_census()["actions"]}


def megatron_args(ours, defaults, iteration, consumed_samples):
    """An argparse Namespace Megatron-LM reads (``--use-checkpoint-args``, its load path)
    from our argument dict ``ours``: Megatron's defaults (``defaults``: dest -> default, from
    the flag census), ours where the names agree, and its own spellings and derived values."""
    values = dict(defaults)
    values.update({k: v for k, v in ours.items() if k in defaults})
    bias = not ours.get("disable_bias_linear", False)
    heads, hidden = ours["num_attention_heads"], ours["hidden_size"]
    groups = ours.get("num_query_groups") or heads
    dtype = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}.get(
        str(ours.get("params_dtype")), torch.float32)
    vocab = ours.get("true_vocab_size") or ours.get("padded_vocab_size")
    values.update(
        add_bias_linear=bias, add_qkv_bias=bias or ours.get("add_qkv_bias", False),
        bias_gelu_fusion=bool(bias and ours.get("bias_gelu_fusion")),
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else 1,
        kv_channels=ours.get("kv_channels") or hidden // heads,
        ffn_hidden_size=ours.get("ffn_hidden_size") or 4 * hidden,
        padded_vocab_size=pad_vocab(vocab, ours.get("make_vocab_size_divisible_by", 128), 1),
        params_dtype=dtype, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=1, expert_tensor_parallel_size=1, context_parallel_size=1,
        data_parallel_size=1, world_size=1, ckpt_format="torch_dist", iteration=iteration,
        consumed_train_samples=consumed_samples, consumed_valid_samples=0,
        virtual_pipeline_model_parallel_size=None, use_distributed_optimizer=False)
    if ours.get("num_experts"):
        values["moe_layer_freq"] = _layer_freq(ours.get("moe_layer_freq", "1"))
        values["moe_grouped_gemm"] = False
    return argparse.Namespace(**values)


def _layer_freq(text):
    text = str(text).strip()
    return int(text) if text.isdigit() else text


def pad_vocab(rows, divisible_by, tp):
    """Megatron's padded vocabulary: ``rows`` rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-rows // multiple) * multiple


# --- names ------------------------------------------------------------------------------------

def megatron_layer_name(local):
    """Megatron's stacked key of our layer-local name (``mlp.linear_fc1.weight``)."""
    return "decoder.layers." + LAYER_NAMES.get(local, (local,))[0]


def megatron_name(name):
    """Megatron's key of our non-layer name (embedding, final norm, output layer, MTP)."""
    mtp = _split_mtp_layer(name)
    if mtp is not None:  # one unstacked layer per depth, under megatron-core's GPT name
        return f"mtp.layers.{mtp[0]}.{MTP_LAYER}.{LAYER_NAMES.get(mtp[1], (mtp[1],))[0]}"
    return TOP_NAMES.get(name, name)


def _our_name(key):
    """Our name of Megatron's non-stacked key (the inverse of :func:`megatron_name`)."""
    parts = key.split(".", 4)
    if len(parts) == 5 and parts[:2] == ["mtp", "layers"] and parts[3] in (MTP_LAYER,
                                                                           "mtp_model_layer"):
        aliases = {alias: local for local, names in LAYER_NAMES.items() for alias in names}
        return f"mtp.layers.{parts[2]}.mtp_model_layer.{aliases.get(parts[4], parts[4])}"
    return {v: k for k, v in TOP_NAMES.items()}.get(key, key)


def _split_mtp_layer(name):
    """(depth, layer-local name) of ``mtp.layers.<k>.mtp_model_layer.<local>``, else None."""
    parts = name.split(".", 4)
    if len(parts) == 5 and parts[:2] == ["mtp", "layers"] and parts[3] == "mtp_model_layer":
        return int(parts[2]), parts[4]
    return None


def _split_layer(name):
    """(global layer, layer-local name) of ``decoder.layers.<l>.<local>``, else None."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        return int(parts[2]), parts[3]
    return None


# --- reading ----------------------------------------------------------------------------------

def _read_tensors(folder):
    """Every tensor of the DCP checkpoint in ``folder``, whole (``_extra_state`` and RNG
    objects are left out: the local spec's are empty, and RNG states do not carry over)."""
    reader = dcp.FileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    tensors = {key: torch.empty(md.size, dtype=md.properties.dtype)
               for key, md in saved.items() if isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process reads
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader, no_dist=True,
                 planner=DefaultLoadPlanner(flatten_state_dict=False,
                                            flatten_sharded_tensors=False))
    return tensors


def _unstack(stacked, prefix, num_layers, vocab_rows):
    """Our full weights from Megatron's keys under ``prefix`` ('' or 'optimizer.state.<kind>.')."""
    aliases = {alias: local for local, names in LAYER_NAMES.items() for alias in names}
    full = {}
    for key, tensor in stacked.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name.startswith("decoder.layers."):
            local = name[len("decoder.layers."):]
            local = aliases.get(local, local)
            assert tensor.shape[0] == num_layers, (key, tuple(tensor.shape), num_layers)
            for layer in range(num_layers):
                full[f"decoder.layers.{layer}.{local}"] = tensor[layer]
        else:
            name = _our_name(name)
            full[name] = tensor[:vocab_rows] if name in VOCAB_PARAMS and vocab_rows else tensor
    return full


def _layer_has(local, layer, args):
    """Whether layer ``layer`` of the model ``args`` describe has the param ``local``
    (with --moe-layer-freq, dense and MoE layers share the stacked tensors' layer axis)."""
    if not args.get("num_experts"):
        return True
    freq = str(args.get("moe_layer_freq", "1")).strip()
    if freq.isdigit():
        moe = layer % int(freq) == 0
    else:
        from megatron_cp.config.layer_pattern import parse_layer_freq
        moe = bool(parse_layer_freq(freq, args["num_layers"])[layer])
    is_moe_param = local.startswith(("mlp.router.", "mlp.experts.", "mlp.shared_experts."))
    is_dense_mlp = local.startswith(("mlp.linear_fc1.", "mlp.linear_fc2."))
    return (is_moe_param and moe) or (is_dense_mlp and not moe) or not (is_moe_param or is_dense_mlp)


def read(folder, vocab_rows=None):
    """``(full, optimizer, args, common)`` of the Megatron-LM iteration folder ``folder``:
    our full weights (``vocab_rows``: the real vocabulary rows kept; None: all), the full
    Adam moments by our kind (``{}`` when it saved none this reader knows), our argument
    dict and its common state as saved."""
    common = read_common(folder)
    args = our_args(common["args"])
    tensors = _read_tensors(folder)
    layers = args["num_layers"]

    def keep(full):
        return {name: t for name, t in full.items()
                if _split_layer(name) is None or _layer_has(_split_layer(name)[1],
                                                            _split_layer(name)[0], args)}

    full = keep(_unstack(tensors, "", layers, vocab_rows))
    full = {k: v for k, v in full.items() if not k.startswith("optimizer.")}
    if not args.get("untie_embeddings_and_output_weights"):
        full.pop("output_layer.weight", None)
    optimizer = {}
    for theirs, kind in OPTIMIZER_KINDS.items():
        prefix = f"optimizer.state.{theirs}."
        if any(key.startswith(prefix) for key in tensors):
            optimizer[kind] = keep(_unstack(tensors, prefix, layers, vocab_rows))
    return full, optimizer, args, common


def adam_step(common):
    """The Adam step count Megatron saved (``common_step``, or a param group's ``step``)."""
    opt = common.get("optimizer") or {}
    parts = [opt] if "param_groups" in opt or "state" in opt else list(opt.values())
    for part in parts:
        step = (part.get("state") or {}).get("common_step")
        if step is None:
            step = next((g["step"] for g in part.get("param_groups", []) if "step" in g), None)
        if step is not None:
            return float(step)
    return None


def scheduler_state(common, global_batch_size, counts_samples):
    """Megatron's ``opt_param_scheduler`` state in our units: its step counts are samples;
    ours are iterations unless the schedule counts samples."""
    saved = dict(common.get("opt_param_scheduler") or {})
    if saved.get("wd_incr_style") == "constant":  # the weight decay is --weight-decay throughout
        for key in ("start_wd", "end_wd", "wd_incr_steps"):
            saved.pop(key, None)
    if not counts_samples:
        for key in SAMPLE_COUNTS:
            if saved.get(key) is not None:
                saved[key] = saved[key] // global_batch_size
    return saved


# --- writing ----------------------------------------------------------------------------------

def _extra_state_bytes():
    """One ``_extra_state`` object as megatron-core stores a ShardedObject: a list holding
    the bytes of the object (None: the local spec's, and an idle TE module's, state)."""
    buffer = io.BytesIO()
    torch.save(None, buffer)
    buffer.seek(0)
    return [buffer]


def megatron_tensors(full, args):
    """Megatron's stacked tensors and ``_extra_state`` objects from our full weights
    ``full`` (real vocabulary rows; padded with zeros to Megatron's padded size)."""
    num_layers = args["num_layers"]
    per_layer, out = {}, {}
    for name, tensor in fp8_state.without_fp8(full).items():  # (see the module docstring)
        split = _split_layer(name)
        if split is None:
            if name in VOCAB_PARAMS:
                rows = pad_vocab(tensor.shape[0], args.get("make_vocab_size_divisible_by", 128), 1)
                tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0],
                                                             *tensor.shape[1:])])
            out[megatron_name(name)] = tensor.contiguous()
            continue
        per_layer.setdefault(split[1], {})[split[0]] = tensor
    for local, by_layer in per_layer.items():
        like = next(iter(by_layer.values()))
        stacked = like.new_zeros(num_layers, *like.shape)
        for layer, tensor in by_layer.items():
            stacked[layer] = tensor
        out[megatron_layer_name(local)] = stacked
    present = {megatron_layer_name(local) for local in per_layer}
    for module in EXTRA_STATE_LAYERS:
        if f"decoder.layers.{module}.weight" in present:
            for layer in range(num_layers):
                out[f"decoder.layers.{module}._extra_state/shard_{layer}_{num_layers}"] = \
                    _extra_state_bytes()
    experts = args.get("num_experts") or 0
    for depth in range(args.get("mtp_num_layers") or 0):  # unstacked: one shard of shape (1,)
        mtp = f"mtp.layers.{depth}"
        for module in ("eh_proj",) + tuple(f"{MTP_LAYER}.{m}" for m in EXTRA_STATE_LAYERS):
            if f"{mtp}.{module}.weight" in out:
                out[f"{mtp}.{module}._extra_state/shard_0_1"] = _extra_state_bytes()
        for module in EXPERT_EXTRA_STATE:
            if f"{mtp}.{MTP_LAYER}.{module}.weight" in out:
                for e in range(experts):
                    out[f"{mtp}.{MTP_LAYER}.{module}._extra_state/shard_{e}_{experts}"] = \
                        _extra_state_bytes()
    for module in EXPERT_EXTRA_STATE:
        if f"decoder.layers.{module}.weight" in present:
            for layer in range(num_layers):
                for e in range(experts):
                    key = f"decoder.layers.{module}._extra_state/shard_{layer}.{e}_{num_layers}.{experts}"
                    out[key] = _extra_state_bytes()
    return out


def write(folder, full, args, common):
    """Write ``full`` (and the non-tensor state ``common``) as Megatron-LM's iteration
    folder ``folder``: the DCP files, ``common.pt`` and ``metadata.json``."""
    os.makedirs(folder, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(megatron_tensors(full, args), storage_writer=dcp.FileSystemWriter(folder),
                 no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False,
                                                          flatten_sharded_tensors=False))
    torch.save(common, os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, METADATA_JSON), "w") as file:
        json.dump(BACKEND, file)


def scheduler_to_megatron(state, global_batch_size, counts_samples):
    """Our scheduler state in Megatron's units (its step counts are samples)."""
    saved = dict(state or {})
    if not counts_samples:
        for key in SAMPLE_COUNTS:
            if saved.get(key) is not None:
                saved[key] = saved[key] * global_batch_size
    return saved
