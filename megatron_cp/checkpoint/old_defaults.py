"""What a checkpoint saved by an earlier megatron_cp computed where a default has since changed.

A default that changes what the model or the loss computes must not change a resumed run
behind its back: a run that loads such a checkpoint keeps what it was trained with, and the
start-up banner says so in one line. Each change is one row of :data:`OLD_DEFAULTS`: the
saved-arguments key the change introduced (its absence marks a checkpoint saved before it),
the value the earlier version computed (read from the saved arguments) and that line. A flag
given on the command line always wins.

:func:`apply_old_defaults` runs during argument parsing
(:func:`megatron_cp.cli.arguments.parse_args`), before the config sections are built from the
arguments, so it reads and sets the argument namespace itself (Megatron-LM's names, as the
checkpoint saves them) and no section.
"""
from dataclasses import dataclass
from typing import Callable


def _always(saved):
    return True


@dataclass(frozen=True)
class OldDefault:
    """One changed default: ``key`` missing from a checkpoint's saved arguments means it was
    saved before the change; ``value(saved)`` is what that version computed; ``note`` is the
    banner's line when the run takes it and ``shows(saved)``: the setting changes what that
    model computes (else it is taken without a word)."""
    key: str
    value: Callable[[dict], object]
    note: str
    shows: Callable[[dict], bool] = _always


def computes_gelu(saved):
    """Whether the model of arguments ``saved`` (a dict) has a GELU MLP (not SwiGLU or
    squared ReLU): the one the bias-GELU fusion changes."""
    return not saved.get("swiglu") and not saved.get("squared_relu")


def _earlier_gelu(saved):
    """The bias-GELU fusion that computes what megatron_cp computed before it had the setting:
    the exact (erf) GELU, or the tanh one under --openai-gelu (which then needed biases no
    more than it needed the fusion)."""
    if not saved.get("openai_gelu"):
        return False
    if saved.get("disable_bias_linear"):
        raise ValueError("the checkpoint was trained with --openai-gelu --disable-bias-linear, "
                         "a tanh GELU without biases that Megatron-LM cannot compute and "
                         "megatron_cp no longer builds; train on with --no-bias-gelu-fusion "
                         "(the exact GELU: its logits will differ) or from an older megatron_cp")
    return True


OLD_DEFAULTS = (
    OldDefault("bias_gelu_fusion", _earlier_gelu,
               "the checkpoint was trained with the exact (erf) GELU of megatron_cp's earlier "
               "default; resuming with it (--no-bias-gelu-fusion)", computes_gelu),
    # before Megatron-LM's per-microbatch weighting, the gradient was always the token-weighted
    # mean over the global batch (megatron_cp.pipeline_parallel.loss_weighting)
    OldDefault("calculate_per_token_loss", _always,
               "the checkpoint was trained with the token-weighted loss of megatron_cp's earlier "
               "default; resuming with it (--calculate-per-token-loss)"),
)


def with_old_defaults(saved):
    """``(saved arguments, rows)``: ``saved`` (a checkpoint's arguments, a dict) with every
    :data:`OLD_DEFAULTS` key it lacks set to what the version that saved it computed, and
    ``(key, note)`` of each row it lacked (note None: nothing to say for this model)."""
    saved, rows = dict(saved), []
    for row in OLD_DEFAULTS:
        if row.key not in saved:
            rows.append((row.key, row.note if row.shows(saved) else None))
            saved[row.key] = row.value(saved)
    return saved, rows


def apply_old_defaults(args, saved, given):
    """Give ``args`` what the checkpoint's version computed for each changed default its saved
    arguments (``saved``) predate, unless the command line set it (``given``: the argument
    names it set). Returns the notes for the banner (one line per setting changed)."""
    upgraded, rows = with_old_defaults(saved)
    notes = []
    for key, note in rows:
        if key not in given and vars(args)[key] != upgraded[key]:
            setattr(args, key, upgraded[key])
            if note:
                notes.append(note)
    return notes
