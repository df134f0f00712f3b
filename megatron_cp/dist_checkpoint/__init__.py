"""Layout-free checkpoints (``--ckpt-format torch_dist``) on torch.distributed.checkpoint.

- ``canonical``: canonical names and shapes, and where a rank's piece of a param lies in them;
- ``pieces``: the DCP value made of boxes of one global tensor, and its planners;
- ``torch_dist``: a trainer's save (synchronous or ``--async-save``) and load, any layout;
- ``full``: one process reads a whole checkpoint as full tensors, or writes one from them
  (``tools/checkpoint_convert.py``);
- ``torch_full``: a ``--ckpt-format torch`` checkpoint read whole, and loaded into another
  layout than the saved one by copying each rank's pieces out of it.
"""
