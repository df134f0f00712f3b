"""``--ckpt-format fsdp_dtensor``: Megatron-FSDP's checkpoint layout, written and read
through torch.distributed.checkpoint in any layout (DDP, the distributed optimizer, FSDP2;
any TP / DP / CP / EP). This module knows no other format.

What Megatron-LM's save writes (megatron/training/checkpointing.py: ``generate_state_dict``
and ``preprocess_fsdp_dtensor_state_dict``; megatron-core's
``transformer/fsdp_dtensor_checkpoint.py``), one DCP checkpoint per iteration folder, every
entry a flattened DCP key, no ``common.pt`` or ``metadata.json``:

- ``model.module.<name>``: the model's params and persistent buffers as global (TP-whole)
  tensors, ``module.module.`` with bf16/fp16 (its Float16Module wrapper). The weights are the
  fp32 main params (Megatron-FSDP's optimizer params); the vocabulary rows padded as
  Megatron-LM pads them; names are the module paths of its Transformer Engine layer spec
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight`` in a
  dense layer; ``--transformer-impl local``: ``input_layernorm.weight``,
  ``pre_mlp_layernorm.weight``) with global layer numbers, unstacked; no ``_extra_state``;
  SwiGLU's fc1 split in its gate and up halves, ``linear_fc1.weight_w`` and ``_v``; routed
  experts one key per global expert: ``mlp.experts.linear_fc1.weight<e>`` (its TE grouped
  GEMM, ``--moe-grouped-gemm``) or ``mlp.experts.local_experts.<e>.linear_fc1.weight``; an
  MTP depth's layer under ``mtp.layers.<k>.transformer_layer.``;
- ``optimizer.state.module.<model key>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` and
  ``optimizer.param_to_group_meta.module.<model key>.<setting>`` (the optimizer names a
  param one ``module.`` deeper than the model's state dict);
- ``args`` (its argument Namespace), ``checkpoint_version`` (3.0), ``iteration``,
  ``opt_param_scheduler.<key>`` (counted in samples), ``num_floating_point_operations_so_far``.

What megatron_cp adds, which Megatron-LM's load never asks for: ``megatron_cp``, the record
our formats keep (:func:`megatron_cp.checkpoint.state.common`: our arguments, the schedule
in our units, the Adam step, the loss scale, the rank grid), and every rank's RNG states
under ``rng/`` (Megatron-LM's are CUDA generator states: load ours there with
``--no-load-rng``). A checkpoint Megatron-LM wrote loads here too: its weights, Adam moments
and step, iteration, consumed samples and schedule (the RNG streams start afresh).

Megatron-LM's own fsdp_dtensor save of a SwiGLU model's optimizer state fails at this
commit (its split looks the param up one ``module.`` too shallow); the layout written here
splits the moments as it splits the weights, which is what that code means to do.
"""
import dataclasses
import itertools
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
from torch.distributed.checkpoint.planner_helpers import (_create_read_items, _create_write_items,
                                                          create_read_items_for_chunk_list)

from megatron_cp.checkpoint import dcp_files, files
from megatron_cp.checkpoint import megatron_lm_format as megatron_lm
from megatron_cp.checkpoint import state as training_state
from megatron_cp.checkpoint.canonical import VOCAB_PARAMS
from megatron_cp.checkpoint.pieces import Pieces, PiecesLoadPlanner, PiecesSavePlanner, check_saved

RECORD = "megatron_cp"
# our layer-local name -> Megatron-LM's under its Transformer Engine spec (and the condition)
_FUSED_NORMS = {"input_layernorm.": ("self_attention.linear_qkv.", "self_attention.linear_qkv.weight"),
                "pre_mlp_layernorm.": ("mlp.linear_fc1.", "mlp.linear_fc1.weight")}
_LAYER = re.compile(r"^((?:decoder\.layers\.\d+)|(?:mtp\.layers\.\d+\.mtp_model_layer))\.(.*)$")
_SWIGLU_FC1 = re.compile(r"(^|\.)(mlp|mlp\.shared_experts)\.linear_fc1\.(weight|bias)$")


