"""Megatron-LM's ``--profile``: iterations [--profile-step-start, --profile-step-end) of the
ranks in --profile-ranks (every rank when it names none, as in Megatron-LM), under
torch.profiler (``--use-pytorch-profiler``) or between cudaProfilerStart / Stop for an outside ``nsys profile --capture-range=cudaProfilerApi``.

The torch.profiler trace goes to ``--tensorboard-dir`` (tensorboard's profile plugin reads it;
without the flag, to ``profile/`` under ``--save``, else ``./profile``), and the profiled rank
prints the operators that took the most device time (CPU time on a CPU run), so a first look
needs no viewer.
"""
import os

import torch

from megatron_cp.distributed import device as device_mod

TABLE_ROWS = 25


class StepProfiler:
    """Call :meth:`step` once after every training iteration (``iteration`` is the number of
    iterations done). Inactive unless --profile is given and this rank is profiled."""

    def __init__(self, logging, save, global_rank, device):
        """``logging``: the logging section (its ``profile*`` fields, ``use_pytorch_profiler``
        and ``tensorboard_dir``); ``save``: the checkpoint folder (--save, or None), under
        which the trace goes without a tensorboard folder."""
        self.active = logging.profile and (not logging.profile_ranks
                                           or global_rank in logging.profile_ranks)
        self.start, self.end = logging.profile_step_start, logging.profile_step_end
        self.torch_profiler = logging.use_pytorch_profiler
        self.device, self.rank, self.running = device, global_rank, None
        self.trace_dir = logging.tensorboard_dir or os.path.join(save or ".", "profile")

    def step(self, iteration):
        """Start before iteration ``start`` + 1 runs (i.e. once ``start`` are done), stop
        once ``end`` iterations are done."""
        if not self.active:
            return
        if self.running is None and iteration == self.start:
            self._begin()
        elif self.running is not None and iteration >= self.end:
            self._finish()

    def _begin(self):
        if self.torch_profiler:
            self.running = torch.profiler.profile(
                activities=device_mod.profiler_activities(self.device), record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    self.trace_dir, worker_name=f"rank{self.rank}"))
            self.running.__enter__()
        else:
            device_mod.cuda_profiler_range(start=True)
            self.running = True

    def _finish(self):
        if self.torch_profiler:
            device_mod.synchronize(self.device)
            self.running.__exit__(None, None, None)
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = self.running.key_averages().table(sort_by=key, row_limit=TABLE_ROWS)
            print(f"profile of iterations {self.start + 1}..{self.end} on rank {self.rank} "
                  f"(trace under {self.trace_dir}):\n{table}", flush=True)
        else:
            device_mod.cuda_profiler_range(start=False)
        self.running, self.active = None, False

    def close(self):
        """Stop a profile still running (training ended inside the window)."""
        if self.running is not None:
            self._finish()
