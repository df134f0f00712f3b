"""Launch a training script's ranks on this machine by forking one process that has already
imported torch and megatron_cp, instead of starting each rank anew as torchrun does.

    python tools/fork_launch.py --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ...

The ranks see what ``torchrun --standalone`` gives them (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and run the script as ``__main__`` with the same
arguments, so a flag set behaves exactly as under torchrun; only the start-up differs. Each
rank importing torch costs a few CPU seconds, which on a small CPU box is most of a short run
of many ranks (tools/megatron_flag_sets.py --run trains 200 sets of 8 to 32 ranks on 2 cores).

The exit status is the first failing rank's (the others are then stopped), else 0. A rank
dies with the launcher (Linux parent-death signal), so a timeout that kills the launcher
leaves no rank behind. Linux only (fork).

Known gap: a set with ``--num-workers`` > 0 can leave DataLoader worker processes running after
its ranks have ended (seen with Megatron-LM's 32-rank Mixtral 8x7B sets, which train and save
their checkpoint first); they hold the launcher's output pipe, so a caller reading it waits
for its timeout. Running the exit handlers and a garbage collection in the rank before it ends
did not stop them. Start such sets with torchrun (``--launcher torchrun`` in the census).
"""
import argparse
import ctypes
import os
import runpy
import signal
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent dies


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(script, args, rank, world):
    """In the forked child: become rank ``rank`` and run ``script``; never returns."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    sys.argv = [script, *args]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
    except BaseException:  # the traceback, as the rank would print it under torchrun
        import traceback

        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def launch(nproc, script, args):
    """Fork ``nproc`` ranks running ``script args``; the exit status (see the docstring)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(script, args, rank, nproc)
        children[pid] = rank
    failed = 0
    while children:
        pid, wait_status = os.wait()
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code  # a signal -n reads as 128 + n
            for other in children:  # as torchrun does: one rank failed, stop the rest
                os.kill(other, signal.SIGTERM)
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args()
    if a.nproc_per_node < 1:
        raise SystemExit(f"--nproc-per-node ({a.nproc_per_node}) must be at least 1")
    # what every rank imports, imported once before the fork
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import megatron_cp.training  # noqa: F401

    return launch(a.nproc_per_node, os.path.abspath(a.script), a.args)


if __name__ == "__main__":
    sys.exit(main())
