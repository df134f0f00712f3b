"""Which rows of a linear's input are real tokens, for the input amax.

Context parallelism on packed documents pads each document to a multiple of 2 x CP (and a
pipeline step extends its samples to one length: megatron_cp/data/microbatch.py). Pad tokens
are computed like any other, and no real token sees them, but their activations would enter
an input amax that one process, which pads nothing, never sees. The model's forward names
the microbatch's real tokens here (:func:`real_rows`, ``[s_local * b]`` in the linears'
row order, None without padding) and every FP8 input amax of its layers skips the others.

Recomputation reruns parts of a forward later (in backward, after other microbatches'
forwards under a pipeline schedule): tensor_parallel.checkpoint and DiscardedOutput take the
rows of the forward they rerun (:func:`current` when they are made, :func:`real_rows` around
the rerun).
"""
import contextlib

_CURRENT = [None]  # the rows of the forward running now (a microbatch runs one at a time)


def current():
    """The real-token rows of the forward running now: bool ``[s_local * b]``, or None."""
    return _CURRENT[0]


@contextlib.contextmanager
def real_rows(rows):
    """Within the block, :func:`current` is ``rows``."""
    saved = _CURRENT[0]
    _CURRENT[0] = rows
    try:
        yield
    finally:
        _CURRENT[0] = saved


def rows_of(real_token):
    """The linears' row mask of a microbatch's ``real_token`` ``[b, s_local]`` (None: no
    padding): ``[s_local * b]``, s-major like the ``[s, b, h]`` activations flattened."""
    return None if real_token is None else real_token.t().reshape(-1)
