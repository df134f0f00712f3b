"""The one place that talks to torch.cuda: device choice, streams, sync and memory stats.

Everything else asks this module (or the ParallelState, which asks it) for its device, so
the CPU/gloo path and the GPU/NCCL path run the same code.
"""
import contextlib
import functools
import os

import torch


def accelerator_available() -> bool:
    """True when a CUDA device can be used."""
    return torch.cuda.is_available()


def default_backend() -> str:
    """nccl when CUDA is there, gloo otherwise."""
    return "nccl" if accelerator_available() else "gloo"


def device_for_local_rank(local_rank: int, backend: str) -> torch.device:
    """The device this process computes on: cuda:<local_rank> under nccl, else the CPU."""
    if backend == "nccl":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError("backend 'nccl' needs CUDA devices, found none; use --distributed-backend gloo")
        device = torch.device("cuda", local_rank % count)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def flash_attention_supported(device: torch.device) -> bool:
    """True when PyTorch's flash-attention kernels run on ``device`` (CUDA, sm80 or newer)."""
    return device.type == "cuda" and _device_capability(device) >= (8, 0)


def cudnn_attention_supported(device: torch.device) -> bool:
    """True when PyTorch's cuDNN attention runs on ``device`` (CUDA with cuDNN, sm90 or
    newer: where SDPA itself enables it)."""
    return (device.type == "cuda" and torch.backends.cudnn.is_available()
            and torch.backends.cudnn.enabled and _device_capability(device) >= (9, 0))


def compute_capability(device: torch.device):
    """(major, minor) compute capability of CUDA ``device``; None on the CPU."""
    return _device_capability(device) if device.type == "cuda" else None


def _device_capability(device):
    """(major, minor) compute capability of CUDA ``device`` (cached per index)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def enable_deterministic_mode() -> None:
    """Deterministic kernels from here on (--deterministic-mode): torch's deterministic
    algorithms (an op without one raises), cuBLAS's fixed workspace and one NCCL algorithm.
    Call it before the first NCCL communicator and cuBLAS handle are made; variables the
    user set are kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (a no-op on CPU); used by timers."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def side_stream(device: torch.device):
    """A second stream for communication that overlaps compute (None on CPU)."""
    if device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return None


def stream_context(stream):
    """Context manager that runs the enclosed ops on ``stream`` (nothing on CPU)."""
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def side_waits_for_current(stream, device) -> None:
    """Make ``stream`` wait for the work queued so far on ``device``'s current stream."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))


def wait_stream(stream) -> None:
    """Make the current stream wait for ``stream`` (nothing on CPU)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def record_stream(tensor, stream) -> None:
    """Keep the caching allocator from reusing ``tensor``'s memory before the work queued on
    ``stream`` has run (nothing on CPU or without a stream)."""
    if stream is not None and tensor.device.type == "cuda":
        tensor.record_stream(stream)


def record_event(stream):
    """An event recorded on ``stream`` now (None on CPU or without a stream)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(event, device: torch.device) -> None:
    """Make ``device``'s current stream wait for ``event`` (nothing for None)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def max_memory_allocated(device: torch.device) -> int:
    """Peak bytes allocated on ``device``; 0 on CPU where no allocator tracks it."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return 0


def memory_allocated(device: torch.device) -> int:
    """Bytes held by live tensors on ``device`` now; 0 on CPU where no allocator tracks it."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return 0


def reset_peak_memory(device: torch.device) -> None:
    """Start :func:`max_memory_allocated` afresh (nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def rng_state(device: torch.device):
    """The device RNG state (None on CPU, whose state is torch's default generator)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def set_rng_state(state, device: torch.device) -> None:
    """Restore a state from :func:`rng_state`."""
    if state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)


def manual_seed(seed: int, device: torch.device) -> None:
    """Seed the device generator (the CPU one is seeded by torch.manual_seed)."""
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def profiler_activities(device: torch.device):
    """torch.profiler activities for ``device``: the CPU, plus CUDA kernels on a GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def cuda_profiler_range(start: bool) -> None:
    """cudaProfilerStart / Stop (what an outside ``nsys --capture-range=cudaProfilerApi``
    waits for); nothing without CUDA."""
    if accelerator_available():
        (torch.cuda.cudart().cudaProfilerStart if start else torch.cuda.cudart().cudaProfilerStop)()


def empty_cache(device: torch.device) -> None:
    """Hand cached blocks back to the driver (nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    """'NVIDIA H200'-style name of a CUDA device, else the device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type
