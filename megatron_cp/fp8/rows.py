"""Which rows of a linear's input are real tokens, for the input amax.

Context parallelism on packed documents pads each document to a multiple of 2 x CP (and a
pipeline step extends its samples to one length: megatron_cp/data/microbatch.py). Pad tokens
are computed like any other, and no real token sees them, but their activations would enter
an input amax that one process, which pads nothing, never sees. The model's forward names
the microbatch's real tokens here (:func:`real_rows`, ``[s_local * b]`` in the linears'
row order, None without padding) and every FP8 input amax of its layers skips the others.

Block recipes (megatron_cp/fp8/blocks.py) quantize x and dy a second time in blocks along the
tokens, for the wgrad GEMM: a block is the tokens one process groups, so each local row needs
its row in one process's ``[s * b]`` (:func:`one_process_rows`: from the microbatch's
``unpadded_index``, the token's position in the unpadded sample under CP; -1 on pad tokens).

Recomputation reruns parts of a forward later (in backward, after other microbatches'
forwards under a pipeline schedule): tensor_parallel.checkpoint and DiscardedOutput take the
rows of the forward they rerun (:func:`current` when they are made, :func:`real_rows` around
the rerun).
"""
import contextlib

import torch

_CURRENT = [None]  # the rows of the forward running now (a microbatch runs one at a time)


class Rows:
    """A microbatch's row marks in the linears' order ``[s_local * b]``: ``real`` bool (None:
    every row is a token of the sample) and ``one_process`` int64 (None: the same rows as one
    process), the row one process holds the token in, -1 on pad tokens."""

    def __init__(self, real, one_process):
        self.real, self.one_process = real, one_process


def current():
    """The :class:`Rows` of the forward running now, or None."""
    return _CURRENT[0]


def real_mask():
    """The real-token rows of the forward running now: bool ``[s_local * b]``, or None."""
    return None if _CURRENT[0] is None else _CURRENT[0].real


def one_process_rows(num_rows):
    """Each of the forward's ``num_rows`` rows' row in one process (int64, -1 on pad
    tokens), or None where they are one process's rows already."""
    marks = _CURRENT[0]
    if marks is None:
        return None
    if marks.one_process is not None:
        index = marks.one_process
    else:  # CP 1: pad tokens only at the end of a sample, the real ones where one process has them
        index = torch.where(marks.real, torch.arange(num_rows, device=marks.real.device), -1)
    if index.numel() != num_rows:
        raise AssertionError(f"{num_rows} rows, {index.numel()} row marks")
    return index


@contextlib.contextmanager
def real_rows(rows):
    """Within the block, :func:`current` is ``rows``."""
    saved = _CURRENT[0]
    _CURRENT[0] = rows
    try:
        yield
    finally:
        _CURRENT[0] = saved


def rows_of(real_token, unpadded_index=None):
    """The :class:`Rows` of a microbatch (None: no padding, no CP): ``real_token`` ``[b,
    s_local]`` (None: no padding) and ``unpadded_index`` ``[b, s_local]`` (each token's
    position in its unpadded sample; None at CP 1) as rows ``[s_local * b]``, s-major like
    the ``[s, b, h]`` activations flattened."""
    if real_token is None and unpadded_index is None:
        return None
    real = None if real_token is None else real_token.t().reshape(-1)
    one_process = None
    if unpadded_index is not None:
        b = unpadded_index.shape[0]
        one_process = unpadded_index.t() * b + torch.arange(b, device=unpadded_index.device)
        one_process = one_process.reshape(-1)  # [s_local * b]
        if real is not None:
            one_process = torch.where(real, one_process, -1)
    return Rows(real, one_process)
