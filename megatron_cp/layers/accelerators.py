"""The one import point for optional accelerators (apex, Transformer Engine, FLA); the norms
built on them are in :mod:`megatron_cp.layers.norms`.

Each is used only when importable AND the tensors live on a CUDA device (FLA: also only for
bf16 / fp16 values, and imported on first use); otherwise the pure-PyTorch code beside its
caller runs (always on CPU, so the tests exercise it).
"""
try:  # apex fused norms (CUDA kernels)
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm  # type: ignore
    from apex.normalization import FusedRMSNorm as _ApexRMSNorm  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _ApexLayerNorm = _ApexRMSNorm = None

try:  # apex fused Adam
    from apex.optimizers import FusedAdam as ApexFusedAdam  # type: ignore
except Exception:  # noqa: BLE001
    ApexFusedAdam = None

_NOT_LOOKED_UP = object()
_fla_chunk = _NOT_LOOKED_UP  # FLA's chunk_gated_delta_rule, or None; looked up on first use


def fla_chunk_gated_delta_rule():
    """flash-linear-attention's ``chunk_gated_delta_rule`` (its Triton kernels; the Gated
    DeltaNet layers on CUDA, pinned by setup.py's ``gpu`` extra), or None where FLA is not
    importable. Imported on the first call, not with this module: ``fla.ops`` loads every FLA
    op and Triton (2-3 s), which a CPU process or a model without GDN layers never needs.
    layers/gated_delta_rule.py calls it (``_fla_chunk``) with the dtypes and index types its
    entry point takes."""
    global _fla_chunk
    if _fla_chunk is _NOT_LOOKED_UP:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore
        except Exception:  # noqa: BLE001
            chunk_gated_delta_rule = None
        _fla_chunk = chunk_gated_delta_rule
    return _fla_chunk

try:  # Transformer Engine norms
    import transformer_engine.pytorch as _te  # type: ignore
except Exception:  # noqa: BLE001
    _te = None


def accelerators():
    """Which optional accelerators are importable (for logs; imports FLA, see
    :func:`fla_chunk_gated_delta_rule`)."""
    return {"apex_norm": _ApexLayerNorm is not None, "apex_adam": ApexFusedAdam is not None,
            "transformer_engine": _te is not None,
            "fla": fla_chunk_gated_delta_rule() is not None}
