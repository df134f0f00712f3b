"""The training loop and what it drives: :func:`pretrain` (and ``main``, pretrain_gpt.py's entry
point) in loop.py, the :class:`Trainer` with one step and evaluation in trainer.py. Nothing
below the loop imports this package: what inference, tasks and tools share with training to
start lives in :mod:`megatron_cp.startup`."""
from megatron_cp.training.loop import main, pretrain  # noqa: F401
from megatron_cp.training.trainer import Trainer  # noqa: F401
