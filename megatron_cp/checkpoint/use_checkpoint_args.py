"""``--use-checkpoint-args``: what a checkpoint's saved arguments give a run, as one rule.

A checkpoint gives the MODEL: every model setting (a :class:`~megatron_cp.config.model.GPTConfig`
field with a flag, and its gate such as ``--group-query-attention``) that defines the function it
computes -- layers, hidden size, heads, query groups, vocabulary padding, norms, activations,
positions, biases, tied embeddings, MoE experts and routing -- plus ``--seq-length`` and the
tokenizer. It never gives the PARALLEL LAYOUT (TP/PP/CP/EP/ETP, virtual stages, DP sizes, the
distributed optimizer, the rank order: a checkpoint of ours loads into any layout, so the
command line picks it, as Megatron-LM does without ``--use-mp-args-from-checkpoint-args``) nor
how a run RUNS (dropout, seed, init, recompute, kernels, compilation, dtype): those are
:data:`LAYOUT_SETTINGS` and :data:`RUN_SETTINGS`. A flag on the command line always wins.

Training (``pretrain_gpt.py``), generation and the tasks all parse their flags through
:func:`megatron_cp.cli.arguments.parse_args`, which applies this rule (:func:`take_checkpoint_args`).
It runs during argument parsing, before the config sections are built from the arguments, so
it reads and sets the argument namespace itself (Megatron-LM's names, as the checkpoint saves
them) and no section.
"""
import argparse
import dataclasses

from megatron_cp.config.setting import arg_of
from megatron_cp.config.model import GPTConfig

# model settings of GPTConfig that place the model on ranks: the command line's
LAYOUT_SETTINGS = ("sequence_parallel", "cp_comm_type", "hierarchical_context_parallel_sizes",
                   "no_cp_dummy_heads")
# model settings of GPTConfig that say how a run runs, not what the model computes
RUN_SETTINGS = ("hidden_dropout", "attention_dropout", "recompute_granularity",
                "recompute_method", "recompute_num_layers", "seed", "init_method_std",
                "params_dtype", "torch_compile", "torch_compile_mode", "attention_kernel")
TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
                  "tiktoken_pattern", "tiktoken_num_special_tokens", "special_tokens")
# what a run cannot go without; the checkpoint or the command line must give it
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def model_arg_names():
    """The argument names ``--use-checkpoint-args`` takes from a checkpoint (the rule above)."""
    fields = dataclasses.fields(GPTConfig)
    names = [arg_of(f) for f in fields if arg_of(f)]
    names += [f.metadata["gate"][0].lstrip("-").replace("-", "_")
              for f in fields if f.metadata.get("gate")]
    names = [n for n in names if n not in LAYOUT_SETTINGS + RUN_SETTINGS]
    return tuple(names + ["seq_length", *TOKENIZER_ARGS])


def given_on_command_line(parser, argv):
    """The argument names ``argv`` sets itself (any spelling: ``--flag v``, ``--flag=v``)."""
    quiet = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            kwargs = {"dest": action.dest, "default": argparse.SUPPRESS,
                      "nargs": 0 if action.nargs == 0 else "*"}
            quiet.add_argument(*action.option_strings, action=_Given, **kwargs)
    given, _ = quiet.parse_known_args(argv)
    return set(vars(given))


class _Given(argparse.Action):
    """Records that a flag was given (its value is the real parser's business)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


def take_checkpoint_args(args, saved, given, inference=False):
    """Set on ``args`` every name of :func:`model_arg_names` that ``saved`` (the checkpoint's
    arguments, a dict) holds and the command line did not give (``given``: the names it
    set). ``inference``: the weights' own dtype too, unless ``--bf16`` / ``--fp16`` is given.
    ValueError naming what neither the checkpoint nor the command line gives."""
    if "group_query_attention" not in saved and saved.get("num_query_groups"):
        # Hugging Face imports that predate the gate: other than one group per head is GQA
        saved = dict(saved, group_query_attention=saved["num_query_groups"]
                     != saved.get("num_attention_heads"))
    for name in model_arg_names():
        if name in saved and name not in given:
            setattr(args, name, saved[name])
    if inference and not (args.bf16 or args.fp16):
        args.bf16, args.fp16 = bool(saved.get("bf16")), bool(saved.get("fp16"))
    missing = [f"--{n.replace('_', '-')}" for n in REQUIRED + ("micro_batch_size",)
               if vars(args)[n] is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} not given and not in the checkpoint under "
                         f"{args.load}; pass them on the command line")
