"""Reshard a megatron_cp checkpoint to another TP/PP layout, and convert to/from Hugging Face.

    # TP=2, PP=1 checkpoint -> TP=1, PP=2
    python tools/checkpoint_convert.py --load-dir ck --save-dir ck_pp2 \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2
    # to a Hugging Face LlamaForCausalLM folder (RMSNorm + SwiGLU + RoPE + no biases)
    python tools/checkpoint_convert.py --load-dir ck --to-hf hf_out
    # from a Hugging Face Llama folder to a megatron_cp checkpoint
    python tools/checkpoint_convert.py --from-hf hf_out --save-dir ck2 --target-tensor-parallel-size 2

The full (unsharded) model is assembled on CPU under canonical names (``decoder.layers.<global
layer>...``), then split for the target layout with the same split the layers use at init.
Converted checkpoints hold weights only (``converted: True``): the optimizer and RNG start
fresh when training resumes from them, at the saved iteration and consumed samples.
"""
import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_cp import checkpointing  # noqa: E402
from megatron_cp.tensor_parallel import merge_shards, split_full  # noqa: E402

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")  # [padded vocab, h]


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


def load_full(load_dir):
    """Assemble the full model of the latest checkpoint: (state dict, args dict, meta dict).

    The vocabulary rows are the real ones (``true_vocab_size``), without the TP padding."""
    it = checkpointing.read_tracker(load_dir)
    if it is None:
        raise ValueError(f"{load_dir} has no {checkpointing.TRACKER}: not a megatron_cp checkpoint")
    root = checkpointing.iteration_dir(load_dir, it)
    first = torch.load(checkpointing.latest_first_shard(load_dir), map_location="cpu",
                       weights_only=False)
    args = first["args"]
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    shards = {}  # canonical name -> list of TP shards
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            path = os.path.join(root, checkpointing.shard_name(tp_rank, pp_rank, pp), "model_optim_rng.pt")
            payload = torch.load(path, map_location="cpu", weights_only=False)
            for state, layers in zip(_chunk_states(payload), payload["layer_numbers"]):
                for name, tensor in state.items():
                    m = LAYER.match(name)
                    if m:
                        name = f"decoder.layers.{layers[int(m.group(1))]}.{m.group(2)}"
                    shards.setdefault(name, {})[tp_rank] = tensor
    tied = not args["untie_embeddings_and_output_weights"]
    full = {}
    for name, per_rank in shards.items():
        if tied and name == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding
        spec = tp_spec(name, args["swiglu"])
        parts = [per_rank[r] for r in range(tp)]
        full[name] = merge_shards(parts, *spec) if spec else parts[0]
    true_vocab = args.get("true_vocab_size")
    for name in VOCAB_ROWS:  # the padding depends on the TP size: keep the real rows only
        if name in full and true_vocab:
            full[name] = full[name][:true_vocab]
    meta = {"iteration": first["iteration"], "consumed_samples": first["consumed_samples"]}
    return full, args, meta


def pad_vocab_rows(full, args, tp):
    """``full`` with the vocabulary rows zero-padded as a TP=``tp`` model pads them."""
    from megatron_cp.model import pad_vocab_size
    rows = full["embedding.word_embeddings.weight"].shape[0]
    padded = pad_vocab_size(args.get("true_vocab_size") or rows,
                            args.get("make_vocab_size_divisible_by", 128), tp)
    out = dict(full)
    for name in VOCAB_ROWS:
        if name in out:
            weight = out[name][:args.get("true_vocab_size") or rows]
            out[name] = torch.cat([weight, weight.new_zeros(padded - weight.shape[0],
                                                            *weight.shape[1:])])
    return out


def save_layout(full, args, meta, save_dir, tp, pp, vp_layers=None, first=None, last=None):
    """Write ``full`` as a checkpoint for TP=tp, PP=pp (optionally virtual stages)."""
    args = dict(args, true_vocab_size=args.get("true_vocab_size") or
                full["embedding.word_embeddings.weight"].shape[0])
    full = pad_vocab_rows(full, args, tp)
    from megatron_cp.pipeline_parallel.stages import chunk_layer_numbers, virtual_pipeline_size
    num_layers = args["num_layers"]
    vp = virtual_pipeline_size(num_layers, pp, vp_layers) if vp_layers else None
    tied = not args["untie_embeddings_and_output_weights"]
    new_args = dict(args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    padded_vocab_size=full["embedding.word_embeddings.weight"].shape[0],
                    num_layers_per_virtual_pipeline_stage=vp_layers,
                    decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last)
    root = checkpointing.iteration_dir(save_dir, meta["iteration"])
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
                       "args": new_args, "converted": True, "checkpoint_version": 3.0,
                       "layer_numbers": [list(layers) for layers in chunks]}
            if len(states) == 1:
                payload["model"] = states[0]
            else:
                payload.update({f"model{i}": s for i, s in enumerate(states)})
            shard = os.path.join(root, checkpointing.shard_name(tp_rank, pp_rank, pp))
            os.makedirs(shard, exist_ok=True)
            checkpointing._atomic_torch_save(payload, os.path.join(shard, "model_optim_rng.pt"))
    checkpointing._atomic_write_text(os.path.join(save_dir, checkpointing.TRACKER),
                                     str(meta["iteration"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load-dir", help="megatron_cp checkpoint to read")
    p.add_argument("--from-hf", help="Hugging Face Llama folder to read instead")
    p.add_argument("--save-dir", help="megatron_cp checkpoint to write")
    p.add_argument("--to-hf", help="write a Hugging Face Llama folder here")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1, help="TP of the output")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1, help="PP of the output")
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
    if a.load_dir:
        full, args, meta = load_full(a.load_dir)
    else:
        from tools.hf_llama import from_hf
        full, args, meta = from_hf(a.from_hf)
    if a.save_dir:
        save_layout(full, args, meta, a.save_dir, a.target_tensor_parallel_size,
                    a.target_pipeline_parallel_size, a.target_num_layers_per_virtual_pipeline_stage,
                    a.target_decoder_first_pipeline_num_layers, a.target_decoder_last_pipeline_num_layers)
        print(f"wrote {a.save_dir} (TP={a.target_tensor_parallel_size}, "
              f"PP={a.target_pipeline_parallel_size}) at iteration {meta['iteration']}")
    if a.to_hf:
        from tools.hf_llama import to_hf
        to_hf(full, args, a.to_hf)
        print(f"wrote Hugging Face Llama folder {a.to_hf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
