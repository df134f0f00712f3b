"""Sequence partition for context parallelism: zigzag split, its inverse, batch partition.

Zigzag: cut the sequence into 2*CP equal chunks; CP rank r keeps chunks r and 2*CP-1-r
(an early and a late one), which balances causal attention work over the ranks.

``partition_batch`` turns a microbatch dict (tokens, labels, loss_mask, position_ids
[b, s], optional document_ids) into this rank's shard plus ``token_index`` (each local
token's index in the full padded sample, what attention uses for causality). With
document_ids every document (a maximal run of equal id in the GLOBAL sample) is padded to
a multiple of 2*CP (no padding at CP=1) and zigzagged on its own, so each rank holds len_doc / CP tokens of
every document; samples are padded to a common length by extending their last document.
"""
import torch
import torch.distributed as dist

_STANDARD_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _multiple(cp_size):
    """Length granularity of the split: 2*CP chunks (nothing to split at CP=1)."""
    return 1 if cp_size == 1 else 2 * cp_size


def _check_splittable(length, cp_size, what="sequence length"):
    if length % _multiple(cp_size) != 0:
        raise ValueError(
            f"{what} ({length}) must be divisible by 2 x context_parallel_size "
            f"(2 x {cp_size} = {2 * cp_size}) for the zigzag split; pad the sequence to a "
            f"multiple of {2 * cp_size} (e.g. --seq-length {-(-length // (2 * cp_size)) * 2 * cp_size})"
            f" or pass target_length")


def zigzag_indices(cp_rank, cp_size, seq_len, device=None):
    """Global positions held by ``cp_rank``: chunks r and 2*CP-1-r of 2*CP. int64 [seq_len/CP]."""
    _check_splittable(seq_len, cp_size)
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp_size)
    early = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    late_start = (2 * cp_size - 1 - cp_rank) * chunk
    late = torch.arange(late_start, late_start + chunk, device=device)
    return torch.cat([early, late])


def zigzag_split(x, cp_rank, cp_size, dim):
    """This rank's zigzag shard of ``x`` along ``dim``: chunks r and 2*CP-1-r concatenated."""
    _check_splittable(x.shape[dim], cp_size, f"size of dim {dim}")
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def zigzag_gather(shards, dim):
    """Inverse of :func:`zigzag_split`: the per-rank shards (rank order) -> the full tensor."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    chunks = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        early, late = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp_size - 1 - rank] = early, late
    return torch.cat(chunks, dim=dim)


def zigzag_all_gather(x, cp_group, dim):
    """Collective, no autograd: every rank gets the full tensor from the zigzag shards."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(shards, x.contiguous(), group=cp_group)
    return zigzag_gather(shards, dim)


