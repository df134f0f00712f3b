"""Run a function on N gloo worker processes from a test, and never hang.

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes, initializes a gloo
process group in each (a FileStore in a fresh temp dir), calls ``fn(rank, world_size,
*args)`` and returns the list of per-rank return values. If any worker raises, the test
fails with that worker's traceback; if the workers do not finish within ``timeout``
seconds, they are killed and the test fails naming the ranks still running.
"""
import datetime
import io
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import reduction


class WorkerError(AssertionError):
    """A worker process failed; the message carries its traceback."""


# Workers fork from one forkserver per test process, started once with torch and the
# package already imported: a worker then starts in milliseconds instead of importing torch
# anew (about 2.5 s of CPU a rank under "spawn"; tests/context_parallel/test_context_parallel.py went from
# 26 s to 6 s). The server itself has run no torch op, so no thread pool is forked
# half-initialised.
_PRELOAD = ["torch", "torch.distributed", "megatron_cp.training", "megatron_cp.model.gpt",
            "dist_harness"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _InheritedFd:
    """The parent's file descriptor as it points now, handed to a forkserver child.

    The forkserver's own stdout and stderr are whatever they were when it started (perhaps an
    earlier test's capture); a worker writes where the test's are now, as a spawned process
    would, so pytest's capture and the terminal see its output.
    """

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        return _attach_fd, (reduction.DupFd(self.fd),)


def _attach_fd(dup):
    return dup.detach()


def _worker(rank, world_size, store_path, fn, args, results, timeout, environ, stdio):
    # The forkserver's environment is the one it started with; a worker takes the test's own
    # (a test may have set variables since), as a spawned process would.
    os.environ.clear()
    os.environ.update(environ)
    for fd, inherited in zip((1, 2), stdio):
        os.dup2(inherited, fd)
        os.close(inherited)
    os.environ["MEGATRON_CP_TEST_WORKER"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", _to_bytes(out)))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_bytes(value):
    """Serialize a result so that no tensor travels as a shared-memory file descriptor.

    A queue would otherwise hand each tensor over through the worker's resource sharer, which
    dies with the worker: a worker that exits before the test reads its result then fails the
    test with "Connection reset by peer". Bytes are owned by the queue and outlive the worker.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data):
    return torch.load(io.BytesIO(data), weights_only=False)


def run_workers(fn, world_size, *args, timeout=240):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo workers; return their results."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker,
                             args=(r, world_size, store, fn, args, results, timeout,
                                   dict(os.environ), (_InheritedFd(1), _InheritedFd(2))),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outputs, errors = {}, {}
        deadline = timeout + 60
        try:
            while len(outputs) + len(errors) < world_size:
                try:
                    rank, status, payload = results.get(timeout=deadline)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outputs) - set(errors))
                    raise WorkerError(f"workers {missing} did not finish within {deadline}s "
                                      f"(errors so far: {errors})") from None
                if status == "ok":
                    outputs[rank] = _from_bytes(payload)
                else:
                    errors[rank] = payload
                    break  # one failure is enough: the others may be blocked on it
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
        if errors:
            rank, tb = sorted(errors.items())[0]
            raise WorkerError(f"worker rank {rank} of {world_size} failed:\n{tb}")
    return [outputs[r] for r in range(world_size)]
