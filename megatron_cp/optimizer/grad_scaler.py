"""Loss scalers for fp16 training: a constant scale and Megatron's dynamic scale.

The training loop multiplies the loss by ``scaler.scale`` before backward; the optimizer
divides the gradients by it (``scaler.inv_scale``), checks them for inf/nan and calls
``scaler.update(found_inf)``. Scales are plain Python floats: they are identical on every
rank because ``found_inf`` is agreed on by all ranks before ``update``.
"""
import math


class ConstantGradScaler:
    """A fixed loss scale; ``update`` does nothing (steps with inf/nan are still skipped)."""

    def __init__(self, scale):
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale ({scale}) must be a finite number > 0; "
                             f"pass e.g. --loss-scale 4096, or leave it unset for dynamic scaling")
        self._scale = float(scale)

    @property
    def scale(self):
        """The current loss scale (a float)."""
        return self._scale

    @property
    def inv_scale(self):
        """1 / scale: what the gradients are multiplied by to unscale them."""
        return 1.0 / self._scale

    def update(self, found_inf):
        """Nothing to adapt for a constant scale."""

    def state_dict(self):
        """Checkpointable state (the scale itself)."""
        return {"scale": self._scale}

    def load_state_dict(self, state_dict):
        """Restore the scale saved by :meth:`state_dict`."""
        self._scale = float(state_dict["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Megatron's dynamic loss scale with hysteresis.

    On a step with inf/nan gradients the growth counter restarts and the hysteresis counter
    drops by one; once it reaches zero the scale is multiplied by ``backoff_factor`` (never
    below ``min_scale``), and it keeps backing off on every further bad step until a growth
    happens. After ``growth_interval`` consecutive good steps the scale is multiplied by
    ``growth_factor`` and the hysteresis counter is refilled.
    """

    def __init__(self, initial_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=1000, hysteresis=2):
        super().__init__(initial_scale)
        if not (isinstance(min_scale, (int, float)) and 0 < min_scale <= initial_scale):
            raise ValueError(f"min_scale ({min_scale}) must be > 0 and <= initial_scale "
                             f"({initial_scale}); lower --min-loss-scale or raise --initial-loss-scale")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor ({growth_factor}) must be > 1; use e.g. 2.0")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor ({backoff_factor}) must be in (0, 1); use e.g. 0.5")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(f"growth_interval ({growth_interval}) must be an integer > 0; "
                             f"use e.g. --loss-scale-window 1000")
        if not (isinstance(hysteresis, int) and hysteresis > 0):
            raise ValueError(f"hysteresis ({hysteresis}) must be an integer > 0; use e.g. --hysteresis 2")
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf):
        """Adapt the scale after a step; ``found_inf`` must be the same on every rank."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self):
        """Scale and both counters, so a resumed run scales exactly as the original."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict):
        """Restore what :meth:`state_dict` saved."""
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
