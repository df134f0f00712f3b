"""Megatron's memory-mapped indexed dataset: the ``.bin`` / ``.idx`` file pair.

``<prefix>.bin`` holds the raw tokens of every sequence back to back, in one dtype.
``<prefix>.idx`` describes them (all integers little-endian)::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (see DTYPE_CODES)
    u64       sequence count S
    u64       document-index length D (number of documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence pointers, byte offsets into .bin
    int64[D]  document index: offsets into the sequence list, starting at 0

:class:`IndexedDatasetBuilder` writes the pair, :class:`IndexedDataset` memory-maps it
with numpy; both follow Megatron-LM's layout byte for byte, so files are interchangeable.

A damaged pair (wrong magic or version, a truncated index, a document index that does not
cover the sequences, a ``.bin`` shorter than the index says) is a ValueError naming the
file, at open time or, for a sequence pointing outside the ``.bin``, when it is read.
"""
import os
import shutil
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
REBUILD = "rebuild the pair with tools/preprocess_data.py (or restore it from a copy)"

# Megatron's dtype codes, stored as one byte in the .idx header.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def dtype_code(dtype):
    """Return the .idx dtype code of a numpy dtype; ValueError if the format has none."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no indexed-dataset code; use one of "
                     f"{[np.dtype(d).name for d in DTYPE_CODES.values()]}")


def optimal_dtype(vocab_size):
    """Token dtype for a vocabulary, as Megatron: uint16 below 65500 entries, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix):
    """Path of the token file of ``prefix``."""
    return prefix + ".bin"


def index_file_path(prefix):
    """Path of the index file of ``prefix``."""
    return prefix + ".idx"


def dataset_exists(prefix):
    """True when both ``<prefix>.bin`` and ``<prefix>.idx`` exist."""
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


