"""One microbatch -> this rank's tensors: the one padding rule, then the CP partition.

A microbatch from :func:`~megatron_cp.data.batch.get_ltor_batch` is a dict of ``[b, s]``
tensors (tokens, labels, loss_mask, position_ids, optional document_ids). Before the model
sees it, two things may lengthen it, and both follow the padding rule of :func:`pad_sample`:

- context parallelism splits every packed document into 2 x CP zigzag chunks, so each
  document is padded to a multiple of 2 x CP (each CP rank then holds len/CP tokens of it);
- pipeline stages exchange buffers of one shape per step, so every sample is extended to
  the step's length (``target_length``).

The padding rule: pad tokens EXTEND the document they follow (the last one, when the
sample is extended). They get token and label 0, loss mask 0, their document's id, and
repeat its last position id (so a learned position table is never indexed past the real
positions). They come after every real token of their document and documents do not
see each other, so no real token attends to a pad token: outputs, loss and gradients are
those of the unpadded microbatch. No zero-length document is ever added.

:func:`prepare_microbatch` then keeps this CP rank's zigzag share of every document and
adds ``token_index`` (each kept token's index in the padded sample: what attention uses
for causality) and ``unpadded_index`` (its index in the sample before padding: what the
attention-dropout mask follows, so every CP size drops the same elements); both None at
CP=1, where the order of the tokens is their causal order and no document is padded.
"""
import torch

from megatron_cp.context_parallel.partition import zigzag_indices

PIPELINE_LENGTH_FLAG = "--pipeline-seq-length"


