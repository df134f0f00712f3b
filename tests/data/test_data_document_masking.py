"""--dataloader-inter-document-masking: a sample's documents are the pieces of the dataset's
documents it was assembled from (Megatron-LM's cu_seqlens), not its EOD tokens. Every check
compares with Megatron-LM's rule computed here from the index arrays and the documents'
lengths alone: a new document begins at the sample's first token and at every document start
of the shuffled stream inside the sample, and its position ids count from 0 there."""
import numpy as np
import pytest
import torch

from megatron_cp.cli.arguments import parse_args
from megatron_cp.data.batch import build_data_iterator, get_ltor_batch, text_and_documents
from megatron_cp.data.blended_dataset import BlendedDataset
from megatron_cp.data.builder import build_train_valid_test_datasets
from megatron_cp.data.fim import FimDataset
from megatron_cp.data.gpt_dataset import GPTDataset
from megatron_cp.data.indexed_dataset import IndexedDataset
from megatron_cp.data.tokenizers import build_tokenizer
from megatron_cp.startup import run_config
from test_data_gpt_dataset import write_dataset

EOD = 500
SEQ = 16


def documents(kind, num_docs=20, seed=0):
    """Token documents: "eod": each ends with EOD; "plain": none holds one; "aligned": all 8
    tokens long, without EOD (every sample boundary falls on a document start, so the extra
    label token is a whole piece of its own)."""
    rng = np.random.RandomState(seed)
    lengths = np.full(num_docs, 8) if kind == "aligned" else rng.randint(1, 30, size=num_docs)
    docs = [rng.randint(1, EOD, size=n) for n in lengths]
    if kind == "eod":
        for doc in docs:
            doc[-1] = EOD
    return docs


def megatron_rule(dataset, k, lengths):
    """(document ids, position ids) of sample ``k``'s input tokens by Megatron-LM's rule, from
    ``dataset``'s document/sample/shuffle index and the documents' ``lengths``."""
    s = dataset.seq_length
    i = int(dataset.shuffle_index[k])
    stream_starts = np.concatenate([[0], np.cumsum(np.asarray(lengths)[dataset.document_index])])
    tokens = np.arange(i * s, (i + 1) * s)  # the sample's input tokens in the shuffled stream
    owner = np.searchsorted(stream_starts, tokens, side="right") - 1  # doc-index position
    ids = np.unique(owner, return_inverse=True)[1]
    positions = tokens - np.maximum(stream_starts[owner], i * s)
    return ids, positions


def as_batch(sample):
    return (torch.from_numpy(sample["text"])[None],
            torch.from_numpy(sample["document_ids"])[None])  # [1, s+1], [1, s]


@pytest.mark.parametrize("kind", ["eod", "plain", "aligned"])
def test_samples_follow_megatron_rule(tmp_path, kind):
    docs = documents(kind)
    indexed = IndexedDataset(write_dataset(str(tmp_path / kind), docs))
    lengths = np.array([len(d) for d in docs])
    ds = GPTDataset(indexed, (0, len(docs)), 60, SEQ, seed=3, inter_document_masking=True)
    mid_document = multi_document = eod_rule_differs = 0
    for k in range(len(ds)):
        sample = ds[k]
        ids, positions = megatron_rule(ds, k, lengths)
        assert sample["document_ids"].dtype == np.int64
        np.testing.assert_array_equal(sample["document_ids"], ids)
        text, document_ids = as_batch(sample)
        # the EOD rules change nothing beside the dataset's documents; the EOD loss mask stays
        batch = get_ltor_batch(text, EOD, reset_position_ids=True, reset_attention_mask=True,
                               eod_mask_loss=True, document_ids=document_ids)
        np.testing.assert_array_equal(batch["document_ids"][0].numpy(), ids)
        np.testing.assert_array_equal(batch["position_ids"][0].numpy(), positions)
        np.testing.assert_array_equal(batch["loss_mask"][0].numpy(),
                                      (sample["text"][:-1] != EOD).astype(np.float32))
        by_eod = get_ltor_batch(text, EOD, reset_position_ids=True, reset_attention_mask=True)
        same = (np.array_equal(by_eod["document_ids"][0].numpy(), ids)
                and np.array_equal(by_eod["position_ids"][0].numpy(), positions))
        assert same or kind != "eod"  # documents ending with EOD: the two rules coincide
        eod_rule_differs += not same
        i = int(ds.shuffle_index[k])
        mid_document += int(ds.sample_index[i][1]) > 0
        multi_document += ids[-1] >= 1
    assert multi_document and (mid_document or kind == "aligned")
    # without EODs the EOD rule sees one document in every sample that holds several
    assert eod_rule_differs == (0 if kind == "eod" else multi_document)


def test_blended_mock_and_fim_samples(tmp_path):
    parts = [documents("plain", seed=1), documents("eod", seed=2)]
    prefixes = [write_dataset(str(tmp_path / f"p{n}"), docs) for n, docs in enumerate(parts)]
    blended = build_train_valid_test_datasets(["0.4", prefixes[0], "0.6", prefixes[1]], "100,0,0",
                                              (40, 0, 0), SEQ, 5, None, False,
                                              str(tmp_path / "cache"),
                                              inter_document_masking=True)[0]
    assert isinstance(blended, BlendedDataset)
    for k in range(len(blended)):
        d, j = int(blended.dataset_index[k]), int(blended.dataset_sample_index[k])
        lengths = [len(doc) for doc in parts[d]]
        np.testing.assert_array_equal(blended[k]["document_ids"],
                                      megatron_rule(blended.datasets[d], j, lengths)[0])
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=50)
    mock = build_train_valid_test_datasets(None, "100,0,0", (20, 0, 0), SEQ, 5, tokenizer, True,
                                           None, inter_document_masking=True)[0]
    lengths = mock.indexed_dataset.sequence_lengths
    for k in range(20):
        np.testing.assert_array_equal(mock[k]["document_ids"], megatron_rule(mock, k, lengths)[0])
    # Megatron-LM's FIM samples are one document each
    fim = FimDataset(mock, lambda text, rng: text[::-1].copy(), seed=0)
    assert not fim[0]["document_ids"].any() and fim[0]["document_ids"].shape == (SEQ,)


def test_iterator_carries_the_document_ids(tmp_path):
    docs = documents("plain")
    indexed = IndexedDataset(write_dataset(str(tmp_path / "it"), docs))
    ds = GPTDataset(indexed, (0, len(docs)), 8, SEQ, seed=3, inter_document_masking=True)
    text, ids = text_and_documents(next(build_data_iterator(ds, 4, 2, 1, 2)))
    assert text.shape == (2, SEQ + 1) and ids.shape == (2, SEQ) and ids.dtype == torch.int64
    for row, k in enumerate((2, 3)):  # DP rank 1 of 2 takes samples 2, 3 of the first batch
        np.testing.assert_array_equal(ids[row].numpy(), ds[k]["document_ids"])
    plain = GPTDataset(indexed, (0, len(docs)), 8, SEQ, seed=3)
    assert text_and_documents(next(build_data_iterator(plain, 4, 2, 0, 1)))[1] is None
    with pytest.raises(ValueError, match="document_ids must be"):
        get_ltor_batch(text, EOD, document_ids=ids[:, 1:])


def test_the_flag_is_accepted():
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --vocab-size 100 "
            "--dataloader-inter-document-masking")
    args = parse_args(argv.split(), world_size=1)
    assert args.dataloader_inter_document_masking
    assert run_config(args).data.dataloader_inter_document_masking
    assert not run_config(parse_args(argv.split()[:-1], world_size=1)).data \
        .dataloader_inter_document_masking