def write_index(idx_path, dtype, sequence_lengths, document_indices):
    """Write a .idx file for sequences of ``sequence_lengths`` tokens of ``dtype``."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(docs.astype("<i8").tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams sequences into ``<prefix>.bin`` and writes ``<prefix>.idx`` on :meth:`finalize`.

    Usage::

        builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
        builder.add_document(token_ids)            # one sequence, one document
        builder.add_document(ids, lengths=[3, 5])  # two sequences, one document
        builder.finalize(index_file_path(prefix))
    """

    def __init__(self, bin_path, dtype=np.int32):
        dtype_code(dtype)  # validate early
        self.dtype = np.dtype(dtype)
        self.bin_path = bin_path
        self._file = open(bin_path, "wb")
        self.sequence_lengths = []
        self.document_indices = [0]

    def add_item(self, tokens):
        """Append one sequence (any 1-D int sequence) without closing the document."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {array.shape}")
        array = self._cast(array)
        self._file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(len(array))

    def end_document(self):
        """Close the current document: the sequences added since the last call form it."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths=None):
        """Append one document: ``tokens`` split into sequences of ``lengths`` (default: one)."""
        array = np.asarray(tokens)
        if lengths is None:
            lengths = [len(array)]
        if sum(lengths) != len(array):
            raise ValueError(f"sequence lengths sum to {sum(lengths)} but the document has "
                             f"{len(array)} tokens; pass lengths that add up to len(tokens)")
        start = 0
        for length in lengths:
            self.add_item(array[start:start + length])
            start += length
        self.end_document()

    def add_index(self, prefix):
        """Append every sequence and document of the finished dataset at ``prefix``."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix} (dtype {other.dtype}) into a {self.dtype} "
                             "builder; rebuild both with the same tokenizer")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(d) + offset for d in other.document_indices[1:])
        del other
        self._file.flush()
        with open(data_file_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._file)

    def finalize(self, idx_path):
        """Close the .bin file and write the .idx file."""
        self._file.close()
        write_index(idx_path, self.dtype, self.sequence_lengths, self.document_indices)

    def _cast(self, array):
        if array.dtype == self.dtype:
            return array
        if array.size and np.issubdtype(array.dtype, np.integer) and np.issubdtype(
                self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                raise ValueError(f"token ids in [{low}, {high}] do not fit {self.dtype.name}; "
                                 "build with a wider dtype (int32)")
        return array.astype(self.dtype)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._file.closed:
            self._file.close()


class IndexedDataset:
    """Read-only view of ``<prefix>.bin/.idx``, memory-mapped with numpy.

    ``len(ds)`` is the sequence count, ``ds[i]`` one sequence as a numpy array,
    ``ds.get(i, offset, length)`` a slice of it without reading the rest. With
    ``mmap_bin=False`` (Megatron's ``--no-mmap-bin-files``) the .bin file is not mapped:
    each ``get`` reads its tokens with one positioned file read (the index is still mapped).
    """

    def __init__(self, path_prefix, mmap_bin=True):
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"indexed dataset file {path} does not exist; pass the prefix "
                                 "without .bin/.idx (run tools/preprocess_data.py to build it)")
        self._idx_buffer = _map(idx_path)
        header_size = len(MAGIC) + 8 + 1 + 8 + 8
        if len(self._idx_buffer) < header_size:
            raise ValueError(f"{idx_path} is {len(self._idx_buffer)} bytes, shorter than the "
                             f"{header_size}-byte header; the file is truncated: {REBUILD}")
        header = bytes(self._idx_buffer[:header_size])
        if header[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx_path} has magic {header[:len(MAGIC)]!r}, expected {MAGIC!r}: "
                             f"not a Megatron MMIDIDX index file, or a corrupted one; {REBUILD}")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise ValueError(f"{idx_path} has index version {version}; only version {VERSION} "
                             f"is supported (a corrupted header?); {REBUILD}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path} has dtype code {code}; known codes are "
                             f"{sorted(DTYPE_CODES)} (a corrupted header?); {REBUILD}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = header_size + count * 4 + count * 8 + doc_count * 8
        if len(self._idx_buffer) < expected:
            raise ValueError(f"{idx_path} is {len(self._idx_buffer)} bytes but its header "
                             f"describes {expected}; the file is truncated: {REBUILD}")
        offset = header_size
        self.sequence_lengths = np.frombuffer(self._idx_buffer, "<i4", count, offset)
        offset += count * 4
        self.sequence_pointers = np.frombuffer(self._idx_buffer, "<i8", count, offset)
        offset += count * 8
        self.document_indices = np.frombuffer(self._idx_buffer, "<i8", doc_count, offset)
        docs = self.document_indices
        if doc_count == 0 or docs[0] != 0 or docs[-1] > count or \
                (doc_count > 1 and bool((np.diff(docs) < 0).any())):
            raise ValueError(f"{idx_path}: its document index does not run from 0 within its "
                             f"{count} sequences; the file is corrupted: {REBUILD}")
        self._bin_path = bin_path
        self._bin_buffer = _map(bin_path) if mmap_bin else None
        self._bin_size = os.path.getsize(bin_path)
        self._check_sequences_fit(idx_path, bin_path)

    def _check_sequences_fit(self, idx_path, bin_path, block=1 << 22):
        """ValueError unless every sequence lies inside the .bin file: a truncated .bin, or
        an index with corrupted lengths or pointers, fails here instead of mid-training.
        Vectorised in blocks (12 bytes read per sequence, like the dataset's own index)."""
        size, itemsize = self._bin_size, self.dtype.itemsize
        for first in range(0, len(self.sequence_lengths), block):
            lengths = self.sequence_lengths[first:first + block].astype(np.int64)
            pointers = self.sequence_pointers[first:first + block]
            ends = pointers + lengths * itemsize
            if lengths.min() < 0 or pointers.min() < 0:
                raise ValueError(f"{idx_path} holds negative sequence lengths or pointers; the "
                                 f"file is corrupted: {REBUILD}")
            if int(ends.max()) > size:
                raise ValueError(f"{bin_path} is {size} bytes but {idx_path} points up to byte "
                                 f"{int(ends.max())}; the .bin file is truncated (or the index "
                                 f"corrupted): {REBUILD}")

    def __len__(self):
        return len(self.sequence_lengths)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        return self.get(idx)

    def get(self, idx, offset=0, length=None):
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end by default)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {idx} "
                             f"of {size} tokens")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        if size < 0 or start < 0 or start + length * self.dtype.itemsize > self._bin_size:
            raise ValueError(f"{index_file_path(self.path_prefix)}: sequence {idx} ({size} "
                             f"tokens at byte {int(self.sequence_pointers[idx])}) lies outside "
                             f"{data_file_path(self.path_prefix)} ({self._bin_size} bytes); "
                             f"the pair is corrupted: {REBUILD}")
        if self._bin_buffer is None:  # --no-mmap-bin-files: one positioned read
            return np.fromfile(self._bin_path, self.dtype, length, offset=start)
        return np.frombuffer(self._bin_buffer, self.dtype, length, start)

    @property
    def num_documents(self):
        """Number of documents (the document index has one more entry)."""
        return len(self.document_indices) - 1


def _map(path):
    # np.memmap refuses empty files; an empty dataset is still a valid dataset.
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, mode="r", order="C", dtype=np.uint8)
