"""Megatron .bin/.idx format: byte-exact layout, round trips (uint16 and int32), merge, legacy TNTIDX."""

import os
import struct

import numpy as np
import pytest

from hpcmeg.data import indexed
from hpcmeg.data.indexed import DType, IndexedDataset, IndexedDatasetBuilder, dataset_exists, merge_datasets, merge_main
from hpcmeg.data.indexed_legacy import LegacyIndexedDataset, open_indexed_dataset


def _build(prefix, docs, dtype):
    """docs: list of documents, each a list of sequences (lists of ids)."""
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        flat = [t for seq in doc for t in seq]
        b.add_document(np.asarray(flat, dtype=np.int64), [len(s) for s in doc])
    b.finalize(prefix + ".idx")


def test_dtype_table_matches_spec():
    assert [DType.code_of(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64,
                                       np.float32, np.uint16)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert DType.dtype_of(8) is np.uint16 and DType.dtype_of(4) is np.int32
    assert DType.optimal(50257) is np.uint16
    assert DType.optimal(65499) is np.uint16 and DType.optimal(65500) is np.int32
    with pytest.raises(ValueError):
        DType.dtype_of(9)


def test_idx_and_bin_are_byte_exact(tmp_path):
    prefix = str(tmp_path / "ds")
    docs = [[[5, 6, 7]], [[1], [2, 3]], [[65535, 0, 9, 9]]]
    _build(prefix, docs, np.uint16)
    lengths = [3, 1, 2, 4]
    pointers = [0, 6, 8, 12]  # byte offsets = cumulative lengths * 2
    doc_idx = [0, 1, 3, 4]
    expected_idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                    + struct.pack("<Q", 4) + struct.pack("<Q", 4)
                    + struct.pack("<4i", *lengths) + struct.pack("<4q", *pointers) + struct.pack("<4q", *doc_idx))
    assert open(prefix + ".idx", "rb").read() == expected_idx
    expected_bin = struct.pack("<10H", 5, 6, 7, 1, 2, 3, 65535, 0, 9, 9)
    assert open(prefix + ".bin", "rb").read() == expected_bin


def test_header_int32_and_empty_document(tmp_path):
    prefix = str(tmp_path / "ds32")
    b = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    b.add_item([100000, 7])
    b.end_document()
    b.add_document([], [])  # a zero-sequence document is representable (Megatron HEAD writes these)
    b.finalize(prefix + ".idx")
    raw = open(prefix + ".idx", "rb").read()
    assert raw[17] == 4 and struct.unpack("<QQ", raw[18:34]) == (1, 3)
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == [0, 1, 1]
    assert ds[0].tolist() == [100000, 7] and ds.dtype == np.int32


@pytest.mark.parametrize("vocab", [50257, 100277])
def test_round_trip_random(tmp_path, vocab):
    rng = np.random.default_rng(vocab)
    dtype = DType.optimal(vocab)
    docs = [[rng.integers(0, vocab, rng.integers(1, 300)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(200)]
    prefix = str(tmp_path / f"rt{vocab}")
    _build(prefix, docs, dtype)
    flat_seqs = [s for d in docs for s in d]
    for mmap in (True, False):
        ds = IndexedDataset(prefix, mmap=mmap)
        assert ds.dtype == np.dtype(dtype) and len(ds) == len(flat_seqs)
        assert all(ds[i].tolist() == s for i, s in enumerate(flat_seqs))
        assert [a.tolist() for a in ds[10:20]] == flat_seqs[10:20]
        k = next(i for i, s in enumerate(flat_seqs) if len(s) > 2)
        assert ds.get(k, offset=1, length=2).tolist() == flat_seqs[k][1:3]
        assert ds.document_indices[-1] == len(flat_seqs)
        ds.close()
    if vocab > 65500:
        assert max(max(s) for s in flat_seqs) > 65535  # the int32 case really holds ids uint16 cannot


def test_nothing_under_final_names_until_finalize(tmp_path):
    prefix = str(tmp_path / "partial")
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    b.add_document([1, 2, 3], [3])
    assert not os.path.exists(prefix + ".bin") and not dataset_exists(prefix)
    b.abort()
    assert os.listdir(tmp_path) == []


def test_truncated_index_is_rejected(tmp_path):
    prefix = str(tmp_path / "t")
    _build(prefix, [[[1, 2, 3]], [[4]]], np.uint16)
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:-3])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(prefix)


