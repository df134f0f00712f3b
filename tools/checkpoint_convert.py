"""Convert megatron_cp checkpoints between formats and layouts, and to/from Hugging Face.

    # torch (per model-parallel rank) <-> torch_dist (layout-free); everything is carried:
    # weights, Adam moments, fp32 main params, schedule, loss scale, RNG
    python tools/checkpoint_convert.py --load-dir ck --save-dir ck_dist --target-ckpt-format torch_dist
    python tools/checkpoint_convert.py --load-dir ck_dist --save-dir ck2 \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    # TP=2, PP=1 torch checkpoint -> TP=1, PP=2 (weights only: the optimizer starts fresh)
    python tools/checkpoint_convert.py --load-dir ck --save-dir ck_pp2 \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2
    # to a Hugging Face folder with the tokenizer files: LlamaForCausalLM for RMSNorm + SwiGLU +
    # RoPE + no biases, GPT2LMHeadModel for Megatron's defaults (LayerNorm, GELU, learned
    # positions, biases); the checkpoint's arguments say which
    python tools/checkpoint_convert.py --load-dir ck --to-hf hf_out
    # from a Hugging Face Llama or GPT-2 folder (config.json's model_type) to a checkpoint
    python tools/checkpoint_convert.py --from-hf hf_out --save-dir ck2 --target-tensor-parallel-size 2

The input format is detected. The full (unsharded) model is assembled on CPU under
canonical names (``decoder.layers.<global layer>...``), with the real vocabulary rows only,
then written for the target: split for a TP/PP layout with the same split the layers use at
init (torch), or in the canonical form any layout loads (torch_dist, no layout to choose).
torch -> torch resharding writes weights only (``converted: True``): the optimizer and RNG
start fresh, at the saved iteration, samples and learning rate. A conversion from or to
torch_dist carries the optimizer state too; RNG states follow when the layout is unchanged.
"""
import argparse
import os
import re
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_cp import checkpointing  # noqa: E402
from megatron_cp.dist_checkpoint import full as dist_full  # noqa: E402
from megatron_cp.dist_checkpoint.canonical import (canonical_from_full,  # noqa: E402
                                                   full_from_canonical)
from megatron_cp.dist_checkpoint.torch_dist import is_torch_dist, layout_of  # noqa: E402
from megatron_cp.optimizer.optimizer import no_weight_decay  # noqa: E402
from megatron_cp.tensor_parallel import merge_shards, split_full  # noqa: E402

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")  # [padded vocab, h]
KINDS = ("exp_avg", "exp_avg_sq", "main_param")


def tp_spec(name, swiglu):
    """(partition_dim, stride) of a TP-sharded parameter name, or None when replicated.

    Mirrors the layers: column-parallel weights split dim 0 (SwiGLU's fc1 stacks gate and up,
    stride 2), row-parallel weights dim 1, the vocab-parallel embedding and output dim 0.
    """
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return 0, 1
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return 0, 1
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return 0, 2 if swiglu else 1
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1, 1
    return None


