"""A ``--ckpt-format torch`` checkpoint read whole: every shard file of every model-parallel
rank merged into full tensors, so it loads into another layout than the one that saved it.

The torch format keeps one file per (TP, PP, EP, ETP) rank combination
(:mod:`megatron_cp.checkpointing`), each holding that rank's slices of the weights and their
optimizer state. :func:`read_torch_full` merges them into the full model under global layer
numbers (``decoder.layers.<global layer>...``), the real vocabulary rows only, and routed
experts whole (``[E, ...]``); the Adam moments (Muon's momentum) and fp32 main params are
merged the same way. The split of each name over TP / ETP is :func:`tp_spec`, which mirrors
the layers' own split at init.

Used by ``--load`` when the running layout differs from the saved one
(:func:`load_resharded`: each rank copies its pieces out of the full tensors, then the
load goes on as a torch_dist one) and by ``tools/checkpoint_convert.py``.
"""
import os
import re

import torch

from megatron_cp import checkpointing
from megatron_cp.dist_checkpoint import torch_dist
from megatron_cp.dist_checkpoint.canonical import canonical_from_full
from megatron_cp.dist_checkpoint.pieces import fill_from_full
from megatron_cp.optimizer.optimizer import group_key, group_order
from megatron_cp.tensor_parallel import merge_shards

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")  # [padded vocab, h]


def is_expert(name):
    """True for a routed expert's param (``mlp.experts.``; not the shared experts):
    ``[E, ...]``, split over EP along dim 0 and over ETP by :func:`tp_spec`."""
    return ".mlp.experts." in name or name.startswith("mlp.experts.")


def is_buffer(name):
    """True for a state-dict entry that is a buffer, not a param (no optimizer state)."""
    return name.endswith("router.expert_bias")


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
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return 0, 1
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return 0, 1
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


