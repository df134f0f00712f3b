"""Zigzag split / inverse and prepare_microbatch (the one padding rule, then the CP
partition; plain and packed documents, fixed and data-driven lengths); no processes."""
import pytest
import torch

from megatron_cp.context_parallel import zigzag_gather, zigzag_indices, zigzag_split
from megatron_cp.data.microbatch import prepare_microbatch, required_length, step_length

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
    parts = [prepare_microbatch(batch, r, 4) for r in range(4)]
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(zigzag_gather([p[key] for p in parts], dim=1), batch[key])
    assert parts[1]["token_index"][0].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    assert parts[0]["document_ids"] is None
    with pytest.raises(ValueError, match=r"\(36\) must be a multiple of 2 x CP \(16\)"):
        prepare_microbatch(make_batch(seq_len=36), 0, 8, target_length=36)
    single = prepare_microbatch(make_batch(seq_len=35), 0, 1)  # CP=1: nothing to split or pad
    assert single["tokens"].shape == (2, 35) and single["token_index"] is None
    padded = prepare_microbatch(make_batch(seq_len=30), 0, 2, target_length=32)  # pad then split
    assert padded["tokens"].shape == (2, 16)
    with pytest.raises(ValueError, match="more than --pipeline-seq-length \\(32\\)"):
        prepare_microbatch(make_batch(seq_len=36), 0, 2, target_length=32)


def _bounds(lengths, multiple, total):
    padded = [-(-n // multiple) * multiple for n in lengths]
    padded[-1] += total - sum(padded)  # the last document is extended to the sample length
    return padded, torch.tensor([0] + padded).cumsum(0)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_partition_packed_documents(cp_size):
    batch = make_batch(doc_lengths=DOC_LENGTHS)
    parts = [prepare_microbatch(batch, r, cp_size) for r in range(cp_size)]
    multiple = 2 * cp_size
    total = max(sum(-(-n // multiple) * multiple for n in lengths) for lengths in DOC_LENGTHS)
    assert required_length(batch, cp_size) == total
    for n, lengths in enumerate(DOC_LENGTHS):
        sample_padded, bounds = _bounds(lengths, multiple, total)
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
            assert torch.equal(full["tokens"][lo:lo + length], batch["tokens"][n, start:start + length])
            assert (full["loss_mask"][lo + length:hi] == 0).all()
            assert (full["labels"][lo + length:hi] == 0).all() and (full["tokens"][lo + length:hi] == 0).all()
            # real positions kept; pad tokens repeat the document's last position (a learned
            # position table is never indexed past the real positions)
            expected = torch.cat([torch.arange(length), torch.full((size - length,), length - 1)])
            assert torch.equal(full["position_ids"][lo:hi], expected)
            assert (full["document_ids"][lo:hi] == doc).all()
            for p in parts:  # each rank holds size / cp tokens of every document
                held = ((p["token_index"][n] >= lo) & (p["token_index"][n] < hi)).sum()
                assert int(held) == size // cp_size
            start += length
    with pytest.raises(ValueError, match=f"needs {total} tokens per sample"):
        prepare_microbatch(batch, 0, cp_size, target_length=total - multiple)
    single = prepare_microbatch(batch, 0, 1)  # CP=1: documents kept as they are, no padding
    assert torch.equal(single["tokens"], batch["tokens"])
    assert torch.equal(single["document_ids"], batch["document_ids"])
    longer = prepare_microbatch(batch, 0, cp_size, target_length=total + multiple)
    assert longer["tokens"].shape == (2, (total + multiple) // cp_size)
    runs = torch.unique_consecutive(longer["document_ids"][0])  # no zero-length document
    assert runs.tolist() == list(range(len(DOC_LENGTHS[0])))


def test_pipeline_padding_extends_the_last_document():
    """CP=1 with a target length: the same rule, applied at the end of each sample."""
    batch = make_batch(seq_len=36, doc_lengths=DOC_LENGTHS)
    padded = prepare_microbatch(batch, 0, 1, target_length=40)
    assert padded["tokens"].shape == (2, 40) and padded["token_index"] is None
    for key in ("tokens", "labels", "loss_mask", "position_ids"):  # real tokens untouched
        assert torch.equal(padded[key][:, :36], batch[key])
    assert padded["loss_mask"][:, 36:].eq(0).all() and padded["tokens"][:, 36:].eq(0).all()
    assert padded["position_ids"][0, 36:].tolist() == [8] * 4  # the last document's last
    assert padded["document_ids"][0, 34:].tolist() == [3] * 6  # ... and its id
    plain = prepare_microbatch(make_batch(seq_len=30), 0, 1, target_length=32)
    assert plain["document_ids"] is None and plain["position_ids"][0, 29:].tolist() == [29] * 3


def test_step_length_rounds_up_and_buckets():
    assert step_length(36, 32, 4, bucketed=False) == 36
    assert step_length(37, 32, 4, bucketed=False) == 40
    assert step_length(20, 32, 4, bucketed=True) == 32  # never below the sequence length
    assert step_length(4100, 4096, 4, bucketed=True) == 4608  # steps of seq_length / 8
    assert step_length(4100, 4096, 8, bucketed=True) % 8 == 0
