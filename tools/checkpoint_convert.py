"""Convert megatron_cp checkpoints between formats and layouts, and to/from Hugging Face.

    # torch (per model-parallel rank) <-> torch_dist (layout-free); everything is carried:
    # weights, Adam moments (Muon's momentum), fp32 main params, schedule, loss scale, RNG
    python tools/checkpoint_convert.py --load-dir ck --save-dir ck_dist --target-ckpt-format torch_dist
    python tools/checkpoint_convert.py --load-dir ck_dist --save-dir ck2 \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    # TP=2, PP=1 torch checkpoint -> TP=1, PP=2 (weights only: the optimizer starts fresh)
    python tools/checkpoint_convert.py --load-dir ck --save-dir ck_pp2 \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2
    # ... or, for a 4-layer model, PP=4 with two virtual stages per rank written out
    python tools/checkpoint_convert.py --load-dir ck --save-dir ck_pp4 \
        --target-pipeline-parallel-size 4 --target-pipeline-model-parallel-layout 'E|t|t|t|t|||L'
    # an MoE checkpoint saved at EP=2 -> EP=4 with the experts' hidden size over 2 ranks
    python tools/checkpoint_convert.py --load-dir ck --save-dir ck_ep4 \
        --target-expert-model-parallel-size 4 --target-expert-tensor-parallel-size 2
    # to a Hugging Face folder with the tokenizer files: LlamaForCausalLM for RMSNorm + SwiGLU +
    # RoPE + no biases, MixtralForCausalLM for the same with MoE layers, GPT2LMHeadModel for
    # Megatron's defaults (LayerNorm, GELU, learned positions, biases); the checkpoint's
    # arguments say which
    python tools/checkpoint_convert.py --load-dir ck --to-hf hf_out
    # from a Hugging Face Llama, Mixtral, Qwen3-Next, DeepSeek-V3 or GPT-2 folder (config.json's
    # model_type) to a checkpoint
    python tools/checkpoint_convert.py --from-hf hf_out --save-dir ck2 --target-tensor-parallel-size 2

The input format is detected. The full (unsharded) model is assembled on CPU under
canonical names (``decoder.layers.<global layer>...``), with the real vocabulary rows only,
then written for the target: split for a TP/PP/EP/ETP layout with the same split the layers
use at init (torch), or in the canonical form any layout loads (torch_dist, no layout to
choose). MoE experts are assembled whole, ``mlp.experts.linear_fc1.weight`` as
``[E, ffn (x2), h]`` (every file of every EP and ETP rank read), as a one-process model
holds them, and split over EP (the expert dim) and ETP for the target.
torch -> torch resharding writes weights only (``converted: True``): the optimizer and RNG
start fresh, at the saved iteration, samples and learning rate. (No conversion is needed to
change layout: ``--load`` reshards either format itself, optimizer state included.) A conversion from or to
torch_dist carries the optimizer state too; RNG states follow when the layout is unchanged.
"""
import argparse
import os
import shutil
import sys

import torch

from megatron_cp.checkpoint import files, torch_shards  # noqa: E402
from megatron_cp.checkpoint.canonical import (LAYER, VOCAB_PARAMS, canonical_name,  # noqa: E402
                                              canonical_tensors, full_from_canonical, is_expert,
                                              tp_spec)
from megatron_cp.checkpoint.megatron_lm_format import is_megatron_lm  # noqa: E402
from megatron_cp.checkpoint.old_defaults import with_old_defaults  # noqa: E402
from megatron_cp.checkpoint.torch_dist_format import (is_torch_dist, read_full,  # noqa: E402
                                                      write_full)
from megatron_cp.checkpoint.torch_full import (common_state, param_order,  # noqa: E402
                                               read_torch_full, saved_group_key)
from megatron_cp.optimizer.inner import ADAM_KINDS, MUON_KINDS  # noqa: E402
from megatron_cp.tensor_parallel import split_full  # noqa: E402

def module_order(args, vocab_size):
    """{full param name: its place in the model of ``args``} (the model built on the meta
    device, so nothing is allocated): the order a trainer's optimizer sees its params in,
    whatever order a checkpoint file listed them in."""
    import argparse
    from megatron_cp.model.gpt import GPTModel
    from megatron_cp.startup import config_from_args
    # the saved dtype is a string; the order does not depend on it
    config = config_from_args(argparse.Namespace(**dict(args, params_dtype=torch.float32)),
                              vocab_size)
    with torch.device("meta"):
        model = GPTModel(config)
    return {name: i for i, (name, _) in enumerate(model.state_dict().items())}


