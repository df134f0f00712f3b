"""Megatron-LM compatible command line: declared, parsed and checked before any process group.

Read top-down, a flag's story is:

1. **Declared.** Every setting is a field of one typed config section (:data:`SECTIONS`,
   megatron_cp/config/, declared with :func:`~megatron_cp.config.setting.setting`), which
   gives its flag, Megatron-LM's default, choices and help; every other Megatron-LM flag is
   an entry of the table in megatron_flags.py (accepted as what megatron_cp does anyway, an
   alias, or refused with the reason). Together they cover Megatron-LM's whole parser (the
   census megatron_lm_flags.json; tests/cli/test_megatron_flag_census.py,
   tests/cli/test_config_declarations.py).
2. **Parsed.** :func:`parse_args` notes every unknown flag and every bad value instead of
   stopping at the first.
3. **Checked.** :func:`~megatron_cp.cli.checks.validate_args` derives what the flags imply,
   runs every rule (each section's own, and those spanning sections) and keeps every
   failure.
4. **Reported.** All problems raise together as :class:`ArgumentErrors`, a line each;
   check_args.py prints them (``error: ...``) and exits 2, before any collective starts.
5. **Used.** ``startup.config_from_args`` builds the typed config from the parsed flags.
"""
import argparse
import sys

from megatron_cp.checkpoint.old_defaults import apply_old_defaults
from megatron_cp.checkpoint.use_checkpoint_args import given_on_command_line, take_checkpoint_args
from megatron_cp.cli.checks import ArgumentErrors, validate_args
from megatron_cp.cli.megatron_flags import add_compat_flags
from megatron_cp.config.checkpoint import CheckpointConfig
from megatron_cp.config.data import DataConfig
from megatron_cp.config.logging import LoggingConfig
from megatron_cp.config.model import GPTConfig
from megatron_cp.config.optimizer import OptimizerConfig
from megatron_cp.config.parallel import ParallelConfig
from megatron_cp.config.setting import add_config_flags, config_flag_names
from megatron_cp.config.training import TrainingConfig

# The typed sections whose fields declare the flags, in --help's order
SECTIONS = (GPTConfig, OptimizerConfig, DataConfig, TrainingConfig, ParallelConfig,
            CheckpointConfig, LoggingConfig)
GROUPS = ("model", "moe", "mixed precision", "training", "rerun engine", "parallelism", "data",
          "checkpointing and logging", "compat")
_GROUP_TITLES = {"moe": "mixture of experts", "compat": "other Megatron-LM flags (accepted, or refused with the reason)"}


def build_parser(parser_class=argparse.ArgumentParser):
    """The argparse parser with every flag (and its help)."""
    p = parser_class(description="megatron_cp GPT pretraining", allow_abbrev=False)
    groups = {name: p.add_argument_group(_GROUP_TITLES.get(name, name)) for name in GROUPS}
    for section in SECTIONS:
        add_config_flags(section, groups)
    add_compat_flags(groups)
    return p


def flag_names(parser=None):
    """``{Python name: flag}`` for every argument and every config field with a flag."""
    parser = parser or build_parser()
    names = {action.dest: action.option_strings[0] for action in parser._actions
             if action.option_strings and action.dest != "help"}
    for section in SECTIONS:
        names.update(config_flag_names(section))
    return names


# Defaults of a run that only evaluates or generates (``inference=True``): no training
# schedule, no dataset, one sample per microbatch unless the user asks for more, no dropout.
INFERENCE_DEFAULTS = {"micro_batch_size": 1, "hidden_dropout": 0.0, "attention_dropout": 0.0}


