"""Megatron's indexed dataset on disk: the MMIDIDX `.idx` + raw `.bin` pair, byte for byte.

Owns reading and writing datasets: the writer (`IndexedDatasetBuilder`), the reader
(`IndexedDataset`) and merge (`merge_datasets` and the `hpcmeg merge-datasets` command, what
Megatron's tools/merge_datasets.py does). The byte layout (file names, magic, dtype codes, the index
writer and header reader) is hpcmeg.data.indexed_format; its DType, dataset_exists and path helpers
are importable from here too. The pre-2023 TNTIDX reader (`LegacyIndexedDataset`, and
`open_indexed_dataset`, which picks a reader by the magic bytes) is `indexed_legacy.py`.

Contract
- A dataset is a path prefix P: tokens in `P.bin` (all sequences concatenated, no header), index in
  `P.idx` (layout: indexed_format).
- Token dtype: uint16 when the (unpadded) vocabulary is < 65,500, else int32 (`DType.optimal`).
- Writing is streaming: token bytes go straight to disk; RAM holds only the int32 lengths and the
  int64 document indices (4-8 bytes per sequence). Both files are written under temporary names and
  renamed by `finalize`, `.idx` last, so an interrupted run never leaves a pair that loads. The `.idx`
  goes through hpcmeg.fsutil (fsynced); the streamed `.bin` keeps its own temp name and is not fsynced
  (that would stall finalize on many-GB files), so a pair is atomic against a killed process, not
  against a host crash.
"""

from __future__ import annotations

import array
import glob
import os
import sys
from typing import Sequence

import numpy as np

from hpcmeg import fsutil
from hpcmeg.data.faults import (MissingPathError, OneLineArgumentParser, StopSignal, UsageError, check_output_dir,
                                check_stop, created_dirs, run_tool)
from hpcmeg.data.indexed_format import (HEADER_BYTES, DatasetFormatError, DType, data_file_path, dataset_exists,
                                        index_file_path, read_mmidx_header, write_mmidx_index)

_COPY_CHUNK = 64 << 20  # bytes per read when appending another .bin (bounded memory)


def _tmp_name(path: str) -> str:
    # the pid keeps concurrent writers of the same prefix (e.g. a rerun while a dead job's files
    # linger) from clobbering each other's partial files
    return f"{path}.tmp{os.getpid()}"


class IndexedDatasetBuilder:
    """Streaming writer. `add_item` = one sequence; `end_document` closes a document.

    Usage: b = IndexedDatasetBuilder("x.bin", np.uint16); b.add_document(ids, [len(ids)]); ...;
    b.finalize("x.idx"). Until finalize nothing exists under the final names.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        DType.code_of(self.dtype)  # validate early
        self._tmp_bin = _tmp_name(bin_path)
        self._bin = open(self._tmp_bin, "wb")
        self._lengths = array.array("i")  # int32 tokens per sequence
        self._doc_idx = array.array("q", [0])  # int64 cumulative sequence counts
        self._closed = False

    # -- adding data -------------------------------------------------------------------------------
    def _write_tokens(self, tokens) -> int:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            arr = arr.astype(self.dtype)
        arr = np.ascontiguousarray(arr.reshape(-1))
        self._bin.write(arr.tobytes(order="C"))
        return arr.size

    def add_item(self, tokens) -> None:
        """Append one sequence (no document boundary)."""
        self._lengths.append(self._write_tokens(tokens))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append a whole document: `tokens` holds its sequences back to back, `lengths` their sizes."""
        n = self._write_tokens(tokens)
        lengths = [int(x) for x in lengths]
        if sum(lengths) != n:
            raise ValueError(f"document lengths sum to {sum(lengths)} but {n} tokens were given")
        self._lengths.extend(lengths)
        self._doc_idx.append(len(self._lengths))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        """Bulk append: `tokens` = many documents back to back, `lengths` = int32 tokens per sequence,
        `sequences_per_document` = how many of those sequences each document has (0 allowed)."""
        lengths = np.asarray(lengths, dtype=np.int32)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64)
        n = self._write_tokens(tokens)
        if int(lengths.sum(dtype=np.int64)) != n or int(per_doc.sum()) != lengths.size:
            raise ValueError("add_documents: tokens, lengths and sequences_per_document disagree")
        base = len(self._lengths)
        self._lengths.frombytes(lengths.tobytes())
        self._doc_idx.frombytes((np.cumsum(per_doc) + base).astype(np.int64).tobytes())

    def add_index(self, prefix: str, stop: StopSignal | None = None) -> None:
        """Append every sequence and document of the finished dataset at `prefix` (dtypes must match);
        `stop` is polled between the 64 MB chunks of the .bin copy."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            other.close()
            raise DatasetFormatError(f"{prefix}: token dtype {other.dtype} differs from {self.dtype} (the first "
                                     "dataset's); merge only datasets made with the same tokenizer")
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.astype(np.int32).tolist())
        self._doc_idx.extend((other.document_indices[1:] + offset).tolist())
        other.close()
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(_COPY_CHUNK):
                check_stop(stop)
                self._bin.write(chunk)

    # -- finishing ---------------------------------------------------------------------------------
    def finalize(self, idx_path: str) -> None:
        """Close .bin, write .idx, then rename both into place (.idx last: it is the commit marker)."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32)
        doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
        # atomic_path renames the finished .idx into place when the block ends, after the .bin
        with fsutil.atomic_path(idx_path) as tmp_idx:
            with open(tmp_idx, "wb") as f:
                write_mmidx_index(f, self.dtype, lengths, doc_idx)
            # remove a stale .idx first so that a crash between the two renames cannot pair old index + new bin
            if os.path.exists(idx_path):
                os.remove(idx_path)
            os.replace(self._tmp_bin, self.bin_path)
        self._closed = True

    def abort(self) -> None:
        """Drop the partial output (called on errors)."""
        if not self._bin.closed:
            self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)
        self._closed = True

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)


