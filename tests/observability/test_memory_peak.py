"""PeakMemory (megatron_cp/observability/memory_peak.py) against allocations whose sizes are
known exactly."""
import pytest
import torch

from megatron_cp.distributed import device as device_mod
from megatron_cp.observability.memory_peak import PeakMemory, python_reachable_tensor_bytes

N = 1 << 18  # floats: 1 MiB
MIB = 1 << 20


def test_alloc_free_alloc_peaks_at_the_larger_tensor():
    with PeakMemory("cpu", measure_baseline=False) as meter:
        a = torch.empty(N)
        del a
        b = torch.empty(2 * N)
    assert meter.peak_bytes == 2 * MIB
    assert meter.retained_bytes == 2 * MIB
    del b


def test_two_live_tensors_add_up_and_freed_ones_are_not_retained():
    with PeakMemory("cpu", measure_baseline=False) as meter:
        a = torch.empty(N)
        b = torch.empty(3 * N)
        del a, b
    assert meter.peak_bytes == 4 * MIB
    assert meter.retained_bytes == 0


def test_autograd_saved_tensors_and_backward_are_counted():
    """exp saves its 1 MiB result for backward; backward allocates the 1 MiB gradient while
    the saved result is still alive: 2 MiB at once, plus the 4-byte loss scalar."""
    x = torch.randn(N, requires_grad=True)
    with PeakMemory("cpu", measure_baseline=False) as meter:
        loss = x.exp().sum()
        loss.backward()
    assert 2 * MIB <= meter.peak_bytes <= 2 * MIB + 64
    assert MIB <= meter.retained_bytes <= MIB + 64  # x.grad (and the loss scalar) remain


def test_baseline_counts_each_storage_once():
    before = python_reachable_tensor_bytes("cpu")
    keep = torch.empty(4 * N)
    views = [keep[: N], keep.view(4, N)]  # no new storage
    assert python_reachable_tensor_bytes("cpu") - before == 4 * MIB
    with PeakMemory("cpu") as meter:
        pass
    assert meter.baseline_bytes >= 4 * MIB and meter.peak_bytes == 0
    assert meter.peak_total_bytes == meter.baseline_bytes
    del keep, views


def test_the_cpu_meter_keeps_allocations_not_operators():
    """A thousand in-place operators on tensors allocate nothing and leave no event (a profile
    of every operator keeps one each): metering a training step (the log's
    --log-memory-to-tensorboard report on CPU) costs memory for its allocations only."""
    x = torch.zeros(N)
    with PeakMemory("cpu", measure_baseline=False) as meter:
        for _ in range(1000):
            x.relu_()
        y = torch.empty(N)
    assert meter.peak_bytes == MIB and meter.retained_bytes == MIB
    assert meter.recorded_events <= 10, meter.recorded_events
    del y


def test_meters_do_not_nest():
    with PeakMemory("cpu", measure_baseline=False):
        with pytest.raises(RuntimeError, match="do not nest"):
            with PeakMemory("cpu", measure_baseline=False):
                pass


def test_gpu_meter_reads_the_allocator_through_the_device_helper(monkeypatch):
    """The CUDA path's arithmetic with the device helper's counters stood in for: the peak
    is the allocator's high-water mark since entry minus the live bytes at entry."""
    counters = {"now": 100, "max": 500}
    monkeypatch.setattr(device_mod, "synchronize", lambda device: None)
    monkeypatch.setattr(device_mod, "memory_allocated", lambda device: counters["now"])
    monkeypatch.setattr(device_mod, "max_memory_allocated", lambda device: counters["max"])
    monkeypatch.setattr(device_mod, "reset_peak_memory",
                        lambda device: counters.update(max=counters["now"]))
    with PeakMemory(torch.device("cuda", 0)) as meter:
        counters.update(now=160, max=400)
    assert (meter.baseline_bytes, meter.peak_bytes, meter.retained_bytes) == (100, 300, 60)
    assert meter.peak_total_bytes == 400
