"""GPTDataset index building and caching, split ranges, blending, mock data."""
import os

import numpy as np
import pytest

from dist_harness import run_workers
from megatron_cp.data.blended_dataset import BlendedDataset, build_blending_indices
from megatron_cp.data.builder import build_train_valid_test_datasets
from megatron_cp.data.gpt_dataset import GPTDataset, build_sample_index
from megatron_cp.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                              data_file_path, index_file_path)
from megatron_cp.data.tokenizers import build_tokenizer
from megatron_cp.data.utils import get_split_ranges, parse_and_normalize_split, parse_data_path


def make_documents(num_docs, base=0, seed=0):
    """Documents whose tokens say where they come from: doc d token j = base + 100 d + j."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, 40, size=num_docs)
    lengths[3] = 1
    return [base + 100 * d + np.arange(n) for d, n in enumerate(lengths)]


def write_dataset(prefix, docs):
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(index_file_path(prefix))
    return prefix


def check_samples(ds, docs, seq_length):
    """Every sample is seq_length + 1 tokens of the shuffled documents' concatenation."""
    stream = np.concatenate([docs[d] for d in ds.document_index])
    seen = set()
    for k in range(len(ds)):
        i = int(ds.shuffle_index[k])
        seen.add(i)
        text = ds[k]["text"]
        assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
        np.testing.assert_array_equal(text, stream[i * seq_length:(i + 1) * seq_length + 1])
    assert seen == set(range(len(ds)))  # the shuffle index is a permutation


