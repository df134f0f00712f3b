"""One run's whole configuration: every section, built once from the checked command line
and frozen. Each subsystem is handed its own section."""
from dataclasses import dataclass

from megatron_cp.config.checkpoint import CheckpointConfig
from megatron_cp.config.data import DataConfig
from megatron_cp.config.logging import LoggingConfig
from megatron_cp.config.model import GPTConfig
from megatron_cp.config.optimizer import OptimizerConfig
from megatron_cp.config.parallel import ParallelConfig
from megatron_cp.config.setting import build_config
from megatron_cp.config.training import TrainingConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The sections of one run. ``notes``: the start-up notes of the Megatron-LM flags that
    change nothing here (what each would do in Megatron-LM)."""
    model: GPTConfig
    optimizer: OptimizerConfig
    parallel: ParallelConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    notes: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args, vocab_size):
        """The run that the checked arguments ``args`` (:func:`megatron_cp.cli.arguments.parse_args`)
        describe, with the tokenizer's ``vocab_size``."""
        return cls(model=build_config(GPTConfig, args, vocab_size=vocab_size),
                   optimizer=build_config(OptimizerConfig, args),
                   parallel=build_config(ParallelConfig, args),
                   training=build_config(TrainingConfig, args),
                   data=build_config(DataConfig, args),
                   checkpoint=build_config(CheckpointConfig, args),
                   logging=build_config(LoggingConfig, args),
                   notes=tuple(vars(args).get("compat_notes", ())))
