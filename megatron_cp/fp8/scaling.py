"""FP8 formats and tensorwise scaling: one fp32 scale per tensor, ``q = sat(x * scale)``
stored in float8, read back as ``q / scale``.

Formulas (those of Transformer Engine's recipes and torchao's Float8Linear):

- current (tensorwise) scaling: ``scale = fp8_max / max(amax, EPS)``, the division of two
  fp32 numbers rounded once to fp32 (done in fp64: for fp32 operands that is the correctly
  rounded fp32 quotient);
- delayed scaling: ``scale = fp8_max / amax / 2**margin`` from the amax history, keeping the
  previous scale where that amax is 0 or not finite (or the scale would overflow fp32);
- the cast: ``x`` in fp32 times ``scale``, clamped to ``[-fp8_max, fp8_max]`` (saturation),
  rounded to nearest-even in the float8 format.
"""
import torch
import torch.distributed as dist

# Megatron-LM's --fp8-format: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients)
FORMATS = {"e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
           "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2)}
EPS = 1e-12  # the least amax a current scale divides by (an all-zero tensor gets max / EPS)


def fp8_max(dtype):
    """The largest finite value of float8 ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return torch.finfo(dtype).max


def amax_of(x, groups=()):
    """``max |x|`` over the whole logical tensor: this rank's piece, then the MAX over each
    of ``groups`` (None or one-rank groups skipped), as an fp32 scalar tensor."""
    amax = local_amax(x)
    return reduce_max(amax, groups)


def local_amax(x):
    """``max |x|`` of this rank's piece as an fp32 scalar tensor (0 for an empty one)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


def reduce_max(amax, groups):
    """``amax`` (a tensor) with each element the MAX over every group in ``groups``."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def scale_from_amax(amax, dtype):
    """Current scaling's scale for ``amax`` (fp32 scalar tensor): ``fp8_max / max(amax,
    EPS)`` rounded once to fp32."""
    return (fp8_max(dtype) / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)


def delayed_scale(amax, previous, dtype, margin):
    """Delayed scaling's new scale from the history's ``amax``: ``fp8_max / amax /
    2**margin``, the ``previous`` scale where ``amax`` is 0 or not finite, or so small that
    the scale overflows fp32."""
    fresh = (fp8_max(dtype) / amax.to(torch.float64) / 2.0 ** margin).to(torch.float32)
    # an amax so small that the scale overflows fp32 keeps the previous scale too
    keep = (amax <= 0) | ~torch.isfinite(amax) | ~torch.isfinite(fresh)
    return torch.where(keep, previous, fresh)


def quantize(x, scale, dtype):
    """``x`` as float8 ``dtype`` under ``scale`` (fp32 scalar tensor): ``sat(x * scale)``,
    same shape; the value it stands for is ``q.float() / scale``."""
    limit = fp8_max(dtype)
    return (x.to(torch.float32) * scale).clamp(-limit, limit).to(dtype)
