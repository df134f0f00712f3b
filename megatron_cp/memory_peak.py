"""The one home of "peak tensor memory": how many bytes of tensors a block of code holds at
its worst moment, on a GPU and on the CPU alike.

    with PeakMemory(device) as meter:
        loss = model(...); loss.backward()
    meter.peak_bytes        # the high-water mark above the bytes live at entry
    meter.baseline_bytes    # bytes live at entry (see below)

GPU: the caching allocator's own counters, ``max_memory_allocated`` after a reset at entry,
minus ``memory_allocated`` at entry (through megatron_cp.device, the one torch.cuda home).

CPU: PyTorch's CPU allocator keeps no statistics, and the resident set (what the logs print)
counts the Python heap, the allocator's cached pages and the code, so it can't tell 100 MB
of logits from 100 MB of anything else. Instead the meter runs ``torch.profiler`` with
``profile_memory=True``: every allocation and free of a CPU tensor's storage (forward,
autograd-saved tensors, backward, optimizer) is reported with its exact byte count, and the
peak is the largest running sum of those events in time order. That is exact for every
tensor allocated on the threads the profiler follows (the caller's thread and autograd's);
memory a collective library allocates on its own threads, and Python objects, are not
tensors and are not counted. Overhead: the profiler records one event per operator and per
allocation (on the order of a microsecond each, plus the event list, which is walked once at
exit), negligible against the kernels of a training step, but it must not be nested inside
another profiler (torch refuses two at once), so meters do not nest either.

What the CPU meter does not see: the free of a storage allocated before entry (the profiler
never saw it allocated), so on the CPU ``peak_bytes`` is the peak of the block's own
allocations that are live at once, never credited with what it frees of older tensors; enter
at a point where the block frees nothing large that predates it (after ``zero_grad``, with
the previous step's graph gone). The GPU meter sees those frees; on a block that frees no
older tensor the two agree.

``baseline_bytes``: on the GPU the allocator's live bytes at entry; on the CPU the bytes of
the distinct tensor storages reachable from Python at entry (parameters, gradients,
optimizer state, data), found by one walk over the garbage collector's objects; storages
that only C++ holds (a pending autograd graph) are missed, so measure from a quiet point.
"""
import gc
import warnings

import torch

from megatron_cp import device as device_mod

_ACTIVE = []  # the meter running now, if any (meters do not nest)


class PeakMemory:
    """Context manager measuring the peak of tensor memory on ``device`` over its block.

    ``peak_bytes``: the largest amount of tensor memory held above the entry level at any
    moment in the block (0 when nothing grew; on the CPU, the block's own allocations live at
    once, see the module docstring). ``baseline_bytes``: tensor bytes live at
    entry (when ``measure_baseline``; else None). ``retained_bytes``: tensor bytes still held
    at exit above the entry level (negative when the block freed more than it kept).
    """

    def __init__(self, device, measure_baseline: bool = True):
        self.device = torch.device(device)
        self.measure_baseline = measure_baseline
        self.peak_bytes = None
        self.baseline_bytes = None
        self.retained_bytes = None
        self._profiler = None
        self._entry = 0

    def __enter__(self):
        if _ACTIVE:
            raise RuntimeError("PeakMemory meters do not nest (one allocator peak, one profiler)")
        _ACTIVE.append(self)
        if self.device.type == "cuda":
            device_mod.synchronize(self.device)
            self._entry = device_mod.memory_allocated(self.device)
            device_mod.reset_peak_memory(self.device)
            if self.measure_baseline:
                self.baseline_bytes = self._entry
        else:
            if self.measure_baseline:
                self.baseline_bytes = python_reachable_tensor_bytes(self.device)
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if self.device.type == "cuda":
                device_mod.synchronize(self.device)
                self.peak_bytes = max(0, device_mod.max_memory_allocated(self.device) - self._entry)
                self.retained_bytes = device_mod.memory_allocated(self.device) - self._entry
            else:
                self._profiler.__exit__(*exc)
                self.peak_bytes, self.retained_bytes = _peak_of_events(
                    self._profiler.profiler.kineto_results.events())
                self._profiler = None
        finally:
            _ACTIVE.remove(self)
        return False

    @property
    def peak_total_bytes(self):
        """Entry bytes plus the peak above them: the absolute high-water mark (None
        without a baseline)."""
        if self.baseline_bytes is None or self.peak_bytes is None:
            return None
        return self.baseline_bytes + self.peak_bytes


def _peak_of_events(events):
    """(peak, final) of the running sum of the CPU allocation events, in time order.

    Each ``[memory]`` event carries +bytes for an allocation and -bytes for a free; the frees
    of tensors made before entry are not reported (module docstring). The sort is stable, so
    events stamped in the same nanosecond keep the order they were recorded in."""
    cpu = torch.autograd.DeviceType.CPU
    mem = [e for e in events if e.name() == "[memory]" and e.device_type() == cpu]
    mem.sort(key=lambda e: e.start_ns())
    level = peak = 0
    for e in mem:
        level += e.nbytes()
        peak = max(peak, level)
    return peak, level


def python_reachable_tensor_bytes(device) -> int:
    """Bytes of the distinct storages of the tensors on ``device`` that Python can reach now
    (each storage counted once, however many views share it)."""
    device = torch.device(device)
    seen = {}
    with warnings.catch_warnings():  # touching deprecated torch objects in the heap warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type != device.type:
                continue
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # meta / fake (torch.compile's) / sparse
            continue
        if storage.nbytes() and pointer:
            seen[pointer] = storage.nbytes()
    return sum(seen.values())
