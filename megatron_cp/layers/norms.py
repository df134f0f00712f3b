"""The norms of a transformer layer (:func:`norm_for`: the config's LayerNorm or RMSNorm,
zero-centred or not): apex's or Transformer Engine's fused kernels where
:mod:`megatron_cp.layers.accelerators` found them and the tensors are on a CUDA device, else
the pure-PyTorch modules here (always on CPU, so the tests exercise them)."""
import torch
import torch.nn.functional as F

from megatron_cp.layers.accelerators import _ApexLayerNorm, _ApexRMSNorm, _te


class RMSNorm(torch.nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, by ``F.rms_norm``.

    For bf16 / fp16 inputs PyTorch computes the mean square, the scaling and the weight
    product in fp32 and casts the result back once (a fused kernel on CUDA, one generated
    kernel under torch.compile), which is what an explicit fp32 formula computes, without
    its separate cast and elementwise kernels. ``zero_centered_gamma``: see :func:`build_norm`.
    """

    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32, device=None,
                 zero_centered_gamma=False):
        super().__init__()
        self.eps, self.normalized_shape = eps, (hidden_size,)
        self.zero_centered_gamma = zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype, device=device))

    def forward(self, x):
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class LayerNorm1p(torch.nn.LayerNorm):
    """LayerNorm whose stored weight w is zero-centred: it scales by (1 + w) (Megatron-LM's
    ``--apply-layernorm-1p``); w and the bias start at 0."""

    def __init__(self, hidden_size, eps=1e-5, dtype=torch.float32, device=None):
        super().__init__(hidden_size, eps=eps, dtype=dtype, device=device)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def build_norm(kind, hidden_size, eps, dtype, device, zero_centered_gamma=False):
    """A LayerNorm or RMSNorm, fused when an accelerator library is usable on ``device``.

    ``zero_centered_gamma`` (``--apply-layernorm-1p``): the stored weight w starts at 0 and
    the norm scales by (1 + w), for either kind, as Megatron-LM's norms do. Where weight decay
    reaches a norm (the QK norms with --apply-wd-to-qk-layernorm) it pulls w towards 0, so the
    scale towards 1. apex's norms have no such option: the zero-centred norms use PyTorch's
    (or Transformer Engine's) kernels.
    """
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if kind not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization {kind!r} must be LayerNorm or RMSNorm")
    if on_cuda and _te is not None:
        te_norm = _te.LayerNorm if kind == "LayerNorm" else _te.RMSNorm
        return te_norm(hidden_size, eps=eps, params_dtype=dtype, device=device,
                       zero_centered_gamma=zero_centered_gamma)
    if zero_centered_gamma:
        if kind == "LayerNorm":
            return LayerNorm1p(hidden_size, eps=eps, dtype=dtype, device=device)
        return RMSNorm(hidden_size, eps=eps, dtype=dtype, device=device, zero_centered_gamma=True)
    if kind == "LayerNorm":
        if on_cuda and _ApexLayerNorm is not None:
            return _ApexLayerNorm(hidden_size, eps=eps).to(device=device, dtype=dtype)
        return torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype, device=device)
    if on_cuda and _ApexRMSNorm is not None:
        return _ApexRMSNorm(hidden_size, eps=eps).to(device=device, dtype=dtype)
    return RMSNorm(hidden_size, eps=eps, dtype=dtype, device=device)


def norm_for(config, hidden_size, device=None):
    """The config's norm (``normalization``, ``norm_epsilon``, ``params_dtype``, zero-centred
    weights with ``layernorm_zero_centered_gamma``) over a last dim of ``hidden_size``."""
    return build_norm(config.normalization, hidden_size, config.norm_epsilon,
                      config.params_dtype, device, config.layernorm_zero_centered_gamma)