def test_gpt_dataset_samples_cross_documents_and_epochs(tmp_path):
    docs = make_documents(20)
    prefix = write_dataset(str(tmp_path / "ds"), docs)
    indexed = IndexedDataset(prefix)
    tokens = sum(len(d) for d in docs[5:15])
    seq_length = 16
    for num_samples in (3, tokens // seq_length + 2, 5 * tokens // seq_length):
        ds = GPTDataset(indexed, (5, 15), num_samples, seq_length, seed=7, path_prefix=prefix)
        assert len(ds) >= num_samples
        num_epochs = len(ds.document_index) // 10
        assert sorted(ds.document_index.tolist()) == sorted(list(range(5, 15)) * num_epochs)
        assert len(ds) == (num_epochs * tokens - 1) // seq_length
        check_samples(ds, docs, seq_length)
    # Deterministic in the seed.
    again = GPTDataset(indexed, (5, 15), 30, seq_length, seed=7, path_prefix=prefix)
    same = GPTDataset(indexed, (5, 15), 30, seq_length, seed=7, path_prefix=prefix)
    other = GPTDataset(indexed, (5, 15), 30, seq_length, seed=8, path_prefix=prefix)
    np.testing.assert_array_equal(again.shuffle_index, same.shuffle_index)
    np.testing.assert_array_equal(again.document_index, same.document_index)
    assert not np.array_equal(other.document_index, again.document_index)


def test_separate_final_epoch():
    # 10 documents of 10 tokens: 99 // 10 = 9 samples per epoch. Asking 11 samples needs
    # 2 epochs, 2 samples from the last (< 80%): the last epoch is shuffled on its own.
    class Flat:
        sequence_lengths = np.full(10, 10, dtype=np.int32)

        def __len__(self):
            return 10

    ds = GPTDataset(Flat(), (0, 10), 11, 10, seed=1)
    assert len(ds.document_index) == 20 and len(ds) == 19
    assert sorted(ds.document_index[:10].tolist()) == list(range(10))
    assert sorted(ds.document_index[10:].tolist()) == list(range(10))
    assert sorted(ds.shuffle_index[:9].tolist()) == list(range(9))
    assert sorted(ds.shuffle_index[9:].tolist()) == list(range(9, 19))
    # 19 samples: the second epoch is used almost whole, so all 20 documents shuffle together.
    shared = GPTDataset(Flat(), (0, 10), 19, 10, seed=1)
    assert len(shared) == 19
    assert sorted(shared.shuffle_index.tolist()) == list(range(19))
    assert sorted(shared.document_index[:10].tolist()) != list(range(10))


def test_sample_index_skips_empty_documents():
    sizes = np.array([3, 0, 4, 0, 0, 5])
    index = build_sample_index(sizes, np.arange(6), 4)
    # tokens 0, 4, 8 -> doc 0 off 0, doc 2 off 1, doc 5 off 1
    assert index.tolist() == [[0, 0], [2, 1], [5, 1]]


def test_index_cache_is_built_once_and_reused(tmp_path, monkeypatch):
    docs = make_documents(12)
    prefix = write_dataset(str(tmp_path / "ds"), docs)
    cache = str(tmp_path / "cache")
    first = GPTDataset(IndexedDataset(prefix), (0, 12), 40, 8, seed=3, path_prefix=prefix,
                       cache_dir=cache)
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 3
    assert any(f.endswith("GPTDataset-train-description.json") for f in files)

    def no_build(self):
        raise AssertionError("the cached index arrays should have been loaded")
    monkeypatch.setattr(GPTDataset, "_build_indices", no_build)
    second = GPTDataset(IndexedDataset(prefix), (0, 12), 40, 8, seed=3, path_prefix=prefix,
                        cache_dir=cache)
    assert isinstance(second.shuffle_index, np.memmap)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    check_samples(second, docs, 8)
    with pytest.raises(AssertionError, match="cached"):  # another config -> another key
        GPTDataset(IndexedDataset(prefix), (0, 12), 40, 8, seed=4, path_prefix=prefix,
                   cache_dir=cache)


def _build_in_worker(rank, world_size, prefix, cache):
    import time

    built = []
    original = GPTDataset._build_indices

    def spy(self):
        built.append(rank)
        time.sleep(0.5)  # rank 1 must wait for the files, not build them itself
        return original(self)
    GPTDataset._build_indices = spy
    ds = GPTDataset(IndexedDataset(prefix), (0, 12), 25, 8, seed=5, path_prefix=prefix,
                    cache_dir=cache)
    if rank == 0:
        # No collective inside: ranks may build datasets that other ranks never build.
        GPTDataset(IndexedDataset(prefix), (0, 12), 9, 8, seed=5, split_name="valid",
                   path_prefix=prefix, cache_dir=cache)
    return bool(built), np.asarray(ds.shuffle_index).tolist(), ds[0]["text"].tolist()


def test_only_rank_zero_builds_the_cache(tmp_path):
    prefix = write_dataset(str(tmp_path / "ds"), make_documents(12))
    results = run_workers(_build_in_worker, 2, prefix, str(tmp_path / "cache"), timeout=60)
    assert [r[0] for r in results] == [True, False]
    assert results[0][1:] == results[1][1:]


def test_waiting_for_missing_cache_files_times_out(tmp_path):
    from megatron_cp.data.utils import wait_for_files

    with pytest.raises(ValueError, match="global rank 0"):
        wait_for_files([str(tmp_path / "never.npy")], timeout=0.3, poll_interval=0.1)


def test_split_ranges_follow_megatron():
    assert parse_and_normalize_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_and_normalize_split("1") == [1.0, 0.0, 0.0]
    assert get_split_ranges("949,50,1", 1000)[0] == [(0, 949), (949, 999), (999, 1000)]
    assert get_split_ranges("1,1,1", 10)[0] == [(0, 4), (4, 7), (7, 10)]
    assert get_split_ranges("98,2,0", 79)[0] == [(0, 77), (77, 79), (79, 79)]
    assert get_split_ranges("100,0,0", 5)[0] == [(0, 5), (5, 5), (5, 5)]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="split"):
            parse_and_normalize_split(bad)


