"""The start-up of an inference script (``tasks/main.py``, ``tools/run_text_generation.py``).

Launched like training (torchrun or srun, the same parallel flags): parse and check the
arguments before any process group (a user error prints one ``error:`` line on global rank
0 and exits 2, :mod:`megatron_cp.cli.check_args`), start torch.distributed, build the parallel
state and run the script's body; a ValueError raised while running (a checkpoint that does
not fit the layout, a bad input file) is reported the same way.

This is the command line's side of the package: a script's parsed arguments hold its own flags
(``--prompt``, ``--task`` ...) beside the run's; :func:`load_model` turns them into the
:class:`~megatron_cp.config.run.RunConfig` that :class:`~megatron_cp.inference.model.InferenceModel`
and the rest of the package take.
"""
import sys

import torch.distributed as dist

from megatron_cp.cli.check_args import parse_arguments, report_user_error
from megatron_cp.config.checkpoint import CheckpointConfig
from megatron_cp.config.data import DataConfig
from megatron_cp.config.run import RunConfig
from megatron_cp.config.setting import build_config
from megatron_cp.data import tokenizer_from_config
from megatron_cp.distributed.initialize import distributed_env, initialize_distributed
from megatron_cp.inference.model import InferenceModel, check_checkpoint


def parse_inference_args(argv, world_size, extra_args_provider, check=None):
    """Validated arguments of an inference script: the training flags plus the script's own
    (``extra_args_provider(parser)``), with --lr / --train-iters / a dataset not needed;
    ``check(args)`` raises ValueError for the script's own rules."""
    args = parse_arguments(argv, world_size, extra_args_provider=extra_args_provider,
                           inference=True)
    check_checkpoint(build_config(CheckpointConfig, args), build_config(DataConfig, args))
    if check is not None:
        check(args)
    return args


def load_model(args, state):
    """The :class:`InferenceModel` of a script's checked arguments ``args`` on this rank
    (``state``): the tokenizer they name gives the vocabulary of their
    :class:`~megatron_cp.config.run.RunConfig`. ``args`` also go to the checkpoint load, which
    reads them (and is told to load the weights only)."""
    tokenizer = tokenizer_from_config(build_config(DataConfig, args))
    run = RunConfig.from_args(args, tokenizer.vocab_size)
    return InferenceModel(run, state, tokenizer, checkpoint_args=args)


def run_inference_script(body, argv, extra_args_provider, check=None):
    """Parse, start the process groups and call ``body(args, state)``; returns the exit
    status (0, or 2 after one ``error:`` line) and leaves the process group destroyed."""
    from megatron_cp.startup import build_parallel_state, run_config
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_inference_args(argv, distributed_env()["world_size"], extra_args_provider,
                                    check)
    except ValueError as error:
        return report_user_error(error)
    try:
        _, _, device = initialize_distributed(args.distributed_backend,
                                              args.distributed_timeout_minutes)
        run = run_config(args)
        body(args, build_parallel_state(run.parallel, run.model, run.optimizer, device))
    except ValueError as error:
        return report_user_error(error, after_startup=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