def _load_torch_dist(folder):
    tensors, common = read_full(folder)
    args = common["args"]
    full, moments = {}, {}
    for key, tensor in tensors.items():
        section, rest = key.split(".", 1)
        kind, name = ("model", rest) if section == "model" else rest.split(".", 1)
        value = full_from_canonical(tensor, tp_spec(name, args["swiglu"]))
        (full if kind == "model" else moments.setdefault(kind, {}))[name] = value
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
    it = files.read_tracker(load_dir)
    if it is None:
        raise ValueError(f"{load_dir} has no {files.TRACKER}: not a megatron_cp checkpoint")
    folder = files.iteration_dir(load_dir, it)
    if is_megatron_lm(folder):  # written by Megatron-LM itself
        from megatron_cp.checkpoint.megatron_lm_convert import import_megatron
        return import_megatron(folder)
    full, args, meta = (_load_torch_dist(folder) if is_torch_dist(folder)
                        else read_torch_full(load_dir, it))
    return full, with_old_defaults(args)[0], meta  # what an earlier version computed


def pad_vocab_rows(full, args, tp):
    """``full`` with the vocabulary rows zero-padded as a TP=``tp`` model pads them."""
    from megatron_cp.model import pad_vocab_size
    rows = args.get("true_vocab_size") or full["embedding.word_embeddings.weight"].shape[0]
    padded = pad_vocab_size(rows, args.get("make_vocab_size_divisible_by", 128), tp)
    out = dict(full)
    for name in VOCAB_PARAMS:
        if name in out:
            weight = out[name][:rows]
            out[name] = torch.cat([weight, weight.new_zeros(padded - weight.shape[0],
                                                            *weight.shape[1:])])
    return out


def _split(name, tensor, swiglu, sizes, coords):
    """The shard of the full ``tensor`` that the target rank ``coords`` = (TP, PP, EP, ETP
    rank) of the layout ``sizes`` = (TP, PP, EP, ETP) holds (a copy)."""
    spec = tp_spec(name, swiglu)
    size, rank = sizes[0], coords[0]
    if is_expert(name):  # this EP rank's experts, then its ETP slice of them
        tensor, size, rank = tensor.chunk(sizes[2])[coords[2]], sizes[3], coords[3]
    return split_full(tensor, spec[0], spec[1], size, rank).clone() if spec else tensor.clone()


def _optimizer_payload(states, layer_numbers, optimizer, meta, args, sizes, coords):
    """The MixedPrecisionOptimizer state dict of one target rank, from full moments."""
    order, groups_here = param_order(states, args)
    tied = not args["untie_embeddings_and_output_weights"]

    def shard(kind, c, name):
        canon = canonical_name(name, layer_numbers[c])
        if tied and canon == "output_layer.weight":
            canon = "embedding.word_embeddings.weight"
        return _split(name, optimizer[kind][canon], args["swiglu"], sizes, coords)

    step = torch.tensor(meta["adam_step"], dtype=torch.float32)
    hyper = {saved_group_key(g): g for g in meta["param_groups"]}
    groups, state, start = [], {}, 0
    for key, size in groups_here:
        # a stage may have a group the saved rank had not: take its twin of the other rate
        saved = hyper.get(key) or {**hyper[(key[0], key[1], not key[2])],
                                   "is_decoupled_lr": key[2]}
        groups.append({**saved, "params": list(range(start, start + size))})
        for i in range(start, start + size) if meta["adam_step"] else ():
            c, n = order[i]
            kinds = MUON_KINDS if key[0] == "muon" else ADAM_KINDS
            state[i] = {kind: shard(kind, c, n) for kind in kinds}
            if kinds == ADAM_KINDS:
                state[i]["step"] = step.clone()
        start += size
    mains = [shard("main_param", c, n) for c, n in order] if "main_param" in optimizer else []
    return {"optimizer": {"state": state, "param_groups": groups}, "grad_scaler": meta["grad_scaler"],
            "main_params": mains, "num_skipped_iters": meta["num_skipped_iters"]}


def check_expert_layout(full, args, ep, etp):
    """ValueError unless the experts of ``full`` split over ``ep`` EP and ``etp`` ETP ranks."""
    experts = args.get("num_experts") or 0
    fc2 = next((t for n, t in full.items() if is_expert(n) and n.endswith("linear_fc2.weight")), None)
    if not experts or fc2 is None:
        if ep > 1:
            raise ValueError(f"--target-expert-model-parallel-size {ep} splits MoE experts, but "
                             f"the checkpoint has none; leave it at 1")
        return
    if experts % ep:
        raise ValueError(f"--target-expert-model-parallel-size {ep} must divide the number of "
                         f"experts ({experts}); pick one of its divisors")
    if fc2.shape[-1] % etp:
        raise ValueError(f"--target-expert-tensor-parallel-size {etp} must divide the experts' "
                         f"hidden size ({fc2.shape[-1]}); pick one of its divisors")


