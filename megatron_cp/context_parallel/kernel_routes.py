"""Which CUDA attention kernel runs: the flash route forced and the kernel calls counted.

On sm90+ cuDNN takes every dense block, so the flash kernels (dense and varlen) never run
unless cuDNN is ruled out. :func:`cudnn_bypassed` rules it out and counts the calls of the
kernels in :data:`COUNTED`; tools/gpu_check.py's flash section and benchmarks/gpu.py's flash
rows run inside it.
"""
import contextlib
from unittest import mock

from megatron_cp.context_parallel import cuda_kernels

# kernels the CUDA backend calls through cuda_kernels, counted inside cudnn_bypassed
COUNTED = ("flash_forward", "flash_varlen_forward", "cudnn_forward", "efficient_forward")


@contextlib.contextmanager
def cudnn_bypassed(calls):
    """Inside: ``cuda_kernels.cudnn_eligible`` is False (dense blocks take flash; packed
    causal batches flash varlen) and ``calls`` counts the kernels of :data:`COUNTED`."""
    def counting(name, kernel):
        def call(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)
        return call

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(cuda_kernels, "cudnn_eligible",
                                              lambda q, k, v: False))
        for name in COUNTED:
            stack.enter_context(mock.patch.object(cuda_kernels, name,
                                                  counting(name, getattr(cuda_kernels, name))))
        yield
