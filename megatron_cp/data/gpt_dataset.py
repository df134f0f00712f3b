"""GPT pretraining samples over an indexed dataset, and the mock dataset.

A :class:`GPTDataset` reads the documents ``[begin, end)`` of an indexed dataset (one
sequence per document, as tools/preprocess_data.py writes them) and serves
``num_samples`` or more samples of ``seq_length + 1`` tokens, as Megatron-LM does:

1. document index: the split's document ids repeated for as many epochs as the
   requested samples need, shuffled. When the last epoch is needed for less than 80%
   of its samples it is shuffled apart, so those documents are not favoured.
2. sample index ``[n + 1, 2]``: row ``i`` is (position in the document index, token
   offset) of token ``i * seq_length`` of the concatenated shuffled documents. Sample
   ``i`` is tokens ``[i * seq_length, (i + 1) * seq_length]`` (both ends included), so
   consecutive samples share one token and samples cross document boundaries.
3. shuffle index: a permutation of the samples (the final separate epoch apart).

The three arrays are cached as ``.npy`` files keyed by a hash of the configuration.

With ``inter_document_masking`` (``--dataloader-inter-document-masking``) a sample also
carries ``document_ids``: for each of its ``seq_length`` input tokens, which of the document
pieces the sample was assembled from it belongs to (Megatron-LM's cu_seqlens, as ids).
"""
import logging
import os

import numpy as np

from megatron_cp.data.utils import build_or_load_cached

logger = logging.getLogger(__name__)