def _document_runs(ids):
    """Lengths of the maximal runs of equal value in a 1-D tensor (in order)."""
    change = torch.ones(ids.numel(), dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    starts = torch.nonzero(change).flatten().tolist() + [ids.numel()]
    return [starts[n + 1] - starts[n] for n in range(len(starts) - 1)]


def _pad_sample(sample, lengths, padded_lengths, keys):
    """One sample's tensors rebuilt document by document, each padded to its padded length.

    Pad tokens: token/label 0, loss_mask 0, same document (run index), position ids
    continuing from the document's last one. Returns {key: 1-D tensor}.
    """
    out = {key: [] for key in keys}
    out["document_ids"] = []
    start = 0
    for doc, (length, padded) in enumerate(zip(lengths, padded_lengths)):
        extra = padded - length
        for key in keys:
            piece = sample[key][start:start + length]
            if key == "position_ids":
                last = piece[-1] if length else torch.zeros((), dtype=piece.dtype, device=piece.device)
                tail = last + torch.arange(1, extra + 1, dtype=piece.dtype, device=piece.device)
            else:
                tail = torch.zeros(extra, dtype=piece.dtype, device=piece.device)
            out[key].append(torch.cat([piece, tail]))
        out["document_ids"].append(torch.full((padded,), doc, dtype=torch.int64,
                                              device=sample["tokens"].device))
        start += length
    return {key: torch.cat(parts) for key, parts in out.items()}


def _partition_plain(batch, keys, cp_rank, cp_size, target_length):
    seq_len = batch["tokens"].shape[1]
    if target_length is not None and target_length != seq_len:
        if target_length < seq_len:
            raise ValueError(f"sample length ({seq_len}) is longer than target_length "
                             f"({target_length}); raise target_length (the pipeline buffer) "
                             f"or shorten the sequence")
        padded = [_pad_sample({k: batch[k][n] for k in keys}, [seq_len], [target_length], keys)
                  for n in range(batch["tokens"].shape[0])]
        batch = {k: torch.stack([p[k] for p in padded]) for k in keys}
        seq_len = target_length
    _check_splittable(seq_len, cp_size)
    index = zigzag_indices(cp_rank, cp_size, seq_len, batch["tokens"].device)  # [s/cp]
    result = {key: batch[key].index_select(1, index) for key in keys}  # [b, s/cp] each
    result["token_index"] = index.expand(batch["tokens"].shape[0], -1).contiguous()
    result["document_ids"] = None
    result["cu_seqlens"] = None
    return result


def partition_batch(batch, cp_rank, cp_size, target_length=None):
    """This CP rank's shard of a microbatch dict; see the module docstring.

    batch: tokens, labels, loss_mask, position_ids [b, s]; document_ids [b, s] or None/absent;
    any other [b, s] tensor is partitioned alongside (padded with 0). Returns the same keys
    [b, s_padded / cp] plus ``token_index`` [b, s_padded / cp] int64 (index in the padded
    sample), ``document_ids`` (renumbered 0..n-1 per sample by run, or None) and
    ``cu_seqlens`` (list of one int64 [num_docs + 1] per sample: cumulative padded document
    lengths before the split; None without documents). ``target_length`` pads every sample to
    that total (ValueError if a padded sample is longer or it is not a multiple of 2*CP).
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank ({cp_rank}) must lie in [0, cp_size ({cp_size}))")
    missing = [key for key in _STANDARD_KEYS if key not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; it needs {list(_STANDARD_KEYS)}")
    shape = tuple(batch["tokens"].shape)
    keys = [key for key, value in batch.items()
            if key != "document_ids" and torch.is_tensor(value) and tuple(value.shape) == shape]
    document_ids = batch.get("document_ids")
    if document_ids is None:
        return _partition_plain(batch, keys, cp_rank, cp_size, target_length)

    multiple = _multiple(cp_size)
    if target_length is not None:
        _check_splittable(target_length, cp_size, "target_length")
    per_sample = []
    for n in range(shape[0]):
        lengths = _document_runs(document_ids[n].cpu())
        per_sample.append((lengths, [-(-length // multiple) * multiple for length in lengths]))
    longest = max(sum(padded) for _, padded in per_sample)
    total = longest if target_length is None else target_length
    if longest > total:
        raise ValueError(
            f"a sample padded per document to a multiple of {multiple} (2 x cp) has {longest} "
            f"tokens, more than target_length ({target_length}); raise target_length to at "
            f"least {longest} or pack fewer documents per sample")

    samples, token_index, cu_seqlens = [], [], []
    for n, (lengths, padded) in enumerate(per_sample):
        padded = padded[:-1] + [padded[-1] + total - sum(padded)]  # extend the last document
        sample = _pad_sample({k: batch[k][n].cpu() for k in keys}, lengths, padded, keys)
        bounds = torch.tensor([0] + padded, dtype=torch.int64).cumsum(0)  # [num_docs + 1]
        local = []
        for doc in range(len(padded)):
            start = int(bounds[doc])
            local.append(zigzag_indices(cp_rank, cp_size, padded[doc]) + start)  # per document
        index = torch.cat(local)  # [total / cp]
        samples.append({k: v.index_select(0, index) for k, v in sample.items()})
        token_index.append(index)
        cu_seqlens.append(bounds)
    device = batch["tokens"].device
    result = {key: torch.stack([s[key] for s in samples]).to(device) for key in keys}
    result["document_ids"] = torch.stack([s["document_ids"] for s in samples]).to(device)
    result["token_index"] = torch.stack(token_index).to(device)  # [b, total / cp]
    result["cu_seqlens"] = [bounds.to(device) for bounds in cu_seqlens]
    return result
