"""The .bin/.idx format byte for byte against files built by hand with struct, both ways."""
import struct

import numpy as np
import pytest

from megatron_cp.data.indexed_dataset import (DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder,
                                              data_file_path, dtype_code, index_file_path,
                                              optimal_dtype)

# Three documents: [5, 6, 7], then a document of two sequences [1, 2] + [3], then [9].
SEQUENCES = [[5, 6, 7], [1, 2], [3], [9]]
DOC_INDEX = [0, 1, 3, 4]
FORMATS = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}


def hand_built_files(code):
    """The .idx and .bin bytes of SEQUENCES in dtype ``code``, straight from the spec."""
    fmt = FORMATS[code]
    itemsize = struct.calcsize("<" + fmt)
    idx = b"MMIDIDX\x00\x00"
    idx += struct.pack("<Q", 1)
    idx += struct.pack("<B", code)
    idx += struct.pack("<Q", len(SEQUENCES))
    idx += struct.pack("<Q", len(DOC_INDEX))
    idx += b"".join(struct.pack("<i", len(s)) for s in SEQUENCES)
    pointer = 0
    for s in SEQUENCES:
        idx += struct.pack("<q", pointer)
        pointer += len(s) * itemsize
    idx += b"".join(struct.pack("<q", d) for d in DOC_INDEX)
    binary = b"".join(struct.pack("<" + fmt, v) for s in SEQUENCES for v in s)
    return idx, binary


def write_with_builder(prefix, dtype):
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    builder.add_document(SEQUENCES[0])
    builder.add_document(SEQUENCES[1] + SEQUENCES[2], lengths=[2, 1])
    builder.add_item(np.array(SEQUENCES[3]))
    builder.end_document()
    builder.finalize(index_file_path(prefix))


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_writer_matches_hand_built_bytes(tmp_path, code):
    prefix = str(tmp_path / f"ds{code}")
    write_with_builder(prefix, DTYPE_CODES[code])
    idx, binary = hand_built_files(code)
    assert open(index_file_path(prefix), "rb").read() == idx
    assert open(data_file_path(prefix), "rb").read() == binary


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_reader_reads_hand_built_files(tmp_path, code):
    prefix = str(tmp_path / f"hand{code}")
    idx, binary = hand_built_files(code)
    open(index_file_path(prefix), "wb").write(idx)
    open(data_file_path(prefix), "wb").write(binary)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(DTYPE_CODES[code])
    assert len(ds) == 4 and ds.num_documents == 3
    assert ds.sequence_lengths.tolist() == [3, 2, 1, 1]
    assert ds.document_indices.tolist() == DOC_INDEX
    for i, seq in enumerate(SEQUENCES):
        assert ds[i].tolist() == seq
    assert ds[-1].tolist() == [9]
    assert ds.get(0, offset=1, length=2).tolist() == [6, 7]
    assert ds.get(0, offset=2).tolist() == [7]
    assert [a.tolist() for a in ds[1:3]] == [[1, 2], [3]]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds[4]


def test_dtype_codes_and_optimal_dtype():
    assert {c: np.dtype(d).name for c, d in DTYPE_CODES.items()} == {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
        7: "float32", 8: "uint16"}
    assert dtype_code(np.uint16) == 8 and dtype_code(np.int32) == 4
    with pytest.raises(ValueError, match="no indexed-dataset code"):
        dtype_code(np.complex64)
    assert optimal_dtype(32000) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


def test_bad_headers_raise_value_error_naming_the_file(tmp_path):
    idx, binary = hand_built_files(8)
    cases = {
        "magic": b"NOTMAGIC!" + idx[9:],
        "version": idx[:9] + struct.pack("<Q", 2) + idx[17:],
        "code": idx[:17] + struct.pack("<B", 9) + idx[18:],
        "truncated": idx[:-8],
    }
    messages = {"magic": "magic", "version": "version 2", "code": "dtype code 9",
                "truncated": "truncated"}
    for name, data in cases.items():
        prefix = str(tmp_path / name)
        open(index_file_path(prefix), "wb").write(data)
        open(data_file_path(prefix), "wb").write(binary)
        with pytest.raises(ValueError, match=messages[name]) as err:
            IndexedDataset(prefix)
        assert index_file_path(prefix) in str(err.value)
    with pytest.raises(ValueError, match="does not exist"):
        IndexedDataset(str(tmp_path / "missing"))


def test_builder_rejects_out_of_range_tokens_and_bad_lengths(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit uint16"):
        builder.add_document([1, 70000])
    with pytest.raises(ValueError, match="sum to 3"):
        builder.add_document([1, 2], lengths=[1, 2])
    builder.finalize(str(tmp_path / "x.idx"))


def test_add_index_merges_datasets(tmp_path):
    first, second, merged = (str(tmp_path / n) for n in ("a", "b", "merged"))
    write_with_builder(first, np.uint16)
    write_with_builder(second, np.uint16)
    builder = IndexedDatasetBuilder(data_file_path(merged), dtype=np.uint16)
    builder.add_index(first)
    builder.add_index(second)
    builder.finalize(index_file_path(merged))
    ds = IndexedDataset(merged)
    assert [ds[i].tolist() for i in range(len(ds))] == SEQUENCES * 2
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5, 7, 8]


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32).finalize(index_file_path(prefix))
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