def test_parse_data_path():
    assert parse_data_path(["A"]) == (["A"], [1.0])
    assert parse_data_path(["A", "B"]) == (["A", "B"], [0.5, 0.5])
    prefixes, weights = parse_data_path(["0.3", "A", "0.7", "B"])
    assert prefixes == ["A", "B"] and weights == pytest.approx([0.3, 0.7])
    assert parse_data_path(["3", "A", "1", "B"])[1] == pytest.approx([0.75, 0.25])
    with pytest.raises(ValueError, match="mixes weights"):
        parse_data_path(["0.3", "A", "0.7"])


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.2, 0.5, 0.3], [1 / 3] * 3, [0.01, 0.99]])
def test_blending_proportions_exact_within_one_sample(weights):
    size = 2000
    dataset_index, sample_index = build_blending_indices(weights, size)
    onehot = np.eye(len(weights), dtype=np.int64)[dataset_index]
    counts = np.cumsum(onehot, axis=0)  # [n, datasets]: realized counts after n+1 samples
    n = np.arange(1, size + 1)[:, None]
    assert np.abs(counts - n * np.array(weights)[None]).max() <= 1.0
    for d in range(len(weights)):  # each dataset's samples are taken in order
        assert sample_index[dataset_index == d].tolist() == list(range(int(counts[-1, d])))


def test_build_blended_train_valid_test(tmp_path):
    a = write_dataset(str(tmp_path / "a"), make_documents(30, base=0, seed=1))
    b = write_dataset(str(tmp_path / "b"), make_documents(30, base=10000, seed=2))
    cache = str(tmp_path / "cache")
    train, valid, test = build_train_valid_test_datasets(
        ["0.3", a, "0.7", b], "8,2,0", (200, 20, 0), 8, 1234, None, False, cache)
    assert test is None and isinstance(train, BlendedDataset)
    assert len(train) == 200 and len(valid) == 20
    from_b = sum(int(train[i]["text"][0] >= 10000) for i in range(200))
    assert from_b in (139, 140, 141)
    for i in range(200):  # a sample never mixes datasets
        text = train[i]["text"]
        assert text.shape == (9,) and len(set((text >= 10000).tolist())) == 1
    # Train documents come from [0, 24), valid from [24, 30).
    assert all(int(valid[i]["text"].min() % 10000) >= 2400 for i in range(20))
    again = build_train_valid_test_datasets([a, b], "8,2,0", (100, 0, 0), 8, 1234, None,
                                            False, cache)[0]
    assert sum(int(again[i]["text"][0] >= 10000) for i in range(100)) == 50


def test_single_prefix_and_empty_split(tmp_path):
    docs = make_documents(30)
    prefix = write_dataset(str(tmp_path / "one"), docs)
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "949,50,1", (50, 5, 5), 8, 1, None, False, None)
    assert isinstance(train, GPTDataset) and len(train) >= 50
    assert train.document_range == (0, 28) and valid.document_range == (28, 30)
    assert test is None  # 0.1% of 30 documents rounds to none
    assert os.path.isdir(os.path.join(str(tmp_path), "cache", "GPTDataset_indices"))
    check_samples(train, docs, 8)


def test_mock_data():
    tok = build_tokenizer("NullTokenizer", vocab_size=50)
    train, valid, test = build_train_valid_test_datasets(
        None, "98,2,0", (40, 4, 0), 32, 1234, tok, True, None)
    assert test is None and len(train) >= 40 and len(valid) >= 4
    texts = np.stack([train[i]["text"] for i in range(40)])
    assert texts.shape == (40, 33) and texts.min() >= 0 and texts.max() <= tok.eod
    assert (texts == tok.eod).any() and (texts != tok.eod).mean() > 0.9
    again = build_train_valid_test_datasets(None, "98,2,0", (40, 4, 0), 32, 1234, tok, True,
                                            None)[0]
    np.testing.assert_array_equal(texts, np.stack([again[i]["text"] for i in range(40)]))
    # Inside a document the tokens count upwards (mod vocab, stepping over eod).
    row = texts[0]
    for x, y in zip(row[:-1], row[1:]):
        if x != tok.eod and y != tok.eod:
            assert y == (x + 1) % tok.eod
    with pytest.raises(ValueError, match="tokenizer"):
        build_train_valid_test_datasets(None, "1", (4, 0, 0), 8, 1, None, True, None)