SPLIT_ARGS = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
              "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
              "account_for_loss_in_pipeline_split")


def save_layout(full, args, meta, save_dir, tp, pp, split=None, with_optimizer=False, ep=1,
                etp=None):
    """Write ``full`` as a torch-format checkpoint for TP=tp, PP=pp, EP=ep and ETP=etp
    (default: tp) for MoE experts, the layers split over the stages as ``split`` says (a
    dict of the pipeline-split arguments, :data:`SPLIT_ARGS`; none: an even split without
    virtual stages); ``with_optimizer`` also writes ``meta``'s optimizer state and schedule."""
    etp = tp if etp is None else etp
    check_expert_layout(full, args, ep, etp)
    args = dict(args, true_vocab_size=args.get("true_vocab_size") or
                full["embedding.word_embeddings.weight"].shape[0])
    full = pad_vocab_rows(full, args, tp)
    optimizer = None
    if with_optimizer and meta.get("optimizer"):
        optimizer = {kind: pad_vocab_rows(per, args, tp) for kind, per in meta["optimizer"].items()}
    from megatron_cp.config.parallel import ParallelConfig
    from megatron_cp.config.setting import build_config
    from megatron_cp.pipeline_parallel.stages import layout_from_config
    tied = not args["untie_embeddings_and_output_weights"]
    new_args = dict(args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    padded_vocab_size=full["embedding.word_embeddings.weight"].shape[0],
                    expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                    **{name: (split or {}).get(name) for name in SPLIT_ARGS})
    layout = layout_from_config(build_config(ParallelConfig, argparse.Namespace(**new_args)),
                                new_args["num_layers"], new_args.get("mtp_num_layers"))
    vp = layout.vp_size
    new_args["virtual_pipeline_model_parallel_size"] = vp if vp > 1 else None
    root = files.iteration_dir(save_dir, meta["iteration"])
    same_layout = optimizer is not None and files.rank_grid(new_args) == \
        files.rank_grid(meta.get("layout") or {})
    sizes = torch_shards.file_layout(new_args)
    place = module_order(args, args["true_vocab_size"])
    full = dict(sorted(full.items(), key=lambda item: place.get(item[0], len(place))))
    for coords, shard_name in torch_shards.shard_names(*sizes).items():
        pp_rank = coords[1]
        chunks = layout.chunk_layer_numbers(pp_rank)
        states = []
        for c, layers in enumerate(chunks):
            pre, post = layout.has_embedding(pp_rank, c), layout.has_loss(pp_rank, c)
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
            states.append({name: _split(name, tensor, args["swiglu"], sizes, coords)
                           for name, tensor in wanted.items()})
        payload = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
                   "args": new_args, "checkpoint_version": 3.0,
                   "layer_numbers": [list(layers) for layers in chunks]}
        if optimizer is None:
            payload["converted"] = True
        else:
            payload.update(optimizer=_optimizer_payload(states, payload["layer_numbers"],
                                                        optimizer, meta, args, sizes, coords),
                           opt_param_scheduler=meta["opt_param_scheduler"],
                           no_rng=not same_layout)
        if len(states) == 1:
            payload["model"] = states[0]
        else:
            payload.update({f"model{i}": s for i, s in enumerate(states)})
        shard = os.path.join(root, shard_name)
        os.makedirs(shard, exist_ok=True)
        files.atomic_torch_save(payload, os.path.join(shard, torch_shards.SHARD_FILE))
    rng = os.path.join(meta.get("rng_from") or "", "rng")
    if same_layout and os.path.isdir(rng):
        shutil.copytree(rng, os.path.join(root, "rng"), dirs_exist_ok=True)
    files.atomic_write_text(os.path.join(save_dir, files.TRACKER), str(meta["iteration"]))


