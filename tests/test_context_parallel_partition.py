"""Zigzag split / inverse and partition_batch (plain and packed documents); no processes."""
import pytest
import torch

from megatron_cp.context_parallel import (partition_batch, zigzag_gather, zigzag_indices,
                                          zigzag_split)

DOC_LENGTHS = ([5, 19, 3, 9], [12, 7, 17])  # two samples of 36 tokens; 5 and 3 < one chunk


def make_batch(seq_len=36, doc_lengths=None, batch_size=2, seed=0):
    """A microbatch dict; with doc_lengths, position ids restart at every document."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 100, (batch_size, seq_len), generator=gen)
    batch = {"tokens": tokens, "labels": torch.randint(1, 100, (batch_size, seq_len), generator=gen),
             "loss_mask": torch.ones(batch_size, seq_len),
             "position_ids": torch.arange(seq_len).repeat(batch_size, 1)}
    if doc_lengths is not None:
        docs, positions = [], []
        for lengths in doc_lengths:
            assert sum(lengths) == seq_len
            docs.append(torch.cat([torch.full((n,), 10 + i) for i, n in enumerate(lengths)]))
            positions.append(torch.cat([torch.arange(n) for n in lengths]))
        batch["document_ids"] = torch.stack(docs)
        batch["position_ids"] = torch.stack(positions)
    return batch


def test_zigzag_round_trip_and_indices():
    x = torch.arange(2 * 3 * 24).view(2, 3, 24)
    for cp_size in (1, 2, 3, 4):
        shards = [zigzag_split(x, r, cp_size, dim=2) for r in range(cp_size)]
        assert torch.equal(zigzag_gather(shards, dim=2), x)
        for r, shard in enumerate(shards):
            assert torch.equal(shard, x.index_select(2, zigzag_indices(r, cp_size, 24)))
    assert zigzag_indices(1, 4, 16).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match=r"\(10\).*2 x 4 = 8"):
        zigzag_split(torch.zeros(2, 10), 0, 4, dim=1)


def test_partition_plain_batch():
    batch = make_batch(seq_len=32)
    parts = [partition_batch(batch, r, 4) for r in range(4)]
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(zigzag_gather([p[key] for p in parts], dim=1), batch[key])
    assert parts[1]["token_index"][0].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    assert parts[0]["document_ids"] is None and parts[0]["cu_seqlens"] is None
    with pytest.raises(ValueError, match=r"sequence length \(36\).*2 x 8 = 16"):
        partition_batch(make_batch(seq_len=36), 0, 8)
    single = partition_batch(make_batch(seq_len=35), 0, 1)  # CP=1: nothing to split or pad
    assert single["tokens"].shape == (2, 35) and single["token_index"][0].tolist() == list(range(35))
    padded = partition_batch(make_batch(seq_len=30), 0, 2, target_length=32)  # pad then split
    assert padded["tokens"].shape == (2, 16)
    with pytest.raises(ValueError, match="target_length"):
        partition_batch(make_batch(seq_len=36), 0, 2, target_length=32)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_partition_packed_documents(cp_size):
    batch = make_batch(doc_lengths=DOC_LENGTHS)
    parts = [partition_batch(batch, r, cp_size) for r in range(cp_size)]
    multiple = 2 * cp_size
    padded = [[-(-n // multiple) * multiple for n in lengths] for lengths in DOC_LENGTHS]
    total = max(sum(p) for p in padded)
    for n, lengths in enumerate(DOC_LENGTHS):
        sample_padded = padded[n][:-1] + [padded[n][-1] + total - sum(padded[n])]
        bounds = torch.tensor([0] + sample_padded).cumsum(0)
        assert torch.equal(parts[0]["cu_seqlens"][n], bounds)
        index = torch.cat([p["token_index"][n] for p in parts])
        assert torch.equal(index.sort().values, torch.arange(total))  # every token once
        full = {}
        for key in ("tokens", "labels", "loss_mask", "position_ids", "document_ids"):
            full[key] = torch.zeros(total, dtype=parts[0][key].dtype)
            for p in parts:
                full[key][p["token_index"][n]] = p[key][n]
        start = 0
        for doc, (length, size) in enumerate(zip(lengths, sample_padded)):
            lo, hi = int(bounds[doc]), int(bounds[doc + 1])
            assert hi - lo == size
            assert torch.equal(full["tokens"][lo:lo + length], batch["tokens"][n, start:start + length])
            assert (full["loss_mask"][lo + length:hi] == 0).all()
            assert (full["labels"][lo + length:hi] == 0).all() and (full["tokens"][lo + length:hi] == 0).all()
            assert torch.equal(full["position_ids"][lo:hi], torch.arange(size))  # continuing
            assert (full["document_ids"][lo:hi] == doc).all()
            for p in parts:  # each rank holds size / cp tokens of every document
                held = ((p["token_index"][n] >= lo) & (p["token_index"][n] < hi)).sum()
                assert int(held) == size // cp_size
            start += length
    with pytest.raises(ValueError, match="target_length"):
        partition_batch(batch, 0, cp_size, target_length=total - multiple)
    single = partition_batch(batch, 0, 1)  # CP=1: documents kept as they are, no padding
    assert torch.equal(single["tokens"], batch["tokens"])
    assert single["document_ids"][1].tolist() == [0] * 12 + [1] * 7 + [2] * 17
    longer = partition_batch(batch, 0, cp_size, target_length=total + multiple)
    assert longer["tokens"].shape == (2, (total + multiple) // cp_size)
    assert len(longer["cu_seqlens"][0]) == len(DOC_LENGTHS[0]) + 1  # no zero-length document
