"""Activations saved for backward, kept in host memory between forward and backward
(Megatron-LM's --cpu-offloading-num-layers N: the first N transformer layers).

Backward needs a layer's saved activations only when it reaches that layer again, long after
forward produced them; the first layers wait longest. :class:`ActivationOffloader` installs
``torch.autograd.graph.saved_tensors_hooks`` around those layers: pack copies each saved
device tensor into pinned host memory on a side stream (the device copy can then be freed as
soon as the copy has run), unpack brings it back in backward. Parameters are not moved (they
stay on the device for the optimizer: Megatron-LM's cpu_offloading_weights is False by
default). With full recomputation the tensors a checkpointed layer saves are its inputs, so
the checkpoints themselves move to the host, ALST's way.

On a CPU the activations already live in host memory, so the model installs no hooks and
:func:`offload_note` says so once; the hooks' own logic runs on CPU tensors in the tests
(a host copy of a CPU tensor is a second CPU tensor).
"""
import torch

from megatron_cp.distributed import device as device_mod


class ActivationOffloader:
    """pack/unpack of saved tensors between ``device`` and host memory.

    ``pin``: page-locked host buffers (asynchronous copies; GPU only). ``stream``: where the
    device-to-host copies run (None: the current stream). Tensors not on ``device`` and
    parameters are saved as they are. ``retain`` (--cpu-offloading-retain-pinned-cpu-buffers):
    a host buffer whose tensor came back is kept and reused by a later tensor of its shape
    and dtype (the next steps' same layers) instead of being allocated anew; a reuse is
    ordered after the copy back because the side stream waits for the current one.
    """

    def __init__(self, device, pin=None, stream=None, retain=False):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin
        self.stream = stream
        self.pool = {} if retain else None  # (shape, dtype) -> free host buffers

    def pack(self, tensor):
        if tensor.device.type != self.device.type or isinstance(tensor, torch.nn.Parameter):
            return tensor
        free = self.pool.get((tensor.shape, tensor.dtype)) if self.pool is not None else None
        host = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                  pin_memory=self.pin)
        # the side stream must see the tensor finished, and the caching allocator must not
        # reuse its memory before the copy has run
        device_mod.side_waits_for_current(self.stream, self.device)
        with device_mod.stream_context(self.stream):
            host.copy_(tensor, non_blocking=self.pin)
        device_mod.record_stream(tensor, self.stream)
        return _OnHost(host, tensor.device)

    def unpack(self, packed):
        if not isinstance(packed, _OnHost):
            return packed
        device_mod.wait_stream(self.stream)  # the device-to-host copy has landed
        back = packed.host.to(packed.device, non_blocking=self.pin)
        if self.pool is not None:
            self.pool.setdefault((packed.host.shape, packed.host.dtype), []).append(packed.host)
        return back

    def context(self):
        """The hooks, for the forward of an offloaded layer."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _OnHost:
    """A saved tensor while it waits in host memory."""
    __slots__ = ("host", "device")

    def __init__(self, host, device):
        self.host, self.device = host, device


def offloader_for(num_layers, device, retain=False):
    """The offloader of --cpu-offloading-num-layers ``num_layers`` on ``device`` (``retain``:
    --cpu-offloading-retain-pinned-cpu-buffers): None when off or when the device is the CPU
    (nothing to offload to)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if not num_layers or device.type != "cuda":
        return None
    return ActivationOffloader(device, stream=device_mod.side_stream(device), retain=retain)


def offload_note(num_layers, device):
    """The one line that says the flag does nothing here (the CPU), else None."""
    if num_layers and torch.device(device).type != "cuda":
        return (f"> --cpu-offloading-num-layers {num_layers}: activations already live in host "
                f"memory on {torch.device(device).type}; nothing is offloaded")
    return None
