"""User errors as one line each, and the argument check the launch scripts run before torchrun.

A user error is a ``ValueError`` (a bad flag, a bad combination, a checkpoint that does not
fit) or an argparse error (unknown flag, bad value); the arguments raise every problem they
find at once (``checks.ArgumentErrors``). Each problem is printed as ONE line,
``error: <what and the fix>``, on global rank 0 only, and the process exits with status 2,
argparse's status for usage errors; anything else is a crash and keeps its traceback.

Under torchrun (which sets ``TORCHELASTIC_ERROR_FILE`` for each worker) the lines are also
written to the worker's error file, so torchrun's failure summary names them as the root
cause instead of a bare exit code.

torchrun prints its own failure block whenever a worker exits non-zero, so the example
scripts first check the arguments in one process, for the world size they will launch::

    python -m megatron_cp.cli.check_args --world-size 8 --num-layers 4 ...   # the training flags

which prints nothing and exits 0 when the arguments are valid, or prints the error lines
and exits 2. It also opens every ``--data-path`` prefix's .bin/.idx pair and checks that
they fit (each rank of the job only checks that they exist).
"""
import contextlib
import io
import signal
import sys
import threading
import time

from megatron_cp.resilience.faults import print_error_lines
from megatron_cp.observability.run_report import is_global_rank_zero

USAGE_ERROR = 2
# On a user error the ranks other than 0 wait this long before exiting: rank 0, which failed
# the same way, prints the line and exits first, and the launcher (torchrun, srun
# --kill-on-bad-exit) ends the others quietly. Exiting at once could get rank 0 killed
# before it prints. An error that came from a running job may be one rank's own (a missing
# checkpoint shard): a rank still alive after the wait then prints it, naming itself.
OTHER_RANK_GRACE_SECONDS = 3.0


def parse_arguments(argv, world_size, **options):
    """``arguments.parse_args`` (its errors are ValueErrors already, every problem at once),
    with its output (``--help``) printed by global rank 0 only. ``options`` go to
    ``parse_args`` (``extra_args_provider``, ``inference``)."""
    from megatron_cp.cli.arguments import parse_args
    out = sys.stdout if is_global_rank_zero() else io.StringIO()
    with contextlib.redirect_stdout(out):
        return parse_args(argv, world_size=world_size, **options)


def error_lines(error):
    """The problems of ``error``, one line each (an ``ArgumentErrors`` holds several)."""
    lines = getattr(error, "lines", None) or [str(error)]
    return [" ".join(line.split()) for line in lines]


def report_user_error(error, after_startup=False):
    """Print ``error: <problem>`` on stderr, a line per problem, once (global rank 0) and
    return exit status 2.

    Other ranks wait OTHER_RANK_GRACE_SECONDS first; with ``after_startup`` (the error came
    from a running job) they then print it too, prefixed with their rank."""
    lines = error_lines(error)
    if is_global_rank_zero():
        print_error_lines(lines)
        return USAGE_ERROR
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher may end us while we wait
    time.sleep(OTHER_RANK_GRACE_SECONDS)
    if after_startup:
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_initialized() else "?"
        print_error_lines([f"(rank {rank}) {line}" for line in lines])
    return USAGE_ERROR


def main(argv=None):
    """``--world-size N`` then the training flags: 0 when they are valid, else one line and 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "--world-size" or not argv[1].isdigit():
        print("error: usage: python -m megatron_cp.cli.check_args --world-size N <training flags>",
              file=sys.stderr)
        return USAGE_ERROR
    from megatron_cp.cli.checks import check_data_files
    try:
        args = parse_arguments(argv[2:], int(argv[1]))
        if args.data_path and not args.mock_data:  # here, once: the files open and fit
            check_data_files(args.data_path, args.mmap_bin_files, open_files=True)
    except ValueError as error:
        return report_user_error(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
