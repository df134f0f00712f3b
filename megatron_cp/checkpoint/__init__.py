"""Checkpoints: what a training state is, and how each on-disk format holds it.

Read top-down:

- ``checkpointer``: what a run holds, :class:`Checkpointer` -- built from the checkpoint
  section (and the parallel and optimizer sections where a format reads them), it saves and
  loads a TrainState, and owns the checkpoint process group and the ``--async-save`` in
  flight.
- ``load_save``: the entry the Checkpointer calls. ``save`` picks the format; ``load`` picks
  the format and the layout of what ``--load`` holds (the one place to read how);
  ``saved_args`` serves ``--use-checkpoint-args``. It imports the formats; none imports it.
- ``train_state``: :class:`TrainState`, what a checkpoint saves and restores -- model chunks,
  optimizer, scheduler and rerun machine (each may be None), progress, the arguments to save,
  the ParallelState, the model config. ``state``: how a TrainState is collected and restored
  (RNG, schedule, optimizer scalars), in the canonical form every layout reads.
- ``files``: the on-disk basics every format shares -- tracker, iteration folders, atomic
  writes and the commit, reading a file with one-line damage errors, the model-shape and
  rank-grid rules. ``faults``: a failed save in one line, a damaged file named.
- one module per format, none knowing another:
  ``torch_format`` (ours, a file per model-parallel rank; names: ``torch_shards``, read
  whole to reshard: ``torch_full``), ``torch_dist_format`` (ours, layout-free, on
  torch.distributed.checkpoint; ``integrity``: ``--verify-integrity``'s hashes) and
  Megatron-LM's own: ``megatron_lm_format`` (its torch_dist names and files; a TrainState's
  load from them: ``megatron_lm_load``; tools/checkpoint_convert.py's conversion to and from
  our full weights: ``megatron_lm_convert``) and ``fsdp_dtensor_format`` (Megatron-FSDP's
  ``--ckpt-format fsdp_dtensor``, written and read in any layout).
- below them: ``canonical`` (canonical names and shapes, where a rank's piece lies),
  ``pieces`` (a rank's boxes of one global tensor, and DCP's planners over them) and
  ``dcp_files`` (the DCP formats' atomic, optionally background, write and checked read).
- ``hf/``: the Hugging Face converters (a package of its own: one module per model family).
- ``use_checkpoint_args``: the ``--use-checkpoint-args`` rule (the model from the checkpoint,
  never its layout), applied by :func:`megatron_cp.cli.arguments.parse_args`.

This file imports nothing, so any of them can be imported alone.
"""