def is_fsdp_dtensor(folder):
    """True if the iteration folder ``folder`` holds an fsdp_dtensor checkpoint (a DCP index
    with Megatron-LM's top-level ``checkpoint_version`` entry)."""
    if not os.path.exists(os.path.join(folder, ".metadata")) or \
            os.path.exists(os.path.join(folder, megatron_lm.METADATA_JSON)):
        return False
    try:
        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception:  # a damaged index: the torch_dist reader names it
        return False
    return "checkpoint_version" in saved


# --- names -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Naming:
    """How Megatron-LM names a model's tensors: its layer spec (``te``: Transformer Engine's
    fused norms), its experts (``grouped``: TE's grouped GEMM), SwiGLU's split fc1, and the
    wrapper prefix (``half``: its Float16Module)."""
    te: bool
    grouped: bool
    swiglu: bool
    half: bool

    @classmethod
    def of(cls, args):
        """The naming of the run whose arguments (a dict of our saved ones) are ``args``."""
        return cls(te=args.get("transformer_impl", "transformer_engine") == "transformer_engine",
                   grouped=bool(args.get("moe_grouped_gemm")), swiglu=bool(args.get("swiglu")),
                   half=bool(args.get("bf16") or args.get("fp16")))

    @property
    def model_prefix(self):
        return "model.module.module." if self.half else "model.module."

    @property
    def optimizer_prefix(self):
        return "optimizer.state.module.module.module." if self.half else \
            "optimizer.state.module.module."

    def splits(self, name, names):
        """``(dims, key)`` of our canonical ``name``: its tensor is cut along its first
        ``dims`` dims into Megatron-LM's tensors, ``key(index)`` naming each (``names``: every
        canonical name of the model, which tells a layer's kind)."""
        m = _LAYER.match(name)
        if not m:
            top = megatron_lm.TOP_NAMES.get(name, name)
            return 0, lambda index: top
        layer, local = m.groups()
        on_disk = layer.replace(".mtp_model_layer", f".{megatron_lm.MTP_LAYER}")
        for ours, (fused, beside) in _FUSED_NORMS.items():
            if self.te and local.startswith(ours) and f"{layer}.{beside}" in names:
                local = fused + "layer_norm_" + local[len(ours):]
        if local.startswith("mlp.experts."):
            module, kind = local[len("mlp.experts."):].rsplit(".", 1)  # linear_fc1, weight
            halves = self.swiglu and module == "linear_fc1"

            def expert_key(index):
                w = ("_w", "_v")[index[1]] if halves else ""
                leaf = (f"mlp.experts.{module}.{kind}{index[0]}" if self.grouped else
                        f"mlp.experts.local_experts.{index[0]}.{module}.{kind}")
                return f"{on_disk}.{leaf}{w}"
            return (2 if halves else 1), expert_key
        if self.swiglu and _SWIGLU_FC1.search(local):
            return 1, lambda index: f"{on_disk}.{local}{('_w', '_v')[index[0]]}"
        return 0, lambda index: f"{on_disk}.{local}"


def _split(pieces, dims):
    """{index: Pieces} of ``pieces`` cut along its first ``dims`` dims (views of its boxes)."""
    if dims == 0:
        return {(): pieces}
    cut = {}
    for offsets, tensor in pieces.boxes:
        ranges = [range(offsets[d], offsets[d] + tensor.shape[d]) for d in range(dims)]
        for index in itertools.product(*ranges):
            local = tuple(i - offsets[d] for d, i in enumerate(index))
            cut.setdefault(index, []).append((offsets[dims:], tensor[local]))
    return {index: Pieces(pieces.global_shape[dims:], boxes) for index, boxes in cut.items()}


def _kind_and_name(key):
    """``("model", name)`` or ``(kind, name)`` of our canonical state key."""
    if key.startswith("model."):
        return "model", key[len("model."):]
    _, kind, name = key.split(".", 2)
    return kind, name