def _chunk_states(payload):
    keys = ["model"] if "model" in payload else sorted(
        (k for k in payload if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    return [payload[k] for k in keys]


def param_order(states):
    """The optimizer's order of one model-parallel rank's params: ``[(chunk, local name)]``,
    weight-decay group first (``get_param_groups``' rule over the chunks' state dicts,
    which hold exactly the params), and the two group sizes."""
    decay, no_decay = [], []
    for c, state in enumerate(states):
        for name, tensor in state.items():
            (no_decay if no_weight_decay(name, tensor.dim()) else decay).append((c, name))
    return decay + no_decay, [len(g) for g in (decay, no_decay) if g]


def _global_name(name, layers):
    m = LAYER.match(name)
    return f"decoder.layers.{layers[int(m.group(1))]}.{m.group(2)}" if m else name


def _merge(shards, args, tp):
    """Full tensors (real vocabulary rows) from {name: {tp rank: shard}}."""
    tied = not args["untie_embeddings_and_output_weights"]
    true_vocab = args.get("true_vocab_size")
    full = {}
    for name, per_rank in shards.items():
        if tied and name == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding
        spec = tp_spec(name, args["swiglu"])
        parts = [per_rank[r] for r in range(tp)]
        full[name] = merge_shards(parts, *spec) if spec else parts[0]
        if name in VOCAB_ROWS and true_vocab:  # the padding depends on the TP size
            full[name] = full[name][:true_vocab]
    return full


def _load_torch(load_dir, it):
    root = checkpointing.iteration_dir(load_dir, it)
    first = torch.load(checkpointing.latest_first_shard(load_dir), map_location="cpu",
                       weights_only=False)
    args = first["args"]
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    weights, moments, groups = {}, {kind: {} for kind in KINDS}, None
    meta = {"iteration": first["iteration"], "consumed_samples": first["consumed_samples"]}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            path = os.path.join(root, checkpointing.shard_name(tp_rank, pp_rank, pp), "model_optim_rng.pt")
            payload = torch.load(path, map_location="cpu", weights_only=False)
            states = _chunk_states(payload)
            for state, layers in zip(states, payload["layer_numbers"]):
                for name, tensor in state.items():
                    weights.setdefault(_global_name(name, layers), {})[tp_rank] = tensor
            opt = payload.get("optimizer")
            if opt is None or payload.get("converted"):
                continue
            order, _ = param_order(states)
            for i, (c, name) in enumerate(order):
                canon = _global_name(name, payload["layer_numbers"][c])
                per_param = opt["optimizer"]["state"].get(i)
                if per_param is not None:
                    for kind in ("exp_avg", "exp_avg_sq"):
                        moments[kind].setdefault(canon, {})[tp_rank] = per_param[kind]
                    meta["adam_step"] = float(per_param["step"])
                if opt["main_params"]:
                    moments["main_param"].setdefault(canon, {})[tp_rank] = opt["main_params"][i]
            groups = [{k: v for k, v in g.items() if k != "params"}
                      for g in opt["optimizer"]["param_groups"]]
            meta.update(opt_param_scheduler=payload["opt_param_scheduler"],
                        grad_scaler=opt.get("grad_scaler"),
                        num_skipped_iters=opt.get("num_skipped_iters", 0))
    if groups is not None:
        meta["optimizer"] = {kind: _merge(per, args, tp) for kind, per in moments.items() if per}
        meta["param_groups"] = groups
        meta.setdefault("adam_step", 0.0)
    meta.update(layout=layout_of(args), rng_from=root)
    return _merge(weights, args, tp), args, meta


def _load_torch_dist(folder):
    tensors, common = dist_full.read_full(folder)
    args = common["args"]
    full, moments = {}, {kind: {} for kind in KINDS}
    for key, tensor in tensors.items():
        section, rest = key.split(".", 1)
        kind, name = ("model", rest) if section == "model" else rest.split(".", 1)
        value = full_from_canonical(tensor, tp_spec(name, args["swiglu"]))
        (full if kind == "model" else moments[kind])[name] = value
    meta = {"iteration": common["iteration"], "consumed_samples": common["consumed_samples"],
            "layout": common.get("layout"), "rng_from": folder}
    if common.get("has_optimizer"):
        meta.update(optimizer={k: v for k, v in moments.items() if v},
                    **{k: common.get(k) for k in ("opt_param_scheduler", "grad_scaler",
                                                   "num_skipped_iters", "adam_step", "param_groups")})
    return full, args, meta


def load_full(load_dir):
    """Assemble the full model of the latest checkpoint (either format): (state dict, args
    dict, meta dict). The vocabulary rows are the real ones (``true_vocab_size``), without
    the TP padding; ``meta["optimizer"]`` holds the full Adam moments (and fp32 main
    params) in the same form, when the checkpoint has them."""
    it = checkpointing.read_tracker(load_dir)
    if it is None:
        raise ValueError(f"{load_dir} has no {checkpointing.TRACKER}: not a megatron_cp checkpoint")
    folder = checkpointing.iteration_dir(load_dir, it)
    return _load_torch_dist(folder) if is_torch_dist(folder) else _load_torch(load_dir, it)


def pad_vocab_rows(full, args, tp):
    """``full`` with the vocabulary rows zero-padded as a TP=``tp`` model pads them."""
    from megatron_cp.model import pad_vocab_size
    rows = args.get("true_vocab_size") or full["embedding.word_embeddings.weight"].shape[0]
    padded = pad_vocab_size(rows, args.get("make_vocab_size_divisible_by", 128), tp)
    out = dict(full)
    for name in VOCAB_ROWS:
        if name in out:
            weight = out[name][:rows]
            out[name] = torch.cat([weight, weight.new_zeros(padded - weight.shape[0],
                                                            *weight.shape[1:])])
    return out


def _optimizer_payload(states, layer_numbers, optimizer, meta, args, tp, tp_rank):
    """The MixedPrecisionOptimizer state dict of one target rank, from full moments."""
    order, sizes = param_order(states)
    tied = not args["untie_embeddings_and_output_weights"]

    def shard(kind, c, name):
        canon = _global_name(name, layer_numbers[c])
        if tied and canon == "output_layer.weight":
            canon = "embedding.word_embeddings.weight"
        spec = tp_spec(name, args["swiglu"])
        value = optimizer[kind][canon]
        return split_full(value, spec[0], spec[1], tp, tp_rank).clone() if spec else value.clone()

    step = torch.tensor(meta["adam_step"], dtype=torch.float32)
    state = {} if not meta["adam_step"] else {
        i: {"step": step.clone(), "exp_avg": shard("exp_avg", c, n), "exp_avg_sq": shard("exp_avg_sq", c, n)}
        for i, (c, n) in enumerate(order)}
    hyper = {g.get("wd_mult", 1.0): g for g in meta["param_groups"]}
    groups, start = [], 0
    for size, wd_mult in zip(sizes, (1.0, 0.0) if len(sizes) == 2 else (None,)):
        group = hyper.get(wd_mult, meta["param_groups"][0])
        groups.append({**group, "params": list(range(start, start + size))})
        start += size
    mains = [shard("main_param", c, n) for c, n in order] if "main_param" in optimizer else []
    return {"optimizer": {"state": state, "param_groups": groups}, "grad_scaler": meta["grad_scaler"],
            "main_params": mains, "num_skipped_iters": meta["num_skipped_iters"]}


def save_layout(full, args, meta, save_dir, tp, pp, vp_layers=None, first=None, last=None,
                with_optimizer=False):
    """Write ``full`` as a torch-format checkpoint for TP=tp, PP=pp (optionally virtual
    stages); ``with_optimizer`` also writes ``meta``'s optimizer state and schedule."""
    args = dict(args, true_vocab_size=args.get("true_vocab_size") or
                full["embedding.word_embeddings.weight"].shape[0])
    full = pad_vocab_rows(full, args, tp)
    optimizer = None
    if with_optimizer and meta.get("optimizer"):
        optimizer = {kind: pad_vocab_rows(per, args, tp) for kind, per in meta["optimizer"].items()}
    from megatron_cp.pipeline_parallel.stages import chunk_layer_numbers, virtual_pipeline_size
    num_layers = args["num_layers"]
    vp = virtual_pipeline_size(num_layers, pp, vp_layers) if vp_layers else None
    tied = not args["untie_embeddings_and_output_weights"]
    new_args = dict(args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    padded_vocab_size=full["embedding.word_embeddings.weight"].shape[0],
                    num_layers_per_virtual_pipeline_stage=vp_layers,
                    decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last)
    root = checkpointing.iteration_dir(save_dir, meta["iteration"])
    same_layout = optimizer is not None and layout_of(new_args) == meta.get("layout")
    for pp_rank in range(pp):
        chunks = chunk_layer_numbers(num_layers, pp, pp_rank, vp, first, last)
        for tp_rank in range(tp):
            states = []
            for c, layers in enumerate(chunks):
                pre = pp_rank == 0 and c == 0
                post = pp_rank == pp - 1 and c == len(chunks) - 1
                wanted = {}
                for name, tensor in full.items():
                    m = LAYER.match(name)
                    if m:
                        if int(m.group(1)) in layers:
                            wanted[f"decoder.layers.{layers.index(int(m.group(1)))}.{m.group(2)}"] = tensor
                    elif name.startswith("embedding.") and pre:
                        wanted[name] = tensor
                    elif name.startswith(("final_layernorm.", "output_layer.")) and post:
                        wanted[name] = tensor
                if post and tied and not pre:  # the last stage's tied copy
                    wanted["output_layer.weight"] = full["embedding.word_embeddings.weight"]
                state = {}
                for name, tensor in wanted.items():
                    spec = tp_spec(name, args["swiglu"])
                    state[name] = split_full(tensor, spec[0], spec[1], tp, tp_rank).clone() \
                        if spec else tensor.clone()
                states.append(state)
            payload = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
                       "args": new_args, "checkpoint_version": 3.0,
                       "layer_numbers": [list(layers) for layers in chunks]}
            if optimizer is None:
                payload["converted"] = True
            else:
                payload.update(optimizer=_optimizer_payload(states, payload["layer_numbers"],
                                                            optimizer, meta, args, tp, tp_rank),
                               opt_param_scheduler=meta["opt_param_scheduler"],
                               no_rng=not same_layout)
            if len(states) == 1:
                payload["model"] = states[0]
            else:
                payload.update({f"model{i}": s for i, s in enumerate(states)})
            shard = os.path.join(root, checkpointing.shard_name(tp_rank, pp_rank, pp))
            os.makedirs(shard, exist_ok=True)
            checkpointing._atomic_torch_save(payload, os.path.join(shard, "model_optim_rng.pt"))
    rng = os.path.join(meta.get("rng_from") or "", "rng")
    if same_layout and os.path.isdir(rng):
        shutil.copytree(rng, os.path.join(root, "rng"), dirs_exist_ok=True)
    checkpointing._atomic_write_text(os.path.join(save_dir, checkpointing.TRACKER),
                                     str(meta["iteration"]))


def save_torch_dist(full, args, meta, save_dir):
    """Write ``full`` (and ``meta``'s optimizer state) as a torch_dist checkpoint, which any
    layout loads."""
    args = dict(args, true_vocab_size=args.get("true_vocab_size") or
                full["embedding.word_embeddings.weight"].shape[0])
    tensors = {f"model.{name}": canonical_from_full(t, tp_spec(name, args["swiglu"]))
               for name, t in full.items()}
    optimizer = meta.get("optimizer")
    for kind, per in (optimizer or {}).items():
        for name, t in per.items():
            tensors[f"optimizer.{kind}.{name}"] = canonical_from_full(t, tp_spec(name, args["swiglu"]))
    common = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
              "args": args, "checkpoint_version": 3.0, "ckpt_format": "torch_dist",
              "layout": meta.get("layout"), "has_optimizer": bool(optimizer)}
    if optimizer:
        common.update({k: meta[k] for k in ("opt_param_scheduler", "grad_scaler",
                                             "num_skipped_iters", "adam_step", "param_groups")})
    dist_full.write_full(checkpointing.iteration_dir(save_dir, meta["iteration"]), tensors, common,
                         rng_from=meta.get("rng_from") if optimizer else None)
    checkpointing._atomic_write_text(os.path.join(save_dir, checkpointing.TRACKER),
                                     str(meta["iteration"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-dir", help="megatron_cp checkpoint to read (torch or torch_dist)")
    p.add_argument("--from-hf", help="Hugging Face Llama or GPT-2 folder to read instead")
    p.add_argument("--save-dir", help="megatron_cp checkpoint to write")
    p.add_argument("--target-ckpt-format", choices=["torch", "torch_dist"], default="torch",
                   help="format of --save-dir (torch_dist: loads under any layout)")
    p.add_argument("--to-hf", help="write a Hugging Face folder here (Llama or GPT-2, from the "
                   "checkpoint's arguments), with the tokenizer files")
    p.add_argument("--hf-skip-tokenizer", action="store_true",
                   help="--to-hf without the tokenizer files (weights and config only)")
    p.add_argument("--hf-accept-tanh-gelu", action="store_true",
                   help="--from-hf a GPT-2 with gelu_new (tanh GELU) into megatron_cp's exact GELU")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="TP of a torch output")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="PP of a torch output")
    p.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="virtual stages of the output (interleaved schedule)")
    p.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first stage of the output")
    p.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last stage of the output")
    a = p.parse_args(argv)
    if bool(a.load_dir) == bool(a.from_hf):
        raise ValueError("give exactly one input: --load-dir CHECKPOINT or --from-hf FOLDER")
    if not (a.save_dir or a.to_hf):
        raise ValueError("give an output: --save-dir CHECKPOINT and/or --to-hf FOLDER")
    source_dist = False
    if a.load_dir:
        full, args, meta = load_full(a.load_dir)
        source_dist = is_torch_dist(checkpointing.iteration_dir(a.load_dir, meta["iteration"]))
    else:
        from tools.hf_convert import import_hf
        full, args, meta = import_hf(a.from_hf, accept_tanh_gelu=a.hf_accept_tanh_gelu)
    if a.save_dir and a.target_ckpt_format == "torch_dist":
        save_torch_dist(full, args, meta, a.save_dir)
        print(f"wrote {a.save_dir} (torch_dist, loads under any layout) at iteration {meta['iteration']}")
    elif a.save_dir:
        save_layout(full, args, meta, a.save_dir, a.target_tensor_parallel_size,
                    a.target_pipeline_parallel_size, a.target_num_layers_per_virtual_pipeline_stage,
                    a.target_decoder_first_pipeline_num_layers, a.target_decoder_last_pipeline_num_layers,
                    with_optimizer=source_dist)
        print(f"wrote {a.save_dir} (TP={a.target_tensor_parallel_size}, "
              f"PP={a.target_pipeline_parallel_size}) at iteration {meta['iteration']}")
    if a.to_hf:
        from tools.hf_convert import export_hf
        architecture = export_hf(full, args, a.to_hf, tokenizer=not a.hf_skip_tokenizer)
        print(f"wrote Hugging Face {architecture} folder {a.to_hf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