def chunk_states(payload):
    """The model state dicts of one shard file, one per virtual stage, in order."""
    keys = ["model"] if "model" in payload else sorted(
        (k for k in payload if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    return [payload[k] for k in keys]


def param_order(states, args):
    """The optimizer's order of one model-parallel rank's params: ``[(chunk, local name)]``
    by ``get_param_groups``' groups (over the chunks' state dicts, which hold exactly the
    params), and ``[(group key, size)]`` of the groups."""
    by_key = {}
    for c, state in enumerate(states):
        for name, tensor in state.items():
            if not is_buffer(name):
                key = group_key(name, tensor.dim(), is_expert(name), name in VOCAB_ROWS,
                                args.get("decoupled_lr") is not None,
                                args.get("optimizer") == "muon",
                                args.get("apply_wd_to_qk_layernorm", False))
                by_key.setdefault(key, []).append((c, name))
    keys = sorted(by_key, key=group_order)
    return [item for key in keys for item in by_key[key]], [(key, len(by_key[key])) for key in keys]


def saved_group_key(group):
    """A saved param group's key (older checkpoints: Adam, no decoupled rate)."""
    return group.get("optimizer", "adam"), group.get("wd_mult", 1.0), group.get("is_decoupled_lr",
                                                                                False)


def global_name(name, layers):
    """``decoder.layers.<local i>.x`` -> ``decoder.layers.<layers[i]>.x`` (others unchanged)."""
    m = LAYER.match(name)
    return f"decoder.layers.{layers[int(m.group(1))]}.{m.group(2)}" if m else name


def _merge(shards, args, sizes):
    """Full tensors (real vocabulary rows) from {name: {tp rank: shard}}, experts from
    {name: {(ep rank, etp rank): shard}}; ``sizes``: the source's (TP, PP, EP, ETP)."""
    tied = not args["untie_embeddings_and_output_weights"]
    true_vocab = args.get("true_vocab_size")
    tp, _, ep, etp = sizes
    full = {}
    for name, per_rank in shards.items():
        if tied and name == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding
        spec = tp_spec(name, args["swiglu"])
        if is_expert(name):  # [E/ep, ...] per EP rank, each split over ETP
            parts = [[per_rank[(e, t)] for t in range(etp)] for e in range(ep)]
            full[name] = torch.cat([merge_shards(p, *spec) if spec else p[0] for p in parts])
            continue
        parts = [per_rank[r] for r in range(tp)]
        full[name] = merge_shards(parts, *spec) if spec else parts[0]
        if name in VOCAB_ROWS and true_vocab:  # the padding depends on the TP size
            full[name] = full[name][:true_vocab]
    return full


def read_torch_full(load_dir, it):
    """``(full state dict, args dict, meta dict)`` of the torch-format checkpoint of
    iteration ``it`` under ``load_dir`` (every shard file is read, on CPU).

    ``meta``: ``iteration``, ``consumed_samples``, ``layout`` (the saved parallel layout),
    ``rng_from`` (the iteration folder, whose ``rng/`` holds each rank's RNG states) and, when
    the files hold optimizer state, ``optimizer`` ({kind: {name: full tensor}}),
    ``param_groups``, ``adam_step``, ``opt_param_scheduler``, ``grad_scaler`` and
    ``num_skipped_iters``."""
    root = checkpointing.iteration_dir(load_dir, it)
    first = checkpointing.load_file(checkpointing.latest_first_shard(load_dir, it), load_dir, it,
                                    keys=("args",))
    args = first["args"]
    sizes = checkpointing.file_layout(args)
    weights, moments, groups = {}, {}, None
    meta = {"iteration": first["iteration"], "consumed_samples": first["consumed_samples"]}
    for (tp_rank, _, ep_rank, etp_rank), shard in checkpointing.shard_names(*sizes).items():
        payload = checkpointing.load_file(os.path.join(root, shard, "model_optim_rng.pt"),
                                          load_dir, it, keys=("layer_numbers",))

        def key_of(name, expert_key=(ep_rank, etp_rank), tp_key=tp_rank):
            # a dense param is the same in every file of its TP rank, an expert in every file
            # of its (EP, ETP) rank: one copy per key
            return expert_key if is_expert(name) else tp_key

        states = chunk_states(payload)
        for state, layers in zip(states, payload["layer_numbers"]):
            for name, tensor in state.items():
                canon = global_name(name, layers)
                weights.setdefault(canon, {})[key_of(canon)] = tensor
        opt = payload.get("optimizer")
        if opt is None or payload.get("converted"):
            continue
        order, _ = param_order(states, args)
        for i, (c, name) in enumerate(order):
            canon = global_name(name, payload["layer_numbers"][c])
            per_param = opt["optimizer"]["state"].get(i, {})
            for kind, value in per_param.items():  # Adam's moments and step, Muon's momentum
                if kind == "step":
                    meta["adam_step"] = float(value)
                else:
                    moments.setdefault(kind, {}).setdefault(canon, {})[key_of(canon)] = value
            if opt["main_params"]:
                moments.setdefault("main_param", {}).setdefault(canon, {})[key_of(canon)] = \
                    opt["main_params"][i]
        groups = {**(groups or {}),
                  **{saved_group_key(g): {k: v for k, v in g.items() if k != "params"}
                     for g in opt["optimizer"]["param_groups"]}}
        meta.update(opt_param_scheduler=payload["opt_param_scheduler"],
                    grad_scaler=opt.get("grad_scaler"),
                    num_skipped_iters=opt.get("num_skipped_iters", 0))
    if groups is not None:
        meta["optimizer"] = {kind: _merge(per, args, sizes) for kind, per in moments.items() if per}
        meta["param_groups"] = list(groups.values())  # every stage's groups
        meta.setdefault("adam_step", 0.0)
    meta.update(layout=checkpointing.rank_grid(args), rng_from=root)
    return _merge(weights, args, sizes), args, meta


OPTIMIZER_META = ("opt_param_scheduler", "grad_scaler", "num_skipped_iters", "adam_step",
                  "param_groups")


def canonical_tensors(full, args, optimizer=None):
    """``{key: canonical tensor}`` as a torch_dist checkpoint holds them: ``model.<name>``
    from ``full`` and ``optimizer.<kind>.<name>`` from ``optimizer`` ({kind: {name: full
    tensor}}); a strided split gets its ``[stride, n/stride]`` dims back."""
    tensors = {f"model.{name}": canonical_from_full(t, tp_spec(name, args["swiglu"]))
               for name, t in full.items()}
    for kind, per in (optimizer or {}).items():
        for name, t in per.items():
            tensors[f"optimizer.{kind}.{name}"] = canonical_from_full(t, tp_spec(name, args["swiglu"]))
    return tensors


def common_state(args, meta):
    """The torch_dist ``common`` dict (non-tensor state) of a checkpoint read whole."""
    optimizer = meta.get("optimizer")
    common = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
              "args": args, "checkpoint_version": 3.0, "ckpt_format": "torch_dist",
              "layout": meta.get("layout"), "has_optimizer": bool(optimizer)}
    if optimizer:
        common.update({k: meta[k] for k in OPTIMIZER_META})
    return common


def load_resharded(trainer, root, it):
    """Load the torch checkpoint of iteration ``it`` under ``root`` into ``trainer``, whose
    layout differs from the saved one: every rank reads it whole (:func:`read_torch_full`)
    and copies out its pieces, then the load goes on as a torch_dist one (the weights, Adam
    state, schedule, iteration and samples carry; the RNG states cannot follow the ranks
    into another layout). Returns (iteration, consumed samples)."""
    full, args, meta = read_torch_full(root, it)
    tensors = canonical_tensors(full, args, meta.get("optimizer"))
    return torch_dist.load_state(trainer, root, it, common_state(args, meta),
                                 lambda state: fill_from_full(state, tensors))
