"""Dynamic CP's microbatches: a global batch cut into its documents and re-packed into the
bins of its schedule (megatron_cp/context_parallel/dynamic_schedule.py), this rank's share
of each.

Every rank holds the whole global batch (its TP rank 0 reads all of it: the schedule needs
every document's length and a bin may take documents from any sample), cuts each sample
into its documents (the runs of equal ``document_ids``; the whole sample when the data has
no document masking), computes the same schedule as every other rank and keeps, for each
bin it runs, its zigzag share on the bin's CP group: the bin is one packed sample, its
documents padded and split by :func:`~megatron_cp.data.microbatch.prepare_microbatch`'s
rule. A token keeps its label, loss mask and position id, and documents never attend to
each other, so with per-token loss (the sum over the global batch's tokens, divided by
their count) the step computes what one process computes on the same global batch.
"""
import torch

from megatron_cp.config.dynamic_cp import padded
from megatron_cp.context_parallel.dynamic_schedule import rounds, schedule
from megatron_cp.data.microbatch import document_lengths, prepare_microbatch

TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def documents_of(batches):
    """``[(microbatch, row, start, length)]`` of every document of the global batch's
    microbatches (dicts of [b, s] tensors from get_ltor_batch), in order."""
    documents = []
    for m, batch in enumerate(batches):
        b, s = batch["tokens"].shape
        ids = batch.get("document_ids")
        for row in range(b):
            start = 0
            for length in ([s] if ids is None else document_lengths(ids[row])):
                documents.append((m, row, start, length))
                start += length
    return documents


def bin_sample(batches, documents, bin_documents):
    """One packed sample [1, sum of lengths] of the documents numbered ``bin_documents``:
    their tokens, labels, loss masks and position ids in order, ``document_ids`` their place
    in the bin (None for a bin of one document))."""
    parts = {key: [] for key in TOKEN_KEYS}
    ids = []
    for place, d in enumerate(bin_documents):
        m, row, start, length = documents[d]
        for key in TOKEN_KEYS:
            parts[key].append(batches[m][key][row, start:start + length])
        ids.append(torch.full((length,), place, dtype=torch.int64,
                              device=batches[m]["tokens"].device))
    sample = {key: torch.cat(values).unsqueeze(0) for key, values in parts.items()}  # [1, n]
    # one document: plain causal attention (no document masking to look up)
    sample["document_ids"] = torch.cat(ids).unsqueeze(0) if len(ids) > 1 else None  # [1, n]
    return sample


def empty_microbatch(tokens, device):
    """A round's stand-in where this rank has no bin (rule 6): ``tokens`` tokens of id 0 with
    no loss (loss mask 0, so no gradient and no count), on no CP group."""
    zeros = torch.zeros((1, tokens), dtype=torch.int64, device=device)  # [1, n]
    return {"tokens": zeros, "labels": zeros, "position_ids": zeros,
            "loss_mask": torch.zeros((1, tokens), dtype=torch.float32, device=device),
            "document_ids": None, "token_index": None, "unpadded_index": None,
            "real_token": None, "cp_size": 1, "sample_ids": torch.zeros(1, dtype=torch.int64,
                                                                        device=device)}


def dynamic_microbatches(batches, slot, pool, max_per_rank, cost, tp_multiple=1, least=1,
                         first_sample=0, static_size=1, lockstep=False):
    """(this rank's microbatches, the schedule) for pool rank ``slot`` (its rank in the DP x
    CP group) of ``pool`` (``static_size``: the static CP size, whose layout the schedule
    takes when it models faster): one per bin it runs (``lockstep``, for expert parallelism:
    one per round of :func:`~megatron_cp.context_parallel.dynamic_schedule.rounds`, an
    :func:`empty_microbatch` where it runs no bin), in run order, each prepared for the bin's CP
    group (its rank there is ``slot - bin.first``) and carrying ``cp_size``, the group's size
    (the model's attention switches to it: model.attention.use_cp_size).

    Dropout's coordinates: a bin is numbered as the sample of its first document
    (``first_sample``, the samples consumed before this global batch, plus that sample's
    index in it) and its tokens by their place in the bin, the same on every rank of its
    group; so dropout is reproducible and layout-free among dynamic runs, but these are not
    the coordinates a static run gives the same tokens."""
    documents = documents_of(batches)
    rows = batches[0]["tokens"].shape[0]  # samples per microbatch
    samples = [[] for _ in range(len(batches) * rows)]  # each sample's documents, in order
    for d, (m, row, _, _) in enumerate(documents):
        samples[m * rows + row].append(d)
    plan = schedule([length for *_, length in documents], pool, max_per_rank, cost, tp_multiple,
                    least, samples, static_size)
    out = []
    device = batches[0]["tokens"].device
    for run in rounds(plan)[slot] if lockstep else plan.bins_of(slot):
        if run is None:
            out.append(empty_microbatch(tp_multiple, device))
            continue
        total = sum(padded(n, run.size, tp_multiple) for n in run.lengths)
        microbatch = prepare_microbatch(bin_sample(batches, documents, run.documents),
                                        slot - run.first, run.size, total)
        m, row = documents[run.documents[0]][:2]
        microbatch["cp_size"] = run.size
        microbatch["sample_ids"] = torch.tensor([first_sample + m * rows + row], device=device)
        out.append(microbatch)
    return out, plan
