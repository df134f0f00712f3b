"""``build_train_valid_test_datasets``: ``--data-path``/``--split``/``--mock-data`` -> datasets.

One prefix gives GPTDatasets directly. Several prefixes (``W1 P1 W2 P2 ...`` or equal
weights for plain prefixes) give, per split, one GPTDataset per prefix with
``ceil(w * n * 1.005)`` samples, blended into exactly ``n`` samples.
A split with weight 0, or with no documents in a small corpus, is None.

Documents are the sequences of the indexed dataset (tools/preprocess_data.py writes one
sequence per document). Under torch.distributed, global rank 0 writes the index cache
and other callers wait for its files (no collective call): call it on any subset of
ranks that includes global rank 0 (e.g. TP rank 0 of every group).
"""
import logging

from megatron_cp.data.blended_dataset import BlendedDataset, blend_num_samples
from megatron_cp.data.fim import FimDataset
from megatron_cp.data.gpt_dataset import GPTDataset, MockGPTDataset, default_cache_dir
from megatron_cp.data.indexed_dataset import IndexedDataset
from megatron_cp.data.utils import SPLIT_NAMES, get_split_ranges, global_rank, parse_data_path

logger = logging.getLogger(__name__)

MOCK_NUM_DOCUMENTS = 1000


def _split_datasets(make, num_documents, split, num_samples, where):
    ranges, weights = get_split_ranges(split, num_documents)
    datasets = []
    for name, (begin, end), weight, n in zip(SPLIT_NAMES, ranges, weights, num_samples):
        if weight == 0:
            datasets.append(None)
        elif end <= begin:
            if global_rank() == 0:  # every reading rank gets here: say it once
                logger.warning("%s: the %s split (weight %.4f of %d documents) holds no document; "
                               "it is skipped", where, name, weight, num_documents)
            datasets.append(None)
        else:
            datasets.append(make(name, (begin, end), n))
    return datasets


def build_train_valid_test_datasets(data_path, split, train_valid_test_num_samples, seq_length,
                                    seed, tokenizer, mock=False, data_cache_path=None,
                                    mmap_bin=True, fim=None, inter_document_masking=False):
    """(train, valid, test) datasets, each None when its split is empty.

    ``data_path``: list of prefixes, optionally with weights (``["0.3", "A", "0.7", "B"]``);
    ``split``: ``"949,50,1"`` document-range weights; ``train_valid_test_num_samples``:
    samples per split (a blend has exactly that many, a single dataset at least);
    ``mock``: synthetic tokens from ``tokenizer`` instead of files; ``data_cache_path``:
    where the index arrays go (default ``<data dir>/cache/GPTDataset_indices``);
    ``mmap_bin``: map the .bin files (False: read each sample from the file, Megatron's
    ``--no-mmap-bin-files``); ``fim``: a :class:`~megatron_cp.data.fim.FimTransform` each
    prefix's samples go through (``--fim-data``), before any blending;
    ``inter_document_masking``: samples also carry their ``document_ids``
    (``--dataloader-inter-document-masking``, megatron_cp.data.gpt_dataset).
    """
    num_samples = [int(n or 0) for n in train_valid_test_num_samples]
    if len(num_samples) != 3:
        raise ValueError(f"train_valid_test_num_samples must have three entries, got "
                         f"{train_valid_test_num_samples}")
    if mock:
        if tokenizer is None:
            raise ValueError("--mock-data needs a tokenizer (e.g. --tokenizer-type NullTokenizer "
                             "--vocab-size N)")

        def make_mock(name, doc_range, n):
            return MockGPTDataset(tokenizer, doc_range, n, seq_length, seed, split_name=name,
                                  num_documents=MOCK_NUM_DOCUMENTS,
                                  inter_document_masking=inter_document_masking)
        return tuple(_split_datasets(make_mock, MOCK_NUM_DOCUMENTS, split, num_samples, "mock"))

    prefixes, weights = parse_data_path(data_path)
    blended = len(prefixes) > 1
    per_prefix = []  # per prefix: [train, valid, test]
    for prefix, weight in zip(prefixes, weights):
        indexed = IndexedDataset(prefix, mmap_bin=mmap_bin)
        cache_dir = data_cache_path or default_cache_dir(prefix)
        wanted = [blend_num_samples([weight], n)[0] if blended else n for n in num_samples]

        def make(name, doc_range, n, indexed=indexed, prefix=prefix, cache_dir=cache_dir):
            dataset = GPTDataset(indexed, doc_range, n, seq_length, seed, split_name=name,
                                 path_prefix=prefix, cache_dir=cache_dir,
                                 inter_document_masking=inter_document_masking)
            return dataset if fim is None else FimDataset(dataset, fim, seed)
        per_prefix.append(_split_datasets(make, len(indexed), split, wanted, prefix))
    if not blended:
        return tuple(per_prefix[0])

    result = []
    for s in range(3):
        parts = [(datasets[s], w) for datasets, w in zip(per_prefix, weights)
                 if datasets[s] is not None and w > 0]
        if not parts or num_samples[s] == 0:
            result.append(None)
            continue
        cache_dir = data_cache_path or default_cache_dir(prefixes[0])
        result.append(BlendedDataset([d for d, _ in parts], [w for _, w in parts],
                                     num_samples[s], cache_dir=cache_dir))
    return tuple(result)
