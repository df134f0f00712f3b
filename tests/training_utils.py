"""Run the real training loop inside harness workers and compare layouts' loss curves.

``TINY`` trains with Megatron-LM's default dropout (hidden and attention 0.1): every dropout
mask follows global coordinates, so each layout must still equal one process. A test whose
peer runs without dropout (megatron-core, Hugging Face) appends ``NO_DROPOUT``."""
import torch

from megatron_cp.cli.arguments import ArgumentErrors, parse_args
from megatron_cp.training import Trainer, pretrain
from megatron_cp.startup import build_parallel_state, run_config

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 "
        "--lr-decay-style cosine --hidden-dropout 0.1 --attention-dropout 0.1 --mock-data "
        "--vocab-size 200 --make-vocab-size-divisible-by 64 --log-interval 100 --eval-iters 0 "
        "--seed 11 --position-embedding-type rope --clip-grad 1.0")
NO_DROPOUT = " --hidden-dropout 0 --attention-dropout 0"


def run_and_state(args):
    """Worker: the RunConfig of the checked ``args`` and its ParallelState on the CPU (the
    harness has started torch.distributed)."""
    run = run_config(args)
    return run, build_parallel_state(run.parallel, run.model, run.optimizer, torch.device("cpu"))


def parallel_state(args):
    """Worker: the ParallelState of the checked ``args`` (:func:`run_and_state`)."""
    return run_and_state(args)[1]


def trainer_of(argv, world):
    """Worker: the Trainer of ``argv`` parsed for this world size, its iterators built."""
    args = parse_args(argv.split(), world_size=world)
    run, state = run_and_state(args)
    trainer = Trainer(args, state, run)
    trainer.build_iterators()
    return trainer


def train_losses(rank, world, argv):
    """Worker: parse ``argv`` for this world size, train, return the per-iteration losses."""
    args = parse_args(argv.split() if isinstance(argv, str) else argv, world_size=world)
    return pretrain(args, parallel_state(args))


def trained(rank, world, argv):
    """Worker: train ``argv`` as :func:`train_losses` does; (its losses, the Trainer that
    pretrain built), for a test that reads the trainer's state after the run."""
    built, real_init = [], Trainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(self)
    Trainer.__init__ = init
    try:
        losses = train_losses(rank, world, argv)
    finally:
        Trainer.__init__ = real_init
    return losses, built[0]


def train_runs(rank, world, argvs):
    """Worker: train each of ``argvs`` in turn in one process group; per run its losses, or
    the error line it stopped with (a ValueError: a refused flag or checkpoint)."""
    out = []
    for argv in argvs:
        try:
            out.append(train_losses(rank, world, argv))
        except ValueError as error:
            out.append(str(error))
    return out


def max_rel_diff(losses, reference):
    assert len(losses) == len(reference), (len(losses), len(reference))
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def assert_refused(argv, line, world_size=1):
    """``parse_args`` refuses ``argv`` with an error line that starts with ``line``."""
    try:
        parse_args(argv.split(), world_size=world_size)
    except ArgumentErrors as error:
        assert any(printed.startswith(line) for printed in error.lines), (line, error.lines)
        return
    raise AssertionError(f"accepted, but should be refused with {line!r}: {argv}")