# Below this fraction of an epoch, the last epoch is shuffled separately (Megatron's 0.8).
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def default_cache_dir(path_prefix):
    """Megatron's default cache location: ``<data dir>/cache/GPTDataset_indices``."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache",
                        "GPTDataset_indices")


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens over documents ``[begin, end)``.

    ``dataset[i]`` is ``{"text": np.int64 array of seq_length + 1}``, plus, with
    ``inter_document_masking``, ``"document_ids"`` (:func:`piece_document_ids`).
    ``len(dataset)`` is at least ``num_samples`` (whole epochs are indexed; 0 or None asks
    for one epoch). ``cache_dir`` None builds the index arrays in memory (no files).
    """

    def __init__(self, indexed_dataset, document_range, num_samples, seq_length, seed,
                 split_name="train", path_prefix=None, cache_dir=None,
                 inter_document_masking=False):
        begin, end = document_range
        if not 0 <= begin < end <= len(indexed_dataset):
            raise ValueError(f"document range [{begin}, {end}) is empty or outside the "
                             f"{len(indexed_dataset)} documents of {path_prefix}")
        if seq_length < 1:
            raise ValueError(f"seq_length ({seq_length}) must be >= 1")
        self.indexed_dataset = indexed_dataset
        self.document_range = (int(begin), int(end))
        self.num_samples = int(num_samples or 0)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.split_name = split_name
        self.path_prefix = path_prefix
        # what a sample carries, not how it is indexed: not in the description (cache key)
        self.inter_document_masking = bool(inter_document_masking)
        lengths = indexed_dataset.sequence_lengths
        self.description = {
            "class": "GPTDataset", "path_prefix": path_prefix, "split": split_name,
            "document_range": list(self.document_range), "num_samples": self.num_samples,
            "seq_length": self.seq_length, "seed": self.seed, "add_extra_token": 1,
            # The data itself: a regenerated dataset under the same prefix gets new indices.
            "num_sequences": len(lengths), "num_tokens": int(np.sum(lengths, dtype=np.int64)),
        }
        arrays = build_or_load_cached(
            cache_dir, f"GPTDataset-{split_name}", self.description,
            ("document_index", "sample_index", "shuffle_index"), self._build_indices)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self):
        return len(self.shuffle_index)

    def __getitem__(self, idx):
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        i = int(self.shuffle_index[idx])
        pos_beg, off_beg = (int(x) for x in self.sample_index[i])
        pos_end, off_end = (int(x) for x in self.sample_index[i + 1])
        docs = self.document_index
        if pos_beg == pos_end:
            pieces = [self.indexed_dataset.get(int(docs[pos_beg]), off_beg, off_end - off_beg + 1)]
        else:
            pieces = [self.indexed_dataset.get(int(docs[pos_beg]), off_beg)]
            pieces += [self.indexed_dataset.get(int(docs[p])) for p in range(pos_beg + 1, pos_end)]
            pieces.append(self.indexed_dataset.get(int(docs[pos_end]), 0, off_end + 1))
        text = np.concatenate(pieces).astype(np.int64)
        assert len(text) == self.seq_length + 1, (len(text), self.seq_length)
        if self.inter_document_masking:
            return {"text": text, "document_ids": piece_document_ids([len(p) for p in pieces])}
        return {"text": text}

    def _build_indices(self):
        begin, end = self.document_range
        documents = np.arange(begin, end, dtype=np.int64)
        sizes = np.asarray(self.indexed_dataset.sequence_lengths)
        tokens_per_epoch = int(np.sum(sizes[begin:end], dtype=np.int64))
        if tokens_per_epoch < 1:
            raise ValueError(f"documents [{begin}, {end}) of {self.path_prefix} hold no tokens; "
                             "check the preprocessing or the --split")
        # Epochs to cover num_samples samples of seq_length tokens plus the one extra token.
        wanted = self.num_samples * self.seq_length + 1
        num_epochs = max(1, -(-wanted // tokens_per_epoch))
        separate_final_epoch = False
        if num_epochs > 1:
            per_epoch = (tokens_per_epoch - 1) // self.seq_length
            from_final = self.num_samples - (num_epochs - 1) * per_epoch
            separate_final_epoch = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
        sample_index = build_sample_index(sizes, document_index, self.seq_length)
        num_total = len(sample_index) - 1
        if separate_final_epoch:
            num_first = (num_epochs - 1) * ((tokens_per_epoch - 1) // self.seq_length)
        else:
            num_first = num_total
        shuffle_index = build_shuffle_index(num_first, num_total, rng)
        logger.info("%s %s: %d documents, %d epochs, %d samples", self.path_prefix,
                    self.split_name, end - begin, num_epochs, num_total)
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index}


def piece_document_ids(piece_lengths):
    """Megatron-LM's documents of a sample (its ``inter_document_masking`` cu_seqlens) as
    ids: the ``seq_length`` input tokens of a sample assembled from pieces of
    ``piece_lengths`` tokens (``seq_length + 1`` in all) numbered 0, 1, ... by piece. The
    extra label token leaves the last piece (which goes when that was all it held), and an
    empty piece numbers nothing, so the ids are consecutive. Document boundaries come from
    the index, not from EOD tokens. Returns an int64 array of ``seq_length``. (Samples here
    are never short, so Megatron-LM's folding of a short sample's padding into its last
    document has nothing to fold.)
    """
    lengths = np.asarray(piece_lengths, dtype=np.int64).copy()
    lengths[-1] -= 1
    lengths = lengths[lengths > 0]
    return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


def build_document_index(documents, num_epochs, rng, separate_final_epoch):
    """``documents`` repeated ``num_epochs`` times and shuffled (final epoch apart if asked)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes, document_index, seq_length):
    """``[n + 1, 2]`` (document-index position, offset) of every token ``i * seq_length``.

    ``n = (total_tokens - 1) // seq_length`` samples fit: each needs ``seq_length + 1``
    tokens and shares its last one with the next sample.
    """
    doc_sizes = np.asarray(sizes, dtype=np.int64)[np.asarray(document_index)]
    starts = np.zeros(len(doc_sizes) + 1, dtype=np.int64)
    np.cumsum(doc_sizes, out=starts[1:])
    num_samples = int((starts[-1] - 1) // seq_length)
    boundaries = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # 'right' - 1 skips empty documents: the position whose tokens contain the boundary.
    positions = np.searchsorted(starts, boundaries, side="right") - 1
    offsets = boundaries - starts[positions]
    dtype = np.int32 if max(len(doc_sizes), int(doc_sizes.max(initial=0))) < 2**31 - 1 else np.int64
    return np.stack((positions, offsets), axis=1).astype(dtype)


def build_shuffle_index(num_first, total, rng):
    """A permutation of ``[0, total)`` that shuffles ``[0, num_first)`` and the rest apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class MockIndexedDataset:
    """Deterministic synthetic documents with the reader API of an IndexedDataset.

    Document ``d`` has a length in ``[1, 2 * seq_length]`` and counts upwards from a
    random start (mod ``vocab_size - 1``, stepping over the eod id), then ends with eod:
    a learnable pattern with EOD tokens inside most samples.
    """

    def __init__(self, tokenizer, seq_length, num_documents=1000, seed=0):
        vocab_size, eod = int(tokenizer.vocab_size), int(tokenizer.eod)
        if vocab_size < 2 or not 0 <= eod < vocab_size:
            raise ValueError(f"mock data needs a tokenizer with vocab_size >= 2 and "
                             f"0 <= eod < vocab_size, got vocab_size={vocab_size}, eod={eod}")
        rng = np.random.RandomState(seed)
        self.sequence_lengths = rng.randint(1, 2 * seq_length + 1, size=num_documents).astype(np.int32)
        starts = rng.randint(0, vocab_size - 1, size=num_documents)
        self.sequence_pointers = np.zeros(num_documents, dtype=np.int64)
        np.cumsum(self.sequence_lengths[:-1], out=self.sequence_pointers[1:])
        self.document_indices = np.arange(num_documents + 1, dtype=np.int64)
        total = int(self.sequence_lengths.sum())
        doc_of_token = np.repeat(np.arange(num_documents), self.sequence_lengths)
        within = np.arange(total) - self.sequence_pointers[doc_of_token]
        tokens = (starts[doc_of_token] + within) % (vocab_size - 1)
        tokens = tokens + (tokens >= eod)  # never emit eod inside a document
        ends = self.sequence_pointers + self.sequence_lengths - 1
        tokens[ends] = eod
        self.tokens = tokens.astype(np.int32)
        self.dtype = self.tokens.dtype

    def __len__(self):
        return len(self.sequence_lengths)

    def __getitem__(self, idx):
        return self.get(idx)

    def get(self, idx, offset=0, length=None):
        """Tokens ``[offset, offset + length)`` of document ``idx``."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        start = int(self.sequence_pointers[idx]) + offset
        return self.tokens[start:start + length]


class MockGPTDataset(GPTDataset):
    """A GPTDataset over :class:`MockIndexedDataset` documents, indexed in memory."""

    def __init__(self, tokenizer, document_range, num_samples, seq_length, seed,
                 split_name="train", num_documents=1000, inter_document_masking=False):
        mock = MockIndexedDataset(tokenizer, seq_length, num_documents=num_documents)
        super().__init__(mock, document_range, num_samples, seq_length, seed,
                         split_name=split_name, path_prefix="mock", cache_dir=None,
                         inter_document_masking=inter_document_masking)
