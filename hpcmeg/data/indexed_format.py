"""The bytes of Megatron's indexed dataset files: names, magic, dtype codes, the MMIDIDX index.

Owns the format rules (docs/megatron-interop.md §1) that the MMIDIDX reader and writer
(hpcmeg.data.indexed) and the pre-2023 TNTIDX reader (hpcmeg.data.indexed_legacy) share, and
nothing that opens a dataset: the `.bin`/`.idx` names of a prefix, the magic bytes, the token dtype
code table (byte 17 of `.idx`), `write_mmidx_index` and `read_mmidx_header`.

MMIDIDX `.idx` = 34-byte header (magic b"MMIDIDX\\0\\0", uint64 version 1, uint8 dtype code, uint64
sequence count S, uint64 document-index length D) then int32[S] lengths (tokens), int64[S] pointers
(BYTE offsets into .bin), int64[D] document indices (0, ..., S); little-endian, no padding; an
optional int8[S] of sequence modes after them (Megatron's multimodal datasets).
"""

from __future__ import annotations

import enum
import os
import struct
from typing import NamedTuple

import numpy as np

from hpcmeg.data.faults import DataError

MMIDIDX_MAGIC = b"MMIDIDX\x00\x00"
TNTIDX_MAGIC = b"TNTIDX\x00\x00"
HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype code + 8 sequence count + 8 document count
_POINTER_CHUNK = 1 << 20  # sequences per slab when writing pointers


class DatasetFormatError(DataError):
    """A .idx/.bin pair that is not a readable MMIDIDX dataset; str() names the file and the fix."""


class DType(enum.IntEnum):
    """Token dtype codes stored in byte 17 of `.idx` (same table for MMIDIDX and TNTIDX)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_of(cls, dtype) -> int:
        """numpy dtype (or type) -> code; raises ValueError for dtypes Megatron cannot store."""
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} has no Megatron code; use one of {list(cls.__members__)}")
        return int(cls[name])

    @classmethod
    def dtype_of(cls, code: int) -> type:
        """code -> numpy scalar type (np.uint16, np.int32, ...)."""
        try:
            return getattr(np, cls(int(code)).name)
        except ValueError:
            raise ValueError(f"unknown token dtype code {code}; valid codes are 1..8") from None

    @staticmethod
    def optimal(vocab_size: int | None) -> type:
        """Smallest dtype Megatron would pick: uint16 below 65,500 ids, else int32 (also when unknown)."""
        if vocab_size is not None and vocab_size < 65500:
            return np.uint16
        return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def write_mmidx_index(out, dtype, lengths: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write a complete MMIDIDX index to the binary file object `out`."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    if doc_idx.size == 0 or doc_idx[0] != 0 or doc_idx[-1] != lengths.size:
        raise ValueError("document indices must start at 0 and end at the sequence count")
    out.write(MMIDIDX_MAGIC)
    out.write(struct.pack("<Q", 1))
    out.write(struct.pack("<B", DType.code_of(dtype)))
    out.write(struct.pack("<Q", lengths.size))
    out.write(struct.pack("<Q", doc_idx.size))
    out.write(lengths.astype("<i4").tobytes())
    # pointers = exclusive cumulative sum of byte lengths, in int64, written in slabs to bound memory
    start = 0
    for lo in range(0, lengths.size, _POINTER_CHUNK):
        nbytes = lengths[lo:lo + _POINTER_CHUNK].astype(np.int64) * dtype.itemsize
        ends = np.cumsum(nbytes) + start
        out.write((ends - nbytes).astype("<i8").tobytes())
        start = int(ends[-1])
    out.write(doc_idx.astype("<i8").tobytes())


class MMIDIDXHeader(NamedTuple):
    dtype: np.dtype
    sequence_count: int
    document_count: int
    has_modes: bool
    """The index carries the int8 sequence modes after the document indices."""


def read_mmidx_header(idx_path: str) -> MMIDIDXHeader:
    """The header of an MMIDIDX `.idx`, checked against the file's size; DatasetFormatError (naming
    the file and the fix) for a TNTIDX index, a bad magic or version, an unknown dtype code or a size
    the header does not promise."""
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if header[:8] == TNTIDX_MAGIC:
        raise DatasetFormatError(f"{idx_path}: legacy TNTIDX (lazy/cached) index; open it with "
                                 "LegacyIndexedDataset")
    if len(header) < HEADER_BYTES or header[:9] != MMIDIDX_MAGIC:
        raise DatasetFormatError(f"{idx_path}: not a Megatron MMIDIDX index (bad magic); rerun preprocessing")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != 1:
        raise DatasetFormatError(f"{idx_path}: index version {version}, only version 1 exists")
    try:
        dtype = np.dtype(DType.dtype_of(header[17]))
    except ValueError as e:
        raise DatasetFormatError(f"{idx_path}: {e}; the index is corrupt, rerun preprocessing") from None
    seq_count, doc_count = struct.unpack("<QQ", header[18:34])
    expected = HEADER_BYTES + 4 * seq_count + 8 * seq_count + 8 * doc_count
    size = os.path.getsize(idx_path)
    if size not in (expected, expected + seq_count):  # + int8 modes for multimodal datasets
        raise DatasetFormatError(f"{idx_path}: {size} bytes but the header promises {expected}; the file is "
                                 "truncated or corrupt")
    return MMIDIDXHeader(dtype, seq_count, doc_count, size > expected)
