"""Batches: the left-to-right batch builder and the data-parallel batch iterator.

:func:`get_ltor_batch` turns ``text [b, s+1]`` into tokens, labels, loss mask, position
ids and (for packed documents: EOD-separated, or the dataset's own) document ids.
:func:`build_data_iterator` hands every DP rank its microbatches so that global batch ``k``
is always the samples ``[consumed + k*G, consumed + (k+1)*G)`` of the dataset, whatever the
DP layout: DP rank ``d`` takes the contiguous share ``[d*G/DP, (d+1)*G/DP)`` of it, in
microbatches (under a batch-size schedule each batch starts where the previous one ended and
takes the size the schedule gives at that sample). :func:`close_data_iterator` ends its
loader processes.
"""
import multiprocessing
import signal

import numpy as np
import torch


def get_ltor_batch(text, eod_token, reset_position_ids=False, reset_attention_mask=False,
                   eod_mask_loss=False, document_ids=None):
    """Left-to-right LM batch from ``text`` ``[b, s+1]`` (int64).

    Returns ``tokens [b, s]``, ``labels [b, s]`` (tokens shifted by one), ``loss_mask
    [b, s]`` float32 (0 where the input token is EOD when ``eod_mask_loss``),
    ``position_ids [b, s]`` (restarting at 0 on the token after each EOD when
    ``reset_position_ids``; the EOD belongs to the document it ends) and
    ``document_ids [b, s]`` (0 for the first document, +1 after each EOD) when
    ``reset_attention_mask``, else None: attention stays inside one document id.

    ``document_ids`` ``[b, s]`` given (the dataset's documents,
    ``--dataloader-inter-document-masking``): they are the documents, and position ids
    restart at 0 where each begins, whatever the EOD tokens; ``reset_position_ids`` and
    ``reset_attention_mask`` then change nothing, as in Megatron-LM, whose cu_seqlens
    replace both (``eod_mask_loss`` still applies).
    """
    if text.dim() != 2 or text.size(1) < 2:
        raise ValueError(f"text must be [batch, seq_length + 1] with seq_length >= 1, "
                         f"got shape {tuple(text.shape)}")
    text = text.long()
    tokens = text[:, :-1].contiguous()  # [b, s]
    labels = text[:, 1:].contiguous()  # [b, s]
    b, s = tokens.shape
    is_eod = tokens == eod_token  # [b, s]
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=text.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    if document_ids is not None:
        if tuple(document_ids.shape) != (b, s):
            raise ValueError(f"document_ids must be [batch, seq_length] = {[b, s]}, got shape "
                             f"{tuple(document_ids.shape)}")
        document_ids = document_ids.to(device=text.device, dtype=torch.long)
        starts_here = torch.ones_like(is_eod)
        starts_here[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": _positions_in_documents(starts_here),
                "document_ids": document_ids}
    if reset_position_ids:
        # A document starts at 0 and right after every EOD
        starts_here = torch.zeros_like(is_eod)
        starts_here[:, 1:] = is_eod[:, :-1]
        position_ids = _positions_in_documents(starts_here)
    else:
        position_ids = torch.arange(s, dtype=torch.long, device=text.device).expand(b, s).clone()
    if reset_attention_mask:
        eod_long = is_eod.long()
        document_ids = torch.cumsum(eod_long, dim=1) - eod_long  # EODs strictly before
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids, "document_ids": document_ids}