def _on_disk(state, naming):
    """``[(fqn, our key, Pieces)]``: our canonical ``state`` (``{key: Pieces}``) as
    Megatron-LM's tensors: a weight and its fp32 main param (``optimizer.main_param.``) both
    under the weight's key (a save keeps the master, a load fills both from it)."""
    names = {_kind_and_name(key)[1] for key in state}
    out = []
    for key, pieces in state.items():
        kind, name = _kind_and_name(key)
        dims, megatron_key = naming.splits(name, names)
        for index, part in _split(pieces, dims).items():
            local = megatron_key(index)
            fqn = (naming.model_prefix + local if kind in ("model", "main_param")
                   else f"{naming.optimizer_prefix}{local}.{kind}")
            out.append((fqn, key, part))
    return out


# --- saving --------------------------------------------------------------------------------

class _SavePlanner(PiecesSavePlanner):
    """DCP's default save planner over :class:`Pieces` and plain objects (bytes entries)."""

    def create_local_plan(self):
        items = []
        for fqn, value in self.state_dict.items():
            items += value.write_items(fqn) if isinstance(value, Pieces) else \
                _create_write_items(fqn, value)
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index):
        value = self.state_dict[index.fqn]
        return value.piece_at(index) if isinstance(value, Pieces) else value


def _megatron_args(train_state, ckpt, record):
    """The argument Namespace Megatron-LM saves, from our saved arguments."""
    census = megatron_lm.megatron_census_defaults()
    args = megatron_lm.megatron_args(record["args"], census, record["iteration"],
                                     record["consumed_samples"])
    parallel = ckpt.parallel
    vars(args).update(
        ckpt_format="fsdp_dtensor", use_megatron_fsdp=True, use_distributed_optimizer=True,
        data_parallel_sharding_strategy=record["args"].get("data_parallel_sharding_strategy"),
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        world_size=train_state.parallel_state.world_size)
    return args


def _groups_by_name(train_state):
    """{canonical name: its param group's settings} of this rank's optimizer shards."""
    inner = train_state.optimizer.optimizer
    by_storage = {}
    for group in getattr(inner, "param_groups", []):
        settings = {k: v for k, v in group.items() if k != "params"}
        for param in group["params"]:
            moment = getattr(inner, "state", {}).get(param, {}).get("exp_avg")
            if moment is not None:
                by_storage[moment.untyped_storage().data_ptr()] = settings
    specs = training_state._param_specs(train_state)
    out = {}
    for shard in train_state.optimizer.param_shards():
        moment = shard.state.get("exp_avg")
        if moment is not None:
            out[specs[id(shard.model_param)][0].name] = by_storage.get(
                moment.untyped_storage().data_ptr(), {})
    return out


def _group_meta(optimizer, group):
    """A param's group settings as Megatron-LM's optimizer keeps them (torch's AdamW under
    its DistributedOptimizer); ``optimizer``: the run's optimizer section."""
    meta = {"wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
            "is_expert_parallel": False, "default_config": True, "max_lr": optimizer.lr,
            "min_lr": optimizer.min_lr, "lr": optimizer.lr,
            "betas": (optimizer.adam_beta1, optimizer.adam_beta2), "eps": optimizer.adam_eps,
            "weight_decay": optimizer.weight_decay, "amsgrad": False, "maximize": False,
            "foreach": None, "capturable": False, "differentiable": False, "fused": None,
            "decoupled_weight_decay": True}
    meta.update({k: v for k, v in group.items() if k in meta})
    return meta


