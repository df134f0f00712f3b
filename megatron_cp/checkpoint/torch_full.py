"""A ``--ckpt-format torch`` checkpoint read whole: every shard file of every model-parallel
rank merged into full tensors, so it loads into another layout than the one that saved it.

The torch format keeps one file per (TP, PP, EP, ETP) rank combination
(:mod:`megatron_cp.checkpoint.torch_shards`), each holding that rank's slices of the weights
and their optimizer state. :func:`read_torch_full` merges them into the full model under
global layer numbers (``decoder.layers.<global layer>...``), the real vocabulary rows only,
and routed experts whole (``[E, ...]``); the Adam moments (Muon's momentum) and fp32 main
params are merged the same way. The split of each name over TP / ETP is
:func:`~megatron_cp.checkpoint.canonical.tp_spec`.

Used by the torch format's load when the running layout differs from the saved one
(:func:`megatron_cp.checkpoint.torch_format.load_resharded`) and by
``tools/checkpoint_convert.py``.
"""
import os
import re

import torch

from megatron_cp.checkpoint import files, torch_shards
from megatron_cp.checkpoint.canonical import (VOCAB_PARAMS, canonical_name, is_buffer, is_expert,
                                              tp_spec)
from megatron_cp.optimizer.optimizer import group_key, group_order
from megatron_cp.tensor_parallel import merge_shards


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
                key = group_key(name, tensor.dim(), is_expert(name), name in VOCAB_PARAMS,
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


def _merge(shards, args, sizes):
    """Full tensors (real vocabulary rows) from {name: {tp rank: shard}}, experts from
    {name: {(ep rank, etp rank): shard}}; ``sizes``: the source's (TP, PP, EP, ETP)."""
    tied = not args["untie_embeddings_and_output_weights"]
    true_vocab = args.get("true_vocab_size")
    tp, _, ep, etp = sizes
    full = {}
    for name, per_rank in shards.items():
        if name == "mtp_word_embeddings.weight" or (tied and name == "output_layer.weight"):
            continue  # the last stage's copy of the embedding (tied output layer, MTP's table)
        spec = tp_spec(name, args["swiglu"])
        if is_expert(name):  # [E/ep, ...] per EP rank, each split over ETP
            parts = [[per_rank[(e, t)] for t in range(etp)] for e in range(ep)]
            full[name] = torch.cat([merge_shards(p, *spec) if spec else p[0] for p in parts])
            continue
        parts = [per_rank[r] for r in range(tp)]
        full[name] = merge_shards(parts, *spec) if spec else parts[0]
        if name in VOCAB_PARAMS and true_vocab:  # the padding depends on the TP size
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
    root = files.iteration_dir(load_dir, it)
    first = files.load_file(torch_shards.first_file(root), load_dir, it, keys=("args",))
    args = first["args"]
    sizes = torch_shards.file_layout(args)
    weights, moments, groups = {}, {}, None
    meta = {"iteration": first["iteration"], "consumed_samples": first["consumed_samples"]}
    for (tp_rank, _, ep_rank, etp_rank), shard in torch_shards.shard_names(*sizes).items():
        payload = files.load_file(os.path.join(root, shard, torch_shards.SHARD_FILE),
                                  load_dir, it, keys=("layer_numbers",))

        def key_of(name, expert_key=(ep_rank, etp_rank), tp_key=tp_rank):
            # a dense param is the same in every file of its TP rank, an expert in every file
            # of its (EP, ETP) rank: one copy per key
            return expert_key if is_expert(name) else tp_key

        states = chunk_states(payload)
        for state, layers in zip(states, payload["layer_numbers"]):
            for name, tensor in state.items():
                canon = canonical_name(name, layers)
                weights.setdefault(canon, {})[key_of(canon)] = tensor
        opt = payload.get("optimizer")
        if opt is None or payload.get("converted"):
            continue
        order, _ = param_order(states, args)
        for i, (c, name) in enumerate(order):
            canon = canonical_name(name, payload["layer_numbers"][c])
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
    meta.update(layout=files.rank_grid(args), rng_from=root)
    return _merge(weights, args, sizes), args, meta


OPTIMIZER_META = ("opt_param_scheduler", "grad_scaler", "num_skipped_iters", "adam_step",
                  "param_groups")


def common_state(args, meta):
    """The :func:`megatron_cp.checkpoint.state.common` record of a checkpoint read whole."""
    optimizer = meta.get("optimizer")
    common = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
              "args": args, "checkpoint_version": 3.0,
              "layout": meta.get("layout"), "has_optimizer": bool(optimizer)}
    if optimizer:
        common.update({k: meta[k] for k in OPTIMIZER_META})
    return common