class _ParseError(Exception):
    """argparse's own error (a missing required flag), raised instead of exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _ParseError(message)


def parse_args(argv=None, world_size=1, extra_args_provider=None, inference=False):
    """Parse ``argv``, fill derived values and validate against ``world_size``.

    Every problem is found before any is reported: unknown flags, bad values and each failed
    check raise one :class:`ArgumentErrors` with a line per problem. With
    ``--use-checkpoint-args`` the model and tokenizer flags not on the command line
    come from the checkpoint under ``--load`` (so a user names no model flag).
    ``extra_args_provider(parser)`` adds a script's own flags (Megatron's hook, e.g. the
    tasks' ``--task``). ``inference``: the run evaluates or generates from a checkpoint, so
    the training flags (``--lr``, ``--train-iters``, a dataset) are not needed,
    ``--micro-batch-size`` defaults to 1 and dropout to 0, and with ``--use-checkpoint-args``
    the checkpoint also gives the dtype (``--bf16`` / ``--fp16``) unless one is given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_Parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    if inference:
        for action in parser._actions:
            if action.dest in INFERENCE_DEFAULTS:
                action.required, action.default = False, INFERENCE_DEFAULTS[action.dest]
    if "--use-checkpoint-args" in argv:
        for action in parser._actions:  # the checkpoint supplies what is missing
            action.required = False
    args, problems, values_ok = _parse_collecting(parser, argv)
    if args is None or not values_ok:
        raise ArgumentErrors(problems)
    # the --load checkpoint's saved arguments, read once for both uses
    saved = _take_checkpoint_args(args, parser, argv, inference) if args.use_checkpoint_args \
        else _saved_under_load(args)
    notes = [] if saved is None else \
        apply_old_defaults(args, saved, given_on_command_line(parser, argv))
    args = validate_args(args, world_size, parser, flag_names(parser), inference, problems)
    args.compat_notes = list(args.compat_notes) + notes
    return args


def _parse_collecting(parser, argv):
    """``(args or None, problem lines, no value was bad)``: a flag with a bad value is noted
    and dropped, and the rest parsed again, so every bad value and every unknown flag is
    reported at once."""
    parser.exit_on_error = False
    problems, argv, dropped = [], list(argv), set()
    while True:
        try:
            args, unknown = parser.parse_known_args(argv)
            break
        except argparse.ArgumentError as err:
            problems.append(f"{err} (see --help)")
            dropped.update((err.argument_name or "").split("/"))
            if not _drop_flag(argv, err.argument_name):
                return None, problems, False
        except _ParseError as err:  # a required flag is missing (not one dropped for its value)
            message = str(err)
            head = "the following arguments are required: "
            if message.startswith(head):
                missing = [f for f in message[len(head):].split(", ")
                           if not set(f.split("/")) & dropped]
                message = head + ", ".join(missing) if missing else None
            if message:
                problems.append(f"{message} (see --help)")
            return None, problems, False
    if unknown:
        problems.append(f"unrecognized arguments: {' '.join(unknown)} (see --help)")
    return args, problems, not dropped


def _drop_flag(argv, name):
    """Remove every occurrence of flag ``name`` (``--flag v ...`` or ``--flag=v``;
    ``--a/--b``: either spelling) from ``argv``; False if absent."""
    names = [n for n in (name or "").split("/") if n]
    dropped, i = False, 0
    while i < len(argv):
        token = argv[i]
        if any(token == n or token.startswith(n + "=") for n in names):
            end = i + 1
            if "=" not in token:
                while end < len(argv) and not argv[end].startswith("--"):
                    end += 1
            del argv[i:end]
            dropped = True
        else:
            i += 1
    return dropped


def _take_checkpoint_args(args, parser, argv, inference=False):
    """``--use-checkpoint-args``: the model from the checkpoint under ``--load``, never its
    parallel layout (the rule: :mod:`megatron_cp.checkpoint.use_checkpoint_args`); returns
    the checkpoint's saved arguments."""
    if not args.load:
        raise ValueError("--use-checkpoint-args reads the model flags from a checkpoint: give "
                         "--load DIR")
    from megatron_cp.checkpoint.load_save import saved_args
    saved = saved_args(args.load, args.ckpt_step)
    take_checkpoint_args(args, saved, given_on_command_line(parser, argv), inference)
    return saved


def _saved_under_load(args):
    """The saved arguments of the checkpoint under ``--load`` (for the defaults it was trained
    with: :mod:`megatron_cp.checkpoint.old_defaults`), or None: no ``--load``, no checkpoint
    there yet, or one that cannot be read (the load says why)."""
    if not args.load:
        return None
    from megatron_cp.checkpoint import files
    from megatron_cp.checkpoint.load_save import saved_args
    try:
        if files.load_iteration(args.load, args.ckpt_step) is None:
            return None
        return saved_args(args.load, args.ckpt_step)
    except (OSError, ValueError, KeyError, RuntimeError):
        return None


