"""Count the host syncs a piece of code would cause on a GPU, on the CPU.

On a GPU, reading a device tensor on the host (``item``, ``tolist``, ``bool()`` of a
tensor, ``.cpu()``, ``.numpy()``, ``torch.equal``, ``nonzero``, boolean-mask indexing,
``repeat_interleave`` with tensor repeats and no ``output_size``, ``unique``) waits for the
device's queue to drain, and a tensor built from host data (``torch.tensor``,
``torch.as_tensor``) is a blocking host-to-device copy. On the CPU none of that stalls, so
:class:`SyncCounter` counts the calls instead: while it is open, those torch entry points are
wrapped (on the classes and modules themselves, so autograd's backward, which runs the
Functions' backward outside any TorchFunctionMode, is counted too) and every call is
recorded with the innermost frames of megatron_cp that made it.
"""
import traceback

import torch

# (owner, attribute): entry points that read a tensor on the host or copy host data over
_READS = [(torch.Tensor, name) for name in
          ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "nonzero",
           "unique", "unique_consecutive", "masked_select")]
_READS += [(torch, name) for name in
           ("equal", "nonzero", "unique", "unique_consecutive", "masked_select", "tensor",
            "as_tensor")]


def _sync_free_repeat(args, kwargs):
    """repeat_interleave syncs only when the repeats are a tensor and no output_size is given."""
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return not torch.is_tensor(repeats) or kwargs.get("output_size") is not None


def _sync_free_index(args, kwargs):
    """x[index] syncs when the index holds a boolean (mask) tensor."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return not any(torch.is_tensor(p) and p.dtype == torch.bool for p in parts)


_CONDITIONAL = [(torch.Tensor, "repeat_interleave", _sync_free_repeat),
                (torch, "repeat_interleave", _sync_free_repeat),
                (torch.Tensor, "__getitem__", _sync_free_index)]


class SyncCounter:
    """``with SyncCounter() as syncs: ...`` -> ``syncs.count`` and ``syncs.sites`` (one
    "name at file:line" per call, the innermost megatron_cp frame)."""

    def __init__(self):
        self.sites, self._saved, self._inside = [], [], False

    @property
    def count(self):
        return len(self.sites)

    def _wrap(self, owner, name, sync_free=None):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if not self._inside and (sync_free is None or not sync_free(args, kwargs)):
                self._inside = True  # calls made by this one are not counted again
                try:
                    self.sites.append(f"{name} at {_site()}")
                    return original(*args, **kwargs)
                finally:
                    self._inside = False
            return original(*args, **kwargs)
        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self):
        for owner, name in _READS:
            self._wrap(owner, name)
        for owner, name, sync_free in _CONDITIONAL:
            self._wrap(owner, name, sync_free)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []
        return False


def _site():
    """file:line of the innermost megatron_cp frame of the current stack (else the caller)."""
    frames = traceback.extract_stack()[:-3]
    ours = [f for f in frames if "megatron_cp" in f.filename and "/tests/" not in f.filename]
    frame = (ours or frames)[-1]
    return f"{frame.filename.split('megatron_cp/')[-1]}:{frame.lineno} ({frame.name})"
