"""Learning-rate and weight-decay schedule, with Megatron's formulas.

Warmup is linear from ``init_lr`` to ``max_lr`` over ``lr_warmup_steps`` (step 0 uses
``init_lr``, as in Megatron); then the rate decays to ``min_lr`` at ``lr_decay_steps``
(linear, cosine, inverse-square-root, or stays at ``max_lr`` for constant; WSD stays at
``max_lr`` until the last ``wsd_decay_steps`` of the decay, then anneals in the
``lr_wsd_decay_style`` shape) and stays at ``min_lr`` afterwards. Weight decay optionally moves from ``start_wd`` to ``end_wd`` over
``wd_incr_steps``. Each param group's ``lr_mult`` / ``wd_mult`` (default 1) multiply the
scheduled values, which is how no-weight-decay groups stay at zero. The groups marked
``is_decoupled_lr`` (the input embedding and the output layer) follow the same warmup and
decay from ``decoupled_lr`` down to ``decoupled_min_lr`` (default ``min_lr``), Megatron-LM's
``--decoupled-lr``; the logged rate is the other groups'.
"""
import math

from megatron_cp.config.optimizer import WSD_DECAY_STYLES

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WD_INCR_STYLES = ("constant", "linear", "cosine")
# The command-line flag behind each checked value, for the mismatch message.
_FLAG_OF = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
            "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
            "start_wd": "--start-weight-decay", "end_wd": "--end-weight-decay",
            "wd_incr_style": "--weight-decay-incr-style", "decoupled_lr": "--decoupled-lr",
            "decoupled_min_lr": "--decoupled-min-lr", "wsd_decay_steps": "--lr-wsd-decay-iters",
            "lr_wsd_decay_style": "--lr-wsd-decay-style"}
_CHECKED_KEYS = ("max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps",
                 "lr_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style",
                 "decoupled_lr", "decoupled_min_lr", "wsd_decay_steps", "lr_wsd_decay_style")
_WSD_KEYS = ("wsd_decay_steps", "lr_wsd_decay_style")  # saved by a WSD schedule only


