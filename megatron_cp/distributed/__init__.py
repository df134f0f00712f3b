"""The data-parallel side and the rank grid: ``initialize.py`` turns the world into a
ParallelState (TP innermost, then CP, PP, DP; the expert mesh over the same ranks), ``device.py``
is the one place that talks to CUDA, ``compat.py`` papers over torch.distributed versions,
``data_parallel.py`` and ``buckets.py`` reduce gradients over DP x CP in flat buckets (DDP, and
the distributed optimizer's reduce-scatter), ``fsdp.py`` wraps a model in FSDP2, and
``shards.py`` says which elements of a parameter this rank holds."""