def save_torch_dist(full, args, meta, save_dir):
    """Write ``full`` (and ``meta``'s optimizer state) as a torch_dist checkpoint, which any
    layout loads."""
    args = dict(args, true_vocab_size=args.get("true_vocab_size") or
                full["embedding.word_embeddings.weight"].shape[0])
    tensors = canonical_tensors(full, args, meta.get("optimizer"))
    common = common_state(args, meta)
    optimizer = common["has_optimizer"]
    write_full(files.iteration_dir(save_dir, meta["iteration"]), tensors, common,
               rng_from=meta.get("rng_from") if optimizer else None)
    files.atomic_write_text(os.path.join(save_dir, files.TRACKER), str(meta["iteration"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-dir", help="checkpoint to read: megatron_cp's (torch or torch_dist) or "
                   "one Megatron-LM wrote (--ckpt-format torch_dist)")
    p.add_argument("--from-hf", help="Hugging Face Llama, Mixtral, Qwen3-Next, "
                   "DeepSeek-V3 or GPT-2 folder to read instead")
    p.add_argument("--save-dir", help="megatron_cp checkpoint to write")
    p.add_argument("--target-ckpt-format", choices=["torch", "torch_dist"], default="torch",
                   help="format of --save-dir (torch_dist: loads under any layout)")
    p.add_argument("--to-hf", help="write a Hugging Face folder here (Llama, Mixtral, Qwen3-Next, "
                   "DeepSeek-V3 or GPT-2, from the "
                   "checkpoint's arguments), with the tokenizer files")
    p.add_argument("--to-megatron", help="write a checkpoint Megatron-LM loads here (its names, "
                   "arguments and vocabulary padding; weights, iteration and schedule)")
    p.add_argument("--hf-skip-tokenizer", action="store_true",
                   help="--to-hf without the tokenizer files (weights and config only)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="TP of a torch output")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="PP of a torch output")
    p.add_argument("--target-expert-model-parallel-size", type=int, default=1,
                   help="EP of a torch output (MoE experts split over this many ranks)")
    p.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                   help="ETP of a torch output (default: --target-tensor-parallel-size)")
    p.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="virtual stages of the output (interleaved schedule)")
    p.add_argument("--target-num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="virtual stages per pipeline rank of the output")
    p.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first stage of the output")
    p.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last stage of the output")
    p.add_argument("--target-account-for-embedding-in-pipeline-split", action="store_true",
                   help="the output's even split counts the embedding as a layer")
    p.add_argument("--target-account-for-loss-in-pipeline-split", action="store_true",
                   help="the output's even split counts the loss as a layer")
    p.add_argument("--target-pipeline-model-parallel-layout", default=None,
                   help="the output's stages written out (--pipeline-model-parallel-layout)")
    a = p.parse_args(argv)
    if bool(a.load_dir) == bool(a.from_hf):
        raise ValueError("give exactly one input: --load-dir CHECKPOINT or --from-hf FOLDER")
    if not (a.save_dir or a.to_hf or a.to_megatron):
        raise ValueError("give an output: --save-dir CHECKPOINT, --to-megatron CHECKPOINT and/or "
                         "--to-hf FOLDER")
    source_dist = False
    if a.load_dir:
        full, args, meta = load_full(a.load_dir)
        source_dist = is_torch_dist(files.iteration_dir(a.load_dir, meta["iteration"]))
    else:
        from megatron_cp.checkpoint.hf.convert import import_hf
        full, args, meta = import_hf(a.from_hf)
    if a.save_dir and a.target_ckpt_format == "torch_dist":
        save_torch_dist(full, args, meta, a.save_dir)
        print(f"wrote {a.save_dir} (torch_dist, loads under any layout) at iteration {meta['iteration']}")
    elif a.save_dir:
        split = {name: getattr(a, "target_" + name) for name in SPLIT_ARGS}
        save_layout(full, args, meta, a.save_dir, a.target_tensor_parallel_size,
                    a.target_pipeline_parallel_size, split, with_optimizer=source_dist,
                    ep=a.target_expert_model_parallel_size, etp=a.target_expert_tensor_parallel_size)
        print(f"wrote {a.save_dir} (TP={a.target_tensor_parallel_size}, "
              f"PP={a.target_pipeline_parallel_size}, EP={a.target_expert_model_parallel_size}) "
              f"at iteration {meta['iteration']}")
    if a.to_megatron:
        from megatron_cp.checkpoint.megatron_lm_convert import export_megatron
        export_megatron(full, args, meta, a.to_megatron)
        print(f"wrote Megatron-LM checkpoint {a.to_megatron} at iteration {meta['iteration']}")
    if a.to_hf:
        from megatron_cp.checkpoint.hf.convert import export_hf
        architecture = export_hf(full, args, a.to_hf, tokenizer=not a.hf_skip_tokenizer)
        print(f"wrote Hugging Face {architecture} folder {a.to_hf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