def split_multiple(cp_size):
    """Length granularity of the zigzag split: 2 x CP chunks (nothing to split at CP=1)."""
    return 1 if cp_size == 1 else 2 * cp_size


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def document_lengths(document_ids):
    """Lengths of the maximal runs of equal id in a 1-D tensor, in order."""
    ids = document_ids.cpu()
    change = torch.ones(ids.numel(), dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    starts = torch.nonzero(change).flatten().tolist() + [ids.numel()]
    return [starts[n + 1] - starts[n] for n in range(len(starts) - 1)]


def _padded_documents(batch, cp_size):
    """Per sample: (document lengths, lengths padded to a multiple of 2 x CP)."""
    b, s = batch["tokens"].shape
    multiple = split_multiple(cp_size)
    document_ids = batch.get("document_ids")
    out = []
    for n in range(b):
        lengths = [s] if document_ids is None else document_lengths(document_ids[n])
        out.append((lengths, [_round_up(length, multiple) for length in lengths]))
    return out


def required_length(batch, cp_size):
    """Tokens per sample this microbatch needs once its documents are padded for CP."""
    return max(sum(padded) for _, padded in _padded_documents(batch, cp_size))


def step_length(needed, seq_length, granularity, bucketed):
    """The sequence length of a step whose longest padded sample has ``needed`` tokens.

    Rounded up to ``granularity`` (2 x CP, times TP under sequence parallelism), and, when
    ``bucketed`` (pipeline buffers, which should rarely change shape), to steps of about
    seq_length / 8.
    """
    if not bucketed:
        return _round_up(needed, granularity)
    step = granularity * max(1, _round_up(seq_length, 8 * granularity) // (8 * granularity))
    return max(_round_up(needed, step), _round_up(seq_length, granularity))


def pad_sample(sample, lengths, padded_lengths):
    """One sample's 1-D tensors rebuilt document by document, each padded to its padded
    length by the module's padding rule. Adds ``document_ids`` (the run index)."""
    out = {key: [] for key in sample}
    out["document_ids"] = []
    device = sample["tokens"].device
    start = 0
    for doc, (length, padded) in enumerate(zip(lengths, padded_lengths)):
        extra = padded - length
        for key, value in sample.items():
            piece = value[start:start + length]
            if key == "position_ids":
                tail = piece[-1:].expand(extra)  # repeat the last real position
            else:
                tail = torch.zeros(extra, dtype=piece.dtype, device=device)
            out[key].append(torch.cat([piece, tail]))
        out["document_ids"].append(torch.full((padded,), doc, dtype=torch.int64, device=device))
        start += length
    return {key: torch.cat(parts) for key, parts in out.items()}


def too_long_message(needed, target_length, cp_size):
    """The error for a microbatch that does not fit a fixed pipeline buffer."""
    why = (f" (each packed document padded to a multiple of 2 x CP = {2 * cp_size})"
           if cp_size > 1 else "")
    return (f"a microbatch needs {needed} tokens per sample{why}, more than "
            f"{PIPELINE_LENGTH_FLAG} ({target_length}); raise {PIPELINE_LENGTH_FLAG} to at least "
            f"{needed}, or leave it unset so the pipeline buffers follow each step's data")


def prepare_microbatch(batch, cp_rank, cp_size, target_length=None):
    """This CP rank's tensors of one microbatch: padded (see the module doc), then zigzagged.

    batch: tokens, labels, loss_mask, position_ids [b, s]; document_ids [b, s] or None;
    any other [b, s] tensor is padded (with 0) and split alongside. ``target_length``: the
    padded sample length (a multiple of 2 x CP; default: the longest padded sample).
    Returns the same keys as [b, length / cp], ``document_ids`` renumbered by run (or
    None), ``token_index`` and ``unpadded_index`` [b, length / cp] int64 (None at CP=1; pad
    tokens get unpadded index 0, which no real token ever sees), and ``real_token``
    [b, length / cp] bool, False on pad tokens (None when nothing is padded: what FP8's
    input amaxes skip, megatron_cp/fp8/rows.py).
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank ({cp_rank}) must lie in [0, cp_size ({cp_size}))")
    missing = [key for key in ("tokens", "labels", "loss_mask", "position_ids") if key not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}")
    shape = tuple(batch["tokens"].shape)
    keys = [key for key, value in batch.items()
            if key != "document_ids" and torch.is_tensor(value) and tuple(value.shape) == shape]
    has_documents = batch.get("document_ids") is not None
    multiple = split_multiple(cp_size)
    per_sample = _padded_documents(batch, cp_size)
    needed = max(sum(padded) for _, padded in per_sample)
    total = needed if target_length is None else int(target_length)
    if total % multiple != 0:
        raise ValueError(f"the padded sample length ({total}) must be a multiple of 2 x CP "
                         f"({multiple}) for the zigzag split")
    if needed > total:
        raise ValueError(too_long_message(needed, total, cp_size))
    if cp_size == 1 and total == shape[1]:
        return {**batch, "document_ids": batch.get("document_ids"), "token_index": None,
                "unpadded_index": None, "real_token": None}

    # padded and split like the other per-token tensors; real_token: False on pad tokens
    device = batch["tokens"].device
    extra = {"real_token": torch.ones(shape[1], dtype=torch.bool, device=device)}
    if cp_size > 1:
        extra["unpadded_index"] = torch.arange(shape[1], device=device)
    samples, token_index = [], []
    for n, (lengths, padded) in enumerate(per_sample):
        padded = padded[:-1] + [padded[-1] + total - sum(padded)]  # extend the last document
        sample = pad_sample({**{k: batch[k][n] for k in keys}, **extra}, lengths, padded)
        starts = torch.tensor([0] + padded[:-1], dtype=torch.int64).cumsum(0).tolist()
        index = torch.cat([zigzag_indices(cp_rank, cp_size, length) + start
                           for start, length in zip(starts, padded)])  # [total / cp]
        index = index.to(sample["tokens"].device)
        samples.append({k: v.index_select(0, index) for k, v in sample.items()})
        token_index.append(index)
    out = {key: torch.stack([s[key] for s in samples])  # [b, total / cp]
           for key in [*keys, *extra]}
    out["document_ids"] = torch.stack([s["document_ids"] for s in samples]) if has_documents else None
    out["token_index"] = torch.stack(token_index) if cp_size > 1 else None
    out.setdefault("unpadded_index", None)
    return out