def test_merge_and_merge_cli(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _build(a, [[[1, 2]], [[3], [4, 5]]], np.uint16)
    _build(b, [[[6]], [[7, 8, 9]]], np.uint16)
    out = str(tmp_path / "out" / "m")
    os.makedirs(os.path.dirname(out))
    merge_datasets([a, b], out)
    m = IndexedDataset(out)
    assert [x.tolist() for x in m[:]] == [[1, 2], [3], [4, 5], [6], [7, 8, 9]]
    assert m.document_indices.tolist() == [0, 1, 3, 4, 5]
    assert m.sequence_pointers.tolist() == [0, 4, 6, 10, 12]
    # the CLI merges every pair in a directory in sorted name order, like tools/merge_datasets.py
    assert merge_main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "out" / "cli")]) == 0
    assert open(str(tmp_path / "out" / "cli.bin"), "rb").read() == open(out + ".bin", "rb").read()
    assert open(str(tmp_path / "out" / "cli.idx"), "rb").read() == open(out + ".idx", "rb").read()
    _build(str(tmp_path / "c"), [[[1]]], np.int32)
    with pytest.raises(ValueError, match="dtype"):
        merge_datasets([a, str(tmp_path / "c")], str(tmp_path / "bad"))
    assert not dataset_exists(str(tmp_path / "bad")) and not any("bad" in f for f in os.listdir(tmp_path))


def _write_tntidx(prefix, items, doc_idx, dtype=np.int32):
    """Hand-built legacy TNTIDX pair (layout of Megatron <= 23.06 indexed_dataset.IndexedDatasetBuilder)."""
    data_offsets = np.concatenate([[0], np.cumsum([len(x) for x in items])]).astype("<i8")
    dim_offsets = np.arange(len(items) + 1, dtype="<i8")
    sizes = np.array([len(x) for x in items], dtype="<i8")
    with open(prefix + ".bin", "wb") as f:
        for x in items:
            f.write(np.asarray(x, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"TNTIDX\x00\x00")
        f.write(struct.pack("<QQQ", 1, DType.code_of(dtype), np.dtype(dtype).itemsize))
        f.write(struct.pack("<QQ", len(items), len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(dim_offsets.tobytes() + data_offsets.tobytes() + sizes.tobytes())
        f.write(np.asarray(doc_idx, dtype="<i8").tobytes())


@pytest.mark.parametrize("cached", [False, True])
def test_legacy_tntidx_reader(tmp_path, cached):
    prefix = str(tmp_path / "legacy")
    items = [[10, 11, 12], [13], [70000, 5]]
    _write_tntidx(prefix, items, [0, 2, 3])
    ds = LegacyIndexedDataset(prefix, cached=cached)
    assert len(ds) == 3 and ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(3)] == items
    assert ds.get(0, offset=1, length=2).tolist() == [11, 12]
    assert ds.sequence_lengths.tolist() == [3, 1, 2] and ds.doc_idx.tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="legacy TNTIDX"):
        IndexedDataset(prefix)
    assert isinstance(open_indexed_dataset(prefix), LegacyIndexedDataset)
    ds.close()


def test_builder_add_documents_bulk_equals_single(tmp_path):
    a, b = str(tmp_path / "single"), str(tmp_path / "bulk")
    docs = [[[1, 2, 3]], [], [[4], [5, 6]]]
    _build(a, docs, np.uint16)
    bb = IndexedDatasetBuilder(b + ".bin", np.uint16)
    bb.add_documents(np.array([1, 2, 3, 4, 5, 6]), np.array([3, 1, 2]), np.array([1, 0, 2]))
    bb.finalize(b + ".idx")
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read()
    assert indexed.IndexedDataset(b).document_indices.tolist() == [0, 1, 1, 3]