def save(train_state, ckpt, root):
    """Save ``train_state`` under ``root`` (every rank calls it) as the checkpoint section
    (``ckpt.checkpoint``) says (``--no-save-optim``, ``--no-save-rng``, ``--async-save``:
    returns the save in flight, else None); see the module docstring."""
    checkpoint = ckpt.checkpoint
    train_state.optimizer.finish_param_sync()
    with_optimizer = not checkpoint.no_save_optim
    ours = training_state.sharded_state(train_state, True, padded_vocab=True)
    if not with_optimizer:  # the masters stay: they are the saved weights
        ours = {k: v for k, v in ours.items()
                if _kind_and_name(k)[0] in ("model", "main_param")}
    record = {**training_state.common(train_state, ckpt, with_optimizer),
              "ckpt_format": "fsdp_dtensor"}
    naming = Naming.of(record["args"])
    entries = [(fqn, key, pieces) for fqn, key, pieces in _on_disk(ours, naming)
               if not key.startswith("model.") or f"optimizer.main_param.{key[6:]}" not in ours]
    state = {fqn: pieces for fqn, _, pieces in entries}
    if with_optimizer:
        step = torch.tensor(record["adam_step"], dtype=torch.float32)
        groups = _groups_by_name(train_state)
        for fqn, key, _ in entries:
            if fqn.endswith(".exp_avg"):
                base = fqn[:-len(".exp_avg")]
                state[f"{base}.step"] = Pieces((), [((), step)])
                meta = "optimizer.param_to_group_meta." + base[len("optimizer.state."):]
                group = groups.get(_kind_and_name(key)[1], {})
                for setting, value in _group_meta(ckpt.optimizer_config, group).items():
                    state[f"{meta}.{setting}"] = value
        schedule = megatron_lm.scheduler_to_megatron(
            record["opt_param_scheduler"], record["args"].get("global_batch_size") or 1,
            ckpt.optimizer_config.lr_counts_samples)
        state.update({f"opt_param_scheduler.{k}": v for k, v in schedule.items()})
    state.update({"args": _megatron_args(train_state, ckpt, record), "checkpoint_version": 3.0,
                  "iteration": record["iteration"], RECORD: record,
                  "num_floating_point_operations_so_far": 0})
    return dcp_files.write(train_state, ckpt, root, state, _SavePlanner)


# --- loading -------------------------------------------------------------------------------

def _strip(fqn):
    """``(section, name)`` of a saved key, its wrapper prefixes dropped: ``("model",
    "decoder.layers.0...")``, ``("optimizer", "<name>.exp_avg")``, or ``(None, fqn)``."""
    for section, prefix in (("model", "model."), ("optimizer", "optimizer.state.")):
        if fqn.startswith(prefix):
            rest = fqn[len(prefix):]
            while rest.startswith("module."):
                rest = rest[len("module."):]
            return section, rest
    return None, fqn


class _Entry:
    """One tensor to read: the saved key ``fqn`` into this rank's ``pieces``."""

    def __init__(self, fqn, pieces):
        self.fqn, self.pieces = fqn, pieces


class _LoadPlanner(PiecesLoadPlanner):
    """Reads each :class:`_Entry` (``{our unique key: _Entry}``) from its saved key, and the
    plain objects ``objects`` (their values land in ``self.objects``)."""

    def __init__(self, objects=()):
        super().__init__()
        self.wanted, self.objects = list(objects), {}

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata
        requests = []
        for dest, entry in self.state_dict.items():
            md, pieces = saved[entry.fqn], entry.pieces
            shape = torch.Size(md.size)
            if entry.fqn.endswith(tuple(f".{v}{s}" for v in VOCAB_PARAMS for s in
                                        ("", ".exp_avg", ".exp_avg_sq"))) \
                    and shape[1:] == pieces.global_shape[1:] and shape[0] >= pieces.global_shape[0]:
                pieces = Pieces(shape, pieces.boxes)  # its padded rows are not read
            check_saved(entry.fqn, shape, pieces)
            for item in create_read_items_for_chunk_list(entry.fqn, md, pieces.chunks()):
                requests.append(dataclasses.replace(
                    item, dest_index=dataclasses.replace(item.dest_index, fqn=dest)))
        for fqn in self.wanted:
            requests += _create_read_items(fqn, saved[fqn], None)
        return LoadPlan(requests)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn].pieces.piece_at(index)

    def load_bytes(self, read_item, value):
        self.objects[read_item.dest_index.fqn] = torch.load(
            value, map_location="cpu", weights_only=False, pickle_module=megatron_lm._PickleModule)