class IndexedDataset:
    """Reader for `<prefix>.idx/.bin` (MMIDIDX). len() = number of sequences.

    mmap=True maps both files (pages shared between processes on a node); mmap=False loads the
    index into RAM and reads tokens with seek+read (for filesystems where mmap is slow or unsafe).
    """

    def __init__(self, prefix: str, mmap: bool = True):
        self.prefix = prefix
        self.mmap = mmap
        idx_path = index_file_path(prefix)
        header = read_mmidx_header(idx_path)
        self.dtype, seq_count, doc_count = header.dtype, header.sequence_count, header.document_count
        if mmap:
            self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
            buf = self._idx
        else:
            buf = np.fromfile(idx_path, dtype=np.uint8)
            self._idx = None
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=seq_count, offset=off)
        off += 4 * seq_count
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=seq_count, offset=off)
        off += 8 * seq_count
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=doc_count, offset=off)
        off += 8 * doc_count
        self.sequence_modes = (np.frombuffer(buf, dtype=np.int8, count=seq_count, offset=off)
                               if header.has_modes else None)
        if doc_count == 0 or self.document_indices[-1] != seq_count:
            raise DatasetFormatError(f"{idx_path}: last document index != sequence count {seq_count}; corrupt index")

        bin_path = data_file_path(prefix)
        if seq_count:
            need = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if os.path.getsize(bin_path) < need:
                raise DatasetFormatError(f"{bin_path}: shorter than its index says ({need} bytes); rerun preprocessing")
        if mmap:
            self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r") if os.path.getsize(bin_path) else np.zeros(0, np.uint8)
            self._file = None
        else:
            self._bin = None
            self._file = open(bin_path, "rb")

    # Megatron's legacy attribute names, so code written against MMapIndexedDataset reads naturally
    @property
    def sizes(self) -> np.ndarray:
        return self.sequence_lengths

    @property
    def doc_idx(self) -> np.ndarray:
        return self.document_indices

    def __len__(self) -> int:
        return self.sequence_lengths.shape[0]

    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `idx` (a view when mmapped)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"sequence {idx} has {size} tokens; asked for [{offset}, {offset + length})")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        if self._bin is not None:
            return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)
        self._file.seek(start)
        data = self._file.read(length * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("only contiguous slices are supported")
            if stop <= start:
                return []
            total = int(self.sequence_lengths[start:stop].sum(dtype=np.int64))
            flat = self._read_span(int(self.sequence_pointers[start]), total)
            return np.split(flat, np.cumsum(self.sequence_lengths[start:stop - 1], dtype=np.int64))
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        return self.get(idx)

    def _read_span(self, byte_start: int, count: int) -> np.ndarray:
        if self._bin is not None:
            return np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=byte_start)
        self._file.seek(byte_start)
        return np.frombuffer(self._file.read(count * self.dtype.itemsize), dtype=self.dtype)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._bin = self._idx = self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def merge_datasets(prefixes: Sequence[str], out_prefix: str, stop: StopSignal | None = None) -> None:
    """Concatenate datasets in the given order into `out_prefix` (documents and sequences kept).
    Raises MissingPathError for a missing pair, DatasetFormatError for an unreadable one or mixed
    dtypes; on any exception (also faults.Interrupted from `stop`) nothing is left under `out_prefix`."""
    if not prefixes:
        raise UsageError("merge_datasets: no input datasets")
    for p in prefixes:
        if not dataset_exists(p):
            which = " and ".join(f for f in (index_file_path(p), data_file_path(p)) if not os.path.isfile(f))
            raise MissingPathError(f"{p}: no such dataset (missing {which}); check the prefix")
    first = IndexedDataset(prefixes[0])
    dtype = first.dtype
    first.close()
    builder = IndexedDatasetBuilder(data_file_path(out_prefix), dtype)
    try:
        for p in prefixes:
            builder.add_index(p, stop)
        check_stop(stop)
        builder.finalize(index_file_path(out_prefix))
    except BaseException:
        builder.abort()
        raise


