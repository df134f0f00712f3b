"""The one import point for optional accelerators (apex, Transformer Engine).

Each is used only when importable AND the tensors live on a CUDA device; otherwise the
pure-PyTorch modules below run (always on CPU, so the tests exercise them).
"""
import torch
import torch.nn.functional as F

try:  # apex fused norms (CUDA kernels)
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm  # type: ignore
    from apex.normalization import FusedRMSNorm as _ApexRMSNorm  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _ApexLayerNorm = _ApexRMSNorm = None

try:  # apex fused Adam
    from apex.optimizers import FusedAdam as ApexFusedAdam  # type: ignore
except Exception:  # noqa: BLE001
    ApexFusedAdam = None

try:  # Transformer Engine norms
    import transformer_engine.pytorch as _te  # type: ignore
except Exception:  # noqa: BLE001
    _te = None


class RMSNorm(torch.nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, by ``F.rms_norm``.

    For bf16 / fp16 inputs PyTorch computes the mean square, the scaling and the weight
    product in fp32 and casts the result back once (a fused kernel on CUDA, one generated
    kernel under torch.compile), which is what an explicit fp32 formula computes, without
    its separate cast and elementwise kernels.
    """

    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32, device=None):
        super().__init__()
        self.eps, self.normalized_shape = eps, (hidden_size,)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


def build_norm(kind, hidden_size, eps, dtype, device):
    """A LayerNorm or RMSNorm, fused when an accelerator library is usable on ``device``."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if on_cuda and _te is not None:
        te_norm = _te.LayerNorm if kind == "LayerNorm" else _te.RMSNorm
        return te_norm(hidden_size, eps=eps, params_dtype=dtype, device=device)
    if kind == "LayerNorm":
        if on_cuda and _ApexLayerNorm is not None:
            return _ApexLayerNorm(hidden_size, eps=eps).to(device=device, dtype=dtype)
        return torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype, device=device)
    if kind == "RMSNorm":
        if on_cuda and _ApexRMSNorm is not None:
            return _ApexRMSNorm(hidden_size, eps=eps).to(device=device, dtype=dtype)
        return RMSNorm(hidden_size, eps=eps, dtype=dtype, device=device)
    raise ValueError(f"normalization {kind!r} must be LayerNorm or RMSNorm")


def accelerators():
    """Which optional accelerators were importable (for logs)."""
    return {"apex_norm": _ApexLayerNorm is not None, "apex_adam": ApexFusedAdam is not None,
            "transformer_engine": _te is not None}
