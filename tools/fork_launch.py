"""Launch a training script's ranks on this machine by forking one process that has already
imported torch and megatron_cp, instead of starting each rank anew as torchrun does.

    python tools/fork_launch.py --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ...

The ranks see what ``torchrun --standalone`` gives them (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and run the script as ``__main__`` with the same
arguments, so a flag set behaves exactly as under torchrun; only the start-up differs. Each
rank importing torch costs a few CPU seconds, which on a small CPU box is most of a short run
of many ranks (tools/megatron_flag_sets.py --run trains 200 sets of 8 to 32 ranks on 2 cores).

The exit status is the first failing rank's (the others are then stopped), else 0; a SIGTERM
or SIGINT to the launcher is passed on to the ranks, as torchrun does. Nothing the ranks start
outlives the launcher: it adopts what a rank leaves behind when the rank ends (Linux child
subreaper) and ends it once the ranks are done (SIGTERM, then SIGKILL after a grace period),
as torchrun ends each rank's process group. A forked rank ends with ``os._exit``, which runs
no finaliser, so without this its DataLoader workers (``--num-workers``) would run on after it
until their own parent check noticed (every 5 s), and a rank stopped by a signal leaves them
too; they hold the output pipe, and a caller reading it waits for them. A rank dies with the
launcher (Linux parent-death signal), so a launcher killed outright leaves no rank behind; the
ranks' workers then end by their own parent check. Linux only (fork).
"""
import argparse
import ctypes
import gc
import os
import runpy
import signal
import socket
import sys
import time


_PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent dies
_PR_SET_CHILD_SUBREAPER = 36  # prctl option: orphaned descendants are re-parented to this process
LEFTOVER_GRACE_SECONDS = 5.0  # what a rank left behind has between SIGTERM and SIGKILL


def _prctl(option, value):
    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(script, args, rank, world):
    """In the forked child: become rank ``rank`` and run ``script``; never returns."""
    status = 0
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        sys.argv = [script, *args]
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
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # not inherited by the ranks
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    try:
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _run_rank(script, args, rank, nproc)
            ranks[pid] = rank
        return _wait_for_ranks(ranks)
    finally:
        _end_leftovers()


def _wait_for_ranks(ranks):
    """Reap processes until every rank has ended (what else is reaped is a rank's leftover,
    adopted); the exit status. A SIGTERM or SIGINT to the launcher is sent on to the ranks
    (installed after the fork: the ranks keep Python's own handlers)."""
    failed = 0

    def stop_ranks(signum, frame):
        nonlocal failed
        failed = failed or 128 + signum
        for pid in ranks:
            os.kill(pid, signum)

    signal.signal(signal.SIGTERM, stop_ranks)
    signal.signal(signal.SIGINT, stop_ranks)
    while ranks:
        pid, wait_status = os.wait()
        if ranks.pop(pid, None) is None:
            continue
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code  # a signal -n reads as 128 + n
            for other in ranks:  # as torchrun does: one rank failed, stop the rest
                os.kill(other, signal.SIGTERM)
    return failed


def children_of(parent):
    """The pids whose parent is ``parent`` (for the launcher: adopted ones included), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:  # "pid (comm) state ppid ..."
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # it ended while we looked
            if ppid == parent:
                found.append(int(entry))
    return found


def _end_leftovers():
    """End and reap every process still below the launcher: SIGTERM, then SIGKILL what is
    left after LEFTOVER_GRACE_SECONDS. A process ended may leave children of its own, which
    are adopted in turn, so this repeats until none is left."""
    deadline, asked = time.monotonic() + LEFTOVER_GRACE_SECONDS, set()
    while children := children_of(os.getpid()):
        late = time.monotonic() > deadline
        for pid in children:
            if late or pid not in asked:
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                asked.add(pid)
        time.sleep(0.05)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap what has ended
                pass
        except ChildProcessError:
            pass


def _share_with_ranks():
    """Keep the launcher's memory shared with the forked ranks: import what every rank
    imports (torch, megatron_cp) and the writers a rank loads at start-up (tensorboard,
    wandb when installed) here, once, and move every object so far to the collector's
    permanent generation (``gc.freeze``), so that a rank's collections never write to them
    and copy their pages (about 75 MB a rank otherwise)."""
    import importlib
    import megatron_cp.training  # noqa: F401  (torch and torch.distributed with it)
    for name in ("torch.utils.tensorboard", "wandb"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args()
    if a.nproc_per_node < 1:
        raise SystemExit(f"--nproc-per-node ({a.nproc_per_node}) must be at least 1")
    _share_with_ranks()
    return launch(a.nproc_per_node, os.path.abspath(a.script), a.args)


if __name__ == "__main__":
    sys.exit(main())