def find_prefixes(inputs: Sequence[str]) -> list[str]:
    """Expand directories (all `*.idx` with a `.bin`, sorted, like Megatron's merge tool), globs and
    plain prefixes, keeping the given order between arguments."""
    out: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(p[:-4] for p in glob.glob(os.path.join(item, "*.idx")))
            out.extend(p for p in found if os.path.isfile(data_file_path(p)))
        elif any(c in item for c in "*?["):
            found = sorted(p[:-4] for p in glob.glob(item if item.endswith(".idx") else item + ".idx"))
            out.extend(found)
        else:
            out.append(item[:-4] if item.endswith((".idx", ".bin")) else item)
    return out


def merge_main(argv: Sequence[str] | None = None) -> int:
    """`hpcmeg merge-datasets --input DIR|PREFIX|GLOB... --output-prefix OUT`."""
    ap = OneLineArgumentParser(prog="hpcmeg merge-datasets",
                               description="Merge Megatron .bin/.idx datasets (tools/merge_datasets.py).")
    ap.add_argument("--input", nargs="+", required=True,
                    help="a directory (every *.idx/.bin pair in it, sorted by name), prefixes, or globs")
    ap.add_argument("--output-prefix", required=True, help="output dataset prefix (writes .bin/.idx)")
    ap.add_argument("--multimodal", action="store_true", help="accepted for compatibility; not supported")
    args = ap.parse_args(argv)

    def body() -> int:
        if args.multimodal:
            raise UsageError("--multimodal: multimodal datasets are not supported by hpcmeg; merge them with "
                             "Megatron's tools/merge_datasets.py")
        out = os.path.abspath(args.output_prefix)
        prefixes = [p for p in find_prefixes(args.input) if os.path.abspath(p) != out]
        if not prefixes:
            raise MissingPathError(f"--input {' '.join(args.input)}: no .bin/.idx dataset found; give dataset "
                                   "prefixes, directories holding .idx/.bin pairs, or globs")
        for p in prefixes:
            if not dataset_exists(p):
                which = " and ".join(f for f in (index_file_path(p), data_file_path(p)) if not os.path.isfile(f))
                raise MissingPathError(f"--input {p}: no such dataset (missing {which}); check the prefix")
        new_dirs = check_output_dir(args.output_prefix, "--output-prefix")
        with StopSignal() as stop, created_dirs(new_dirs):
            merge_datasets(prefixes, args.output_prefix, stop=stop)
        print(f"merged {len(prefixes)} datasets into {args.output_prefix}", file=sys.stderr)
        return 0

    return run_tool("hpcmeg merge-datasets", body)