def _read(folder, group, entries=None, objects=()):
    """Read ``entries`` ({dest: _Entry}) and the plain ``objects`` of ``folder``; returns
    the objects."""
    planner = _LoadPlanner(objects)
    dcp_files.read_dcp(folder, entries or {}, planner, group)
    return planner.objects


def _megatron_record(objects, saved, lr_counts_samples):
    """Our record of a checkpoint Megatron-LM wrote (its ``args``, ``iteration``, schedule)."""
    args = megatron_lm.our_args(objects["args"])
    schedule = {k[len("opt_param_scheduler."):]: v for k, v in objects.items()
                if k.startswith("opt_param_scheduler.")}
    has_optimizer = any(_strip(k)[0] == "optimizer" for k in saved)
    return {"iteration": int(objects["iteration"]),
            "consumed_samples": int(args.get("consumed_train_samples") or 0), "args": args,
            "has_optimizer": has_optimizer and bool(schedule), "layout": None,
            "opt_param_scheduler": megatron_lm.scheduler_state(
                {"opt_param_scheduler": schedule}, args["global_batch_size"],
                lr_counts_samples),
            "adam_step": None, "param_groups": [], "num_skipped_iters": 0}


def load(train_state, ckpt, root, it):
    """Load the fsdp_dtensor checkpoint of iteration ``it`` under ``root`` (ours or
    Megatron-LM's) into ``train_state``, whatever layout saved it; returns (iteration,
    consumed samples)."""
    folder = files.iteration_dir(root, it)
    dcp_files.check_files(folder)
    group = ckpt.group()
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    if RECORD in saved:
        record = _read(folder, group, objects=[RECORD])[RECORD]
    else:
        wanted = ["args", "iteration"] + [k for k in saved if k.startswith("opt_param_scheduler.")]
        record = _megatron_record(_read(folder, group, objects=wanted), saved,
                                  ckpt.optimizer_config.lr_counts_samples)
    checkpoint = ckpt.checkpoint
    naming = Naming.of(record["args"])
    by_name = {}
    for fqn in saved:
        section, name = _strip(fqn)
        if section is not None:
            by_name[(section, name)] = fqn

    def read(state):
        entries, steps = {}, []
        for fqn, key, pieces in _on_disk(state, naming):
            section, name = _strip(fqn)
            found = by_name.get((section, name))
            if found is None:
                if section == "model" or checkpoint.strict_fsdp_dtensor_load:
                    raise ValueError(f"the fsdp_dtensor checkpoint {folder} has no {fqn} (for "
                                     f"our {key}): it was saved from another model, or without "
                                     f"it" + ("" if section == "model" else
                                              "; --no-strict-fsdp-dtensor-load starts it afresh"))
                continue
            entries[f"{key}|{fqn}"] = _Entry(found, pieces)
            if section == "optimizer" and name.endswith(".exp_avg") and not steps:
                step_fqn = by_name.get((section, name[:-len("exp_avg")] + "step"))
                if step_fqn is not None:
                    steps.append(step_fqn)
        step = torch.zeros(())
        if steps and record["adam_step"] is None:
            entries["step"] = _Entry(steps[0], Pieces((), [((), step)]))
        _read(folder, group, entries)
        if record["adam_step"] is None:
            record["adam_step"] = float(step) if steps else 0.0

    # Megatron-LM's keeps FP8 state in Transformer Engine's _extra_state, which it leaves out
    return training_state.restore(train_state, ckpt, root, it, record, read,
                                  saved_fp8=RECORD in saved)


def saved_args(folder):
    """Our argument dict of the fsdp_dtensor checkpoint in ``folder`` (one process, no
    process group: --use-checkpoint-args reads it before any starts)."""
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    planner = _LoadPlanner([RECORD] if RECORD in saved else ["args"])
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process reads
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({}, storage_reader=dcp.FileSystemReader(folder), planner=planner, no_dist=True)
    if RECORD in planner.objects:
        return planner.objects[RECORD]["args"]
    return megatron_lm.our_args(planner.objects["args"])
