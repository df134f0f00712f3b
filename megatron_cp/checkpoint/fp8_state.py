"""FP8 delayed scaling's state across a save and a load.

Each FP8 linear under the delayed recipe keeps ``fp8_meta.amax_history`` [3, L] and
``fp8_meta.scale`` [3] as persistent buffers, whole on every rank (their amaxes are reduced
over TP, CP and DP), so every format stores them like a norm weight and any layout reads
them back. Tensorwise scaling keeps none.

Switching the recipe on or off across a resume does what Megatron-LM does with Transformer
Engine's ``_extra_state`` (which holds that state there): a checkpoint without it loads into
a delayed-FP8 run with every history starting fresh (scales 1, as at step 0), and a run
without delayed FP8 ignores the saved buffers; each case says so in one start-up line. A
different ``--fp8-amax-history-len`` is refused: the saved histories do not fit.
"""

FP8_BUFFERS = ("fp8_meta.amax_history", "fp8_meta.scale")


def is_fp8_buffer(name):
    """True for an FP8 linear's delayed-scaling buffer (a state-dict or checkpoint key)."""
    return name.endswith(FP8_BUFFERS)


def history_length(args):
    """The amax history length of the delayed-scaling state a run with ``args`` (an argument
    dict, ours or a checkpoint's) keeps; None when it keeps none (no FP8, or tensorwise)."""
    if not (args.get("fp8_format") or args.get("fp8")):
        return None
    if args.get("fp8_recipe", "delayed") != "delayed":
        return None
    return args.get("fp8_amax_history_len", 1)


def carries(saved, current, say):
    """Whether this run (``current``: its argument dict) loads the FP8 state of a checkpoint
    saved with the arguments ``saved`` ({} for a checkpoint that holds none, e.g.
    Megatron-LM's, whose state is in ``_extra_state``); ``say(line)`` prints a start-up note
    when one side has the state and the other does not."""
    before, now = history_length(saved), history_length(current)
    if now is None:
        if before is not None:
            say("the checkpoint's FP8 delayed-scaling state (amax histories, scales) is not "
                "used: this run has no --fp8-format with --fp8-recipe delayed")
        return False
    if before is None:
        say("the checkpoint holds no FP8 delayed-scaling state (saved without --fp8-format or "
            "with --fp8-recipe tensorwise): every FP8 linear's amax history starts fresh, as "
            "Megatron-LM's does without Transformer Engine's _extra_state")
        return False
    if before != now:
        raise ValueError(f"--fp8-amax-history-len ({now}) differs from the checkpoint's "
                         f"({before}): its amax histories do not fit; give "
                         f"--fp8-amax-history-len {before}")
    return True


def without_fp8(state):
    """``state`` (a dict by key) without its FP8 buffers."""
    return {key: value for key, value in state.items() if not is_fp8_buffer(key)}
