"""Read-only reader for Megatron's pre-Oct-2023 TNTIDX "lazy"/"cached" indexed format.

The format (docs/megatron-interop.md §1.2): magic b"TNTIDX\0\0", uint64 version 1, uint64 dtype
code and element size, uint64 item count and sizes count, uint64 document count, then int64
dim_offsets, data_offsets (in ELEMENTS), sizes and doc_idx. hpcmeg only reads it (to take old
Megatron datasets in); it always writes MMIDIDX (``hpcmeg.data.indexed``; the bytes: ``indexed_format``).
``open_indexed_dataset(prefix, mmap)`` opens either format by its magic bytes.
"""

from __future__ import annotations

import struct

import numpy as np

from hpcmeg.data.indexed import IndexedDataset
from hpcmeg.data.indexed_format import TNTIDX_MAGIC, DType, data_file_path, index_file_path


class LegacyIndexedDataset:
    """Read-only reader for the pre-Oct-2023 TNTIDX format (`--dataset-impl lazy|cached`).

    Items may be multi-dimensional (shape from `sizes[dim_offsets[i]:dim_offsets[i+1]]`); GPT data is
    1-D. `data_offsets` count ELEMENTS, not bytes. cached=True reads the whole .bin into RAM once
    (Megatron's IndexedCachedDataset); otherwise each item is a seek+read (IndexedDataset "lazy").
    """

    def __init__(self, prefix: str, cached: bool = False):
        self.prefix = prefix
        idx_path = index_file_path(prefix)
        with open(idx_path, "rb") as f:
            if f.read(8) != TNTIDX_MAGIC:
                raise ValueError(f"{idx_path}: not a TNTIDX (legacy lazy/cached) index")
            version, code, elem = struct.unpack("<QQQ", f.read(24))
            if version != 1:
                raise ValueError(f"{idx_path}: TNTIDX version {version}, only version 1 exists")
            self.dtype = np.dtype(DType.dtype_of(code))
            if elem != self.dtype.itemsize:
                raise ValueError(f"{idx_path}: element size {elem} does not match dtype {self.dtype}")
            n, s = struct.unpack("<QQ", f.read(16))
            (doc_count,) = struct.unpack("<Q", f.read(8))
            self.dim_offsets = np.fromfile(f, dtype="<i8", count=n + 1)
            self.data_offsets = np.fromfile(f, dtype="<i8", count=n + 1)
            self.sizes = np.fromfile(f, dtype="<i8", count=s)
            self.doc_idx = np.fromfile(f, dtype="<i8", count=doc_count)
        if self.doc_idx.size != doc_count or self.sizes.size != s:
            raise ValueError(f"{idx_path}: truncated TNTIDX index")
        self._n = int(n)
        self._cache = np.fromfile(data_file_path(prefix), dtype=self.dtype) if cached else None
        self._file = None if cached else open(data_file_path(prefix), "rb")

    # names matching IndexedDataset for 1-D token data
    @property
    def sequence_lengths(self) -> np.ndarray:
        return (self.data_offsets[1:] - self.data_offsets[:-1]).astype(np.int32)

    @property
    def document_indices(self) -> np.ndarray:
        return self.doc_idx

    def __len__(self) -> int:
        return self._n

    def _shape(self, idx: int) -> tuple:
        return tuple(int(x) for x in self.sizes[self.dim_offsets[idx]:self.dim_offsets[idx + 1]])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Flat elements [offset, offset+length) of item `idx`."""
        lo, hi = int(self.data_offsets[idx]), int(self.data_offsets[idx + 1])
        if length is None:
            length = hi - lo - offset
        if offset < 0 or length < 0 or lo + offset + length > hi:
            raise IndexError(f"item {idx} has {hi - lo} elements; asked for [{offset}, {offset + length})")
        if self._cache is not None:
            return self._cache[lo + offset: lo + offset + length]
        self._file.seek((lo + offset) * self.dtype.itemsize)
        return np.frombuffer(self._file.read(length * self.dtype.itemsize), dtype=self.dtype)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        idx = int(idx)
        if idx < 0:
            idx += self._n
        if not 0 <= idx < self._n:
            raise IndexError(f"item {idx} out of range for {self._n} items")
        return self.get(idx).reshape(self._shape(idx))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def open_indexed_dataset(prefix: str, mmap: bool = True):
    """Open either format by sniffing the magic bytes (Megatron's old `--data-impl infer`)."""
    with open(index_file_path(prefix), "rb") as f:
        magic = f.read(9)
    if magic[:8] == TNTIDX_MAGIC:
        return LegacyIndexedDataset(prefix, cached=not mmap)
    return IndexedDataset(prefix, mmap=mmap)