class OptimizerParamScheduler:
    """Sets ``lr`` (and ``weight_decay``) of every param group of ``optimizer`` per step.

    ``optimizer`` is anything with ``param_groups`` (a torch optimizer or
    :class:`~megatron_cp.optimizer.optimizer.MixedPrecisionOptimizer`). ``start_wd`` and
    ``end_wd`` left as None leave the groups' weight decay untouched. ``use_checkpoint_values``
    makes :meth:`load_state_dict` adopt the saved schedule; ``override_from_arguments`` keeps
    the constructor's (the flags ``--use-checkpoint-opt_param-scheduler`` and
    ``--override-opt_param-scheduler``); with neither, a mismatch raises ValueError naming them.
    ``decoupled_lr`` / ``decoupled_min_lr``: the schedule's ends for the ``is_decoupled_lr``
    groups (None: those groups follow ``max_lr``; see the module docstring).
    ``wsd_decay_steps`` / ``lr_wsd_decay_style``: the annealing phase of ``lr_decay_style``
    WSD (Megatron-LM's ``--lr-wsd-decay-iters`` and ``--lr-wsd-decay-style``).
    """

    def __init__(self, optimizer, max_lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=None,
                 lr_decay_style="linear", init_lr=0.0, start_wd=None, end_wd=None,
                 wd_incr_steps=None, wd_incr_style="constant", use_checkpoint_values=False,
                 override_from_arguments=False, decoupled_lr=None, decoupled_min_lr=None,
                 wsd_decay_steps=None, lr_wsd_decay_style="exponential"):
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style {lr_decay_style!r} is not supported; "
                             f"pick one of {list(LR_DECAY_STYLES)}")
        if lr_decay_style == "WSD" and (wsd_decay_steps is None or wsd_decay_steps < 0):
            raise ValueError(f"lr_decay_style 'WSD' needs wsd_decay_steps >= 0 (got "
                             f"{wsd_decay_steps}), the length of its annealing phase; set "
                             f"--lr-wsd-decay-iters")
        if lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"lr_wsd_decay_style {lr_wsd_decay_style!r} is not supported; "
                             f"pick one of {list(WSD_DECAY_STYLES)}")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"wd_incr_style {wd_incr_style!r} is not supported; "
                             f"pick one of {list(WD_INCR_STYLES)}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr ({min_lr}) <= max_lr ({max_lr}); fix --min-lr / --lr")
        if init_lr < 0.0:
            raise ValueError(f"init_lr ({init_lr}) must be >= 0")
        if lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps ({lr_warmup_steps}) must be >= 0")
        if lr_decay_steps is None:
            lr_decay_steps = max(lr_warmup_steps, 1) if lr_decay_style == "constant" else None
        if lr_decay_steps is None or lr_decay_steps <= 0:
            raise ValueError(f"lr_decay_steps ({lr_decay_steps}) must be > 0 for "
                             f"lr_decay_style {lr_decay_style!r}; set --lr-decay-iters")
        if lr_decay_style != "constant" and lr_warmup_steps >= lr_decay_steps:
            raise ValueError(f"lr_warmup_steps ({lr_warmup_steps}) must be < lr_decay_steps "
                             f"({lr_decay_steps}); shorten the warmup or lengthen the decay")
        if (start_wd is None) != (end_wd is None):
            raise ValueError(f"give both start_wd ({start_wd}) and end_wd ({end_wd}), or neither")
        if start_wd is not None:
            if not 0.0 <= start_wd <= end_wd:
                raise ValueError(f"need 0 <= start_wd ({start_wd}) <= end_wd ({end_wd})")
            if wd_incr_style == "constant" and start_wd != end_wd:
                raise ValueError(f"wd_incr_style 'constant' needs start_wd ({start_wd}) == end_wd "
                                 f"({end_wd}); pick 'linear' or 'cosine' to change it")
            if wd_incr_style != "constant" and not (wd_incr_steps and wd_incr_steps > 0):
                raise ValueError(f"wd_incr_steps ({wd_incr_steps}) must be > 0 for wd_incr_style "
                                 f"{wd_incr_style!r}")
        if decoupled_min_lr is not None and decoupled_lr is None:
            raise ValueError(f"decoupled_min_lr ({decoupled_min_lr}) needs decoupled_lr")
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        self.decoupled_lr, self.decoupled_min_lr = decoupled_lr, decoupled_min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.use_checkpoint_values = use_checkpoint_values
        self.override_from_arguments = override_from_arguments
        if use_checkpoint_values and override_from_arguments:
            raise ValueError("--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler "
                             "are exclusive (use_checkpoint_values / override_from_arguments); "
                             "pick one")
        self.num_steps = 0
        self.step(0)

    def get_lr(self, param_group=None):
        """The learning rate of ``param_group`` at the current step (None: the main rate)."""
        max_lr, min_lr = self.max_lr, self.min_lr
        if param_group is not None:  # a group's own ends (muP's hidden groups)
            max_lr = param_group.get("max_lr", max_lr)
            min_lr = param_group.get("min_lr", min_lr)
        if param_group is not None and param_group.get("is_decoupled_lr") and \
                self.decoupled_lr is not None:
            max_lr = self.decoupled_lr
            if self.decoupled_min_lr is not None:
                min_lr = self.decoupled_min_lr
        step = self.num_steps
        if self.lr_warmup_steps > 0 and step <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(step) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if step > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
        decay_ratio = float(step - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "WSD":
            coeff = self._wsd_coeff(step)
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, step):
        """WSD's share of (max_lr - min_lr) at ``step``: 1 (stable) until the annealing phase,
        the last ``wsd_decay_steps`` steps of the decay, then its fraction r of that phase
        through the ``lr_wsd_decay_style`` shape (Megatron-LM's formulas)."""
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if step <= anneal_start:
            return 1.0
        ratio = float(step - anneal_start) / float(self.wsd_decay_steps)
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def get_wd(self):
        """The weight decay at the current step (None when no schedule was given)."""
        if self.start_wd is None:
            return None
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment=1):
        """Advance by ``increment`` steps and write lr (and weight decay) into the groups."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            if new_wd is not None:
                group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    def state_dict(self):
        """The schedule and its position."""
        sd = {key: getattr(self, key) for key in _CHECKED_KEYS
              if key not in _WSD_KEYS or self.lr_decay_style == "WSD"}
        sd["num_steps"] = self.num_steps
        return sd

    def load_state_dict(self, state_dict):
        """Resume at the saved step; see the class docstring for mismatched schedules."""
        mismatched = [key for key in _CHECKED_KEYS
                      if key in state_dict and getattr(self, key) != state_dict[key]]
        if mismatched and not (self.override_from_arguments or self.use_checkpoint_values):
            raise ValueError(self._mismatch_message(state_dict, mismatched))
        if self.use_checkpoint_values:
            for key in mismatched:
                setattr(self, key, state_dict[key])
        self.num_steps = 0
        self.step(int(state_dict["num_steps"]))

    def _mismatch_message(self, saved, keys):
        """Which schedule values differ, why (extending --train-iters moves the default
        --lr-decay-iters), and the flags that choose one schedule."""
        diffs = "; ".join(f"{k}{' (' + _FLAG_OF[k] + ')' if k in _FLAG_OF else ''} is "
                          f"{getattr(self, k)} now but {saved[k]} in the checkpoint" for k in keys)
        step, decay = saved["num_steps"], "lr_decay_steps" in keys
        follow = [what for key, what in (("lr_decay_steps", "--lr-decay-iters"),
                                         ("wd_incr_steps", "the weight-decay increment"))
                  if key in keys]
        why = (f" ({' and '.join(follow)} default{'s' if len(follow) == 1 else ''} to "
               f"--train-iters, so changing --train-iters changes "
               f"{'its' if len(follow) == 1 else 'their'} length)") if follow else ""
        keep = f" (past step {saved['lr_decay_steps']} the rate stays at --min-lr)" if decay else ""
        again = ""
        if all(k in _FLAG_OF and saved[k] is not None for k in keys):  # else no flag can
            again = (", or give the checkpoint's values again ("
                     + " ".join(f"{_FLAG_OF[k]} {saved[k]}" for k in keys) + ")")
        return (f"the learning-rate schedule differs from the checkpoint's: {diffs}{why}. Pass "
                f"--override-opt_param-scheduler to take the new schedule from step {step} on "
                f"(the rate moves to its value there) or --use-checkpoint-opt_param-scheduler "
                f"to keep the checkpoint's{keep}{again}")
