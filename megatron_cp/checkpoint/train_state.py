"""What a checkpoint saves and restores, as one object: :class:`TrainState`.

A save reads it; a load writes into its live objects (the model's params, the optimizer's
and the schedule's state, the rerun machine) and returns the progress it found. Whoever
holds the objects builds one: the Trainer from what it trains, inference from a model
alone (no optimizer, no schedule, no rerun machine: a load skips what is None).
"""
from dataclasses import dataclass
from typing import Any, List, Optional


@dataclass
class TrainState:
    """One rank's share of a training run, as a checkpoint holds it."""

    model_chunks: List[Any]
    """This rank's model chunks, one per virtual pipeline stage, in their data-parallel
    wrappers or bare (:func:`~megatron_cp.checkpoint.state.model_chunks` unwraps them)."""

    parallel_state: Any
    """The run's ParallelState: every group, rank and size, and the device."""

    model_config: Any
    """The model's GPTConfig (its real vocabulary, its experts, its activation)."""

    args: Any
    """The arguments a checkpoint saves as its own (Megatron-LM's flat namespace and names:
    part of the on-disk format, which Megatron-LM and our tools read), and so what a load
    compares the saved arguments' model shape with."""

    optimizer: Optional[Any] = None
    """The mixed-precision optimizer, or None: a model without one (inference), whose load
    reads the weights only."""

    scheduler: Optional[Any] = None
    """The learning-rate schedule, or None: nothing to save or resume of it."""

    rerun: Optional[Any] = None
    """The rerun state machine (:mod:`megatron_cp.resilience.rerun`), whose pending verdict
    travels with the RNG states, or None."""

    iteration: int = 0
    """Iterations done: what a save records, the folder it writes (``iter_N``)."""

    consumed_samples: int = 0
    """Training samples consumed so far (the data order resumes after them)."""

    @property
    def device(self):
        """The device this rank computes on (the ParallelState's)."""
        return self.parallel_state.device
