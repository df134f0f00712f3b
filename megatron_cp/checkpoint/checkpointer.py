"""The Checkpointer: saves and loads a :class:`~megatron_cp.checkpoint.train_state.TrainState`
as a run's checkpoint section says, and owns what lives from one save to the next.

It is built from the sections a format reads -- the checkpoint section (where, the format,
what to save and load, async, integrity), the parallel layout (the rank grid a checkpoint
records, the files' names, gloo groups or not) and the optimizer section (which optimizer,
how the schedule counts, Megatron-FSDP's group defaults) -- and owns:

- its process group: a gloo group over every rank for checkpoint coordination, created
  collectively on the first save or load that needs it (the default group under
  ``--disable-gloo-process-groups``), so a background save never shares a communicator
  with training;
- the ``--async-save`` in flight: the next save, a load and :meth:`wait_for_async_save`
  wait for it (and re-raise its error).

:mod:`megatron_cp.checkpoint.load_save` picks the format; each format module takes the
TrainState and this Checkpointer, never knowing this module.
"""
import torch.distributed as dist

from megatron_cp.checkpoint import load_save


class Checkpointer:
    """Saves and loads TrainStates for one run.

    ``checkpoint``: the run's CheckpointConfig; ``parallel``: its ParallelConfig;
    ``optimizer``: its OptimizerConfig (kept as ``optimizer_config``)."""

    def __init__(self, checkpoint, parallel, optimizer):
        self.checkpoint = checkpoint
        self.parallel = parallel
        self.optimizer_config = optimizer
        self._group = None  # created on first use (a collective)
        self._pending = None  # the --async-save in flight (dcp_files.AsyncSave)

    def group(self):
        """The process group checkpoint I/O coordinates over: a gloo group of every rank
        (created once, collectively, by the first caller), or the default group (None) under
        --disable-gloo-process-groups, which writes an --async-save synchronously."""
        if not self.parallel.use_gloo_process_groups:
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    @property
    def async_save_pending(self):
        """Whether a background save is in flight."""
        return self._pending is not None

    def wait_for_async_save(self):
        """Block until the background save in flight (``--async-save``), if any, has written
        and committed; it re-raises the save's error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def save(self, train_state, root=None):
        """Save ``train_state`` (model, optimizer, scheduler, RNG, progress, arguments)
        atomically under ``root`` (default ``--save``) in ``--ckpt-format``; with
        ``--async-save`` (torch_dist, fsdp_dtensor) in the background, after the previous
        background save has finished."""
        if train_state.optimizer is None or train_state.scheduler is None:
            raise ValueError("a checkpoint saves the optimizer and the learning-rate schedule: "
                             "save a TrainState that holds both (a model alone is loaded, "
                             "never saved, here)")
        self.wait_for_async_save()
        root = self.checkpoint.save if root is None else root
        self._pending = load_save.save(train_state, self, root)

    def load(self, train_state, root=None):
        """Load the latest checkpoint under ``root`` (default ``--load``; ``--ckpt-step``'s
        iteration when given) into ``train_state``, whatever its format and layout, as the
        checkpoint section says; what ``train_state`` has no object for (an optimizer, a
        schedule, a rerun machine: None) is not read. Returns (iteration, consumed
        samples)."""
        self.wait_for_async_save()
        root = self.checkpoint.load if root is None else root
        return load_save.load(train_state, self, root)