def _positions_in_documents(starts_here):
    """Position ids [b, s] that restart at 0 where ``starts_here`` [b, s] (bool) is True
    (and at index 0): each token's index minus its document's first index."""
    b, s = starts_here.shape
    index = torch.arange(s, dtype=torch.long, device=starts_here.device).expand(b, s)
    start = torch.where(starts_here, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start  # [b, s]


MTP_KEYS = ("mtp_tokens", "mtp_labels", "mtp_loss_mask")  # + f"_{depth}", depth 1..D


def shift_left_within_documents(x, document_ids=None):
    """``x`` [b, s] moved one position left inside each document (a run of equal
    ``document_ids``; None: the whole row): ``out[i] = x[i+1]``, and 0 at each document's
    last position, whose successor belongs to the next document or lies past the sample
    (Megatron-LM's roll_tensor on packed sequences)."""
    out = torch.zeros_like(x)
    out[:, :-1] = x[:, 1:]
    if document_ids is not None:
        out[:, :-1] *= (document_ids[:, 1:] == document_ids[:, :-1]).to(x.dtype)
    return out


def add_mtp_targets(batch, num_depths):
    """Adds, for each multi-token-prediction depth k = 1..``num_depths``, the tokens, labels
    and loss mask moved k positions left inside each document (``mtp_tokens_k``,
    ``mtp_labels_k``, ``mtp_loss_mask_k`` [b, s]): depth k embeds the token k ahead and
    predicts the label k ahead, and positions whose shift would leave the document carry token
    0, label 0 and loss mask 0. Made before padding and the CP split, in the sample's own
    order, so every layout sees the same targets. Returns ``batch``."""
    current = [batch["tokens"], batch["labels"], batch["loss_mask"]]
    for depth in range(1, num_depths + 1):
        current = [shift_left_within_documents(x, batch.get("document_ids")) for x in current]
        for key, value in zip(MTP_KEYS, current):
            batch[f"{key}_{depth}"] = value
    return batch


def mtp_targets(batch):
    """The (tokens, labels, loss mask, weight) of every MTP depth a (prepared) microbatch
    holds, as the model takes them; None when it holds none. The weight of a depth's masked
    loss sum is the training loop's (``batch["mtp_loss_weights"]``, Megatron-LM's weighting:
    megatron_cp.pipeline_parallel.loss_weighting), None without it."""
    targets = []
    weights = batch.get("mtp_loss_weights")
    while f"{MTP_KEYS[0]}_{len(targets) + 1}" in batch:
        depth = len(targets)
        targets.append(tuple(batch[f"{key}_{depth + 1}"] for key in MTP_KEYS)
                       + (None if weights is None else weights[depth],))
    return targets or None


class DataParallelBatchSampler:
    """Yields, for one DP rank, the sample indices of each of its microbatches.

    Global batches follow each other from ``consumed_samples``: one that starts at sample
    ``c`` covers ``[c, c + G(c))``, where ``G`` is ``global_batch_size``, a number or a
    function of the samples consumed before the batch (a batch-size schedule). Rank ``d``
    gets ``G/DP`` contiguous samples of it, ``micro_batch_size`` at a time. A trailing
    partial global batch is dropped.
    """

    def __init__(self, total_samples, consumed_samples, global_batch_size, micro_batch_size,
                 dp_rank, dp_size):
        size_at = global_batch_size if callable(global_batch_size) else (
            lambda consumed, size=int(global_batch_size): size)
        first = size_at(consumed_samples)
        if first % (micro_batch_size * dp_size) != 0:
            raise ValueError(
                f"global_batch_size ({first}) must be divisible by "
                f"micro_batch_size ({micro_batch_size}) x data_parallel_size ({dp_size}); "
                f"use a multiple of {micro_batch_size * dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size={dp_size})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples ({consumed_samples}) must be >= 0")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.size_at = size_at
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)

    def _global_batches(self):
        """``(first sample, size)`` of every whole global batch left."""
        start = self.consumed_samples
        while True:
            size = self.size_at(start)
            if start + size > self.total_samples:
                return
            yield start, size
            start += size

    @property
    def num_global_batches(self):
        """Whole global batches left after ``consumed_samples``."""
        return sum(1 for _ in self._global_batches())

    def __len__(self):
        return sum(size for _, size in self._global_batches()) // (
            self.micro_batch_size * self.dp_size)

    def __iter__(self):
        for start, size in self._global_batches():
            share = size // self.dp_size
            first = start + self.dp_rank * share
            for m in range(0, share, self.micro_batch_size):
                yield list(range(first + m, first + m + self.micro_batch_size))


def _collate(samples):
    """``text`` [b, s+1]; for samples that carry their ``document_ids``
    (--dataloader-inter-document-masking) the dict ``{"text", "document_ids" [b, s]}``."""
    def stacked(key):
        return torch.from_numpy(np.stack([np.asarray(s[key], dtype=np.int64) for s in samples]))
    if "document_ids" not in samples[0]:
        return stacked("text")
    return {"text": stacked("text"), "document_ids": stacked("document_ids")}


def text_and_documents(item):
    """(``text`` [b, s+1], ``document_ids`` [b, s] or None) of one item of a
    :func:`build_data_iterator` iterator (None: (None, None))."""
    if isinstance(item, dict):
        return item["text"], item["document_ids"]
    return item, None


def build_data_iterator(dataset, global_batch_size, micro_batch_size, dp_rank, dp_size,
                        consumed_samples=0, num_workers=0, keep_on_sigterm=False):
    """Iterator over this DP rank's microbatches: ``text`` tensors ``[micro_batch_size, s+1]``
    (with the dataset's document ids: dicts, read them with :func:`text_and_documents`);
    ``global_batch_size``: a number, or a function of the consumed samples (a schedule).

    Resumes exactly: the same ``consumed_samples`` gives the same following batches.
    Returns None for a None dataset. Uses a torch DataLoader with
    :class:`DataParallelBatchSampler` (``num_workers`` loader processes; none in a daemonic
    process, which may not start any). ``keep_on_sigterm`` (``--exit-signal-handler``): the
    loader processes ignore SIGTERM, as Megatron-LM's do under that flag. SLURM signals every
    process of a job step; a loader process that died of it would fail the next batch before
    the training loop could save and exit.
    """
    if dataset is None:
        return None
    if multiprocessing.current_process().daemon:
        # Python lets no daemonic process (a test harness's worker) start children; loader
        # processes only move the reads, so the batches are the same without them
        num_workers = 0
    sampler = DataParallelBatchSampler(len(dataset), consumed_samples, global_batch_size,
                                       micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=_collate,
                                         persistent_workers=False, pin_memory=False,
                                         worker_init_fn=_ignore_sigterm if keep_on_sigterm
                                         else None,
                                         # its own generator: creating the iterator must not
                                         # draw from the global RNG (exact resume needs that)
                                         generator=torch.Generator().manual_seed(0))
    return iter(loader)


def _ignore_sigterm(worker_id):
    # the main process saves and ends the run; its workers end with it (torch's parent check)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def close_data_iterator(iterator):
    """End the loader processes of an iterator from :func:`build_data_iterator` now (None
    and a worker-less iterator have none): what its finaliser would do, but at a known point.
    A process that ends with ``os._exit`` (a forked rank, a rank that lost a peer) runs no
    finaliser, and its workers would outlive it until their own parent check notices (up to
    five seconds), holding its output pipe."""
    shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's own (idempotent) way
    if shutdown is not None:
        shutdown()
