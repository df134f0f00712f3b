"""tools/checkpoint_convert.py's Megatron-LM side: a checkpoint Megatron-LM wrote
(``--ckpt-format torch_dist``) as our full weights, and our full weights as a checkpoint
Megatron-LM loads (``--load DIR --use-checkpoint-args --no-load-optim --no-load-rng``, or
megatron-core's ``dist_checkpointing.load`` into its GPTModel, strictly).

Both directions carry the weights, the iteration and the consumed samples; a Megatron-LM
checkpoint's Adam state is read by ``pretrain_gpt.py --load`` directly (no conversion
needed), and an export writes the model only (Megatron-LM resumes it with
``--no-load-optim``), with its learning-rate schedule in Megatron's sample counts.
"""
import os

from megatron_cp.checkpoint import files
from megatron_cp.checkpoint import megatron_lm_format as megatron_lm


def _true_vocab(args):
    """The tokenizer's vocabulary size of Megatron's arguments ``args`` (ours), or None
    when its tokenizer cannot be built here (then every saved row is kept)."""
    from megatron_cp.data.tokenizers import build_tokenizer
    try:
        return build_tokenizer(args.get("tokenizer_type") or "NullTokenizer",
                               args.get("tokenizer_model"), args.get("vocab_file"),
                               args.get("merge_file"), args.get("vocab_size"),
                               tiktoken_pattern=args.get("tiktoken_pattern"),
                               tiktoken_num_special_tokens=args.get(
                                   "tiktoken_num_special_tokens") or 1000,
                               special_tokens=args.get("special_tokens")).vocab_size
    except (ValueError, OSError, TypeError):
        return None


def import_megatron(folder):
    """(full weights, our args dict, meta dict) of the Megatron-LM iteration folder
    ``folder``; the vocabulary rows are its tokenizer's (Megatron's padding dropped)."""
    args = megatron_lm.our_args(megatron_lm.read_common(folder)["args"])
    vocab = _true_vocab(args)
    full, _, args, common = megatron_lm.read(folder, vocab_rows=vocab)
    args["true_vocab_size"] = vocab or full["embedding.word_embeddings.weight"].shape[0]
    meta = {"iteration": int(common["iteration"]),
            "consumed_samples": int(args.get("consumed_train_samples") or 0), "layout": None}
    return full, args, meta


def megatron_defaults():
    """Megatron-LM's argument defaults by dest, from the flag census (None where the
    default is an object the census could only print, e.g. an enum)."""
    return megatron_lm.megatron_census_defaults()


def export_megatron(full, args, meta, save_dir):
    """Write ``full`` as Megatron-LM's checkpoint of iteration ``meta["iteration"]`` under
    ``save_dir`` (weights, its arguments, schedule; no optimizer or RNG state)."""
    it, consumed = meta["iteration"], meta.get("consumed_samples", 0)
    args = dict(args, true_vocab_size=args.get("true_vocab_size")
                or full["embedding.word_embeddings.weight"].shape[0])
    namespace = megatron_lm.megatron_args(args, megatron_defaults(), it, consumed)
    common = {"args": namespace, "checkpoint_version": 3.0, "iteration": it,
              "num_floating_point_operations_so_far": 0}
    if meta.get("opt_param_scheduler"):
        common["opt_param_scheduler"] = megatron_lm.scheduler_to_megatron(
            meta["opt_param_scheduler"], args.get("global_batch_size") or 1,
            args.get("lr_counts_samples", False))
    megatron_lm.write(files.iteration_dir(save_dir, it), full, args, common)
    files.atomic_write_text(os.path.join(save_dir, files.TRACKER), str(it))
