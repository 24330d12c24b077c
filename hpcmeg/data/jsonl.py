"""JSONL input for preprocessing: file/glob expansion, streaming line batches, per-line validation.

Contract
- `expand_inputs(specs)`: each spec is a file or a glob; globs expand in sorted order; no match, a
  missing file or a directory is a MissingPathError (exit 2) naming the spec. Order between specs is kept.
- `iter_line_batches(paths, batch_bytes)`: yields `LineBatch`es of WHOLE lines (`.jsonl` or gzip
  `.jsonl.gz`, sniffed by the gzip magic), never spanning two files, with the 1-based number of
  their first line. Each batch but a file's last is the fewest whole lines that reach `batch_bytes`
  (a line longer than that is a batch of its own). Memory: one batch plus one read block. A file that cannot
  be read to its end (truncated or corrupt gzip, an I/O error) raises InputReadError (a DataError,
  exit 1) naming the file and the line where reading stopped, never EOFError/zlib.error.
- `first_document_keys(path)`: the keys of the file's first non-blank line (None when that line is
  not a JSON object: the full pass reports it), for checking --json-keys before any work starts.
- `parse_document(line, keys)`: bytes of one line -> ({key: str | list[str]}, None) or (None, reason).
  Bad input is one of: invalid UTF-8, malformed JSON, not an object, missing key, value that is not a
  string (or list of strings, Megatron's pre-split sentences), empty document. Blank lines -> ({}, None)
  and are skipped silently (trailing newlines are common in hand-made JSONL).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterator, Sequence

from hpcmeg.data.faults import DataError, MissingPathError

_READ_BLOCK = 1 << 20


@dataclass
class LineBatch:
    path: str
    first_line: int  # 1-based line number of the first line in `data`
    data: bytes  # whole lines, '\n'-separated (the last one may lack its '\n' at end of file)
    seq: int = 0  # position in the stream, for re-ordering results from workers


def expand_inputs(specs: Sequence[str] | str) -> list[str]:
    if isinstance(specs, str):
        specs = [specs]
    out: list[str] = []
    for spec in specs:
        if any(c in spec for c in "*?["):
            found = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
            if not found:
                raise MissingPathError(f"--input {spec}: the glob matches no file; check the pattern "
                                       "(quote it so that the shell does not expand it)")
            out.extend(found)
        elif os.path.isfile(spec):
            out.append(spec)
        elif os.path.isdir(spec):
            raise MissingPathError(f"--input {spec}: is a directory; pass the files in it, e.g. "
                                   f"--input '{os.path.join(spec, '*.jsonl')}'")
        elif os.path.exists(spec):
            raise MissingPathError(f"--input {spec}: not a regular file (a pipe or device); write the data to a "
                                   "file first")
        else:
            raise MissingPathError(f"--input {spec}: no such file; check the path")
    return out


class InputReadError(DataError):
    """An input file could not be read to its end; str() is `path: what (line N); what to do`."""


def read_error(path: str, e: BaseException, line: int | None, exact: bool = False) -> InputReadError:
    """The one-line error for an exception raised while reading `path`. line: the first line not read
    completely (`exact`: it is that line; otherwise that line or a later one, reads are in blocks)."""
    at = "" if line is None else f", in line {line}" + ("" if exact else " or later")
    gzip_fix = f"copy or compress it again (`gzip -t {path}` checks a file)"
    if isinstance(e, EOFError):
        return InputReadError(f"{path}: truncated gzip file: the compressed data ends early{at}; {gzip_fix}")
    if isinstance(e, (gzip.BadGzipFile, zlib.error)):
        return InputReadError(f"{path}: corrupt gzip data{at} ({e}); {gzip_fix}")
    if isinstance(e, OSError):
        return InputReadError(f"{path}: cannot read{at}: {e.strerror or e}; check the file and its permissions")
    raise TypeError(f"not a read error: {e!r}")


_READ_ERRORS = (EOFError, OSError, zlib.error)  # gzip.BadGzipFile is an OSError


def open_maybe_gzip(path: str):
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")
    except _READ_ERRORS as e:
        raise read_error(path, e, None) from None


def first_document_keys(path: str, limit: int = 1 << 26) -> list[str] | None:
    """Keys of the first non-blank line of `path` if it is a JSON object, else None (see contract).
    Reads at most `limit` bytes of that line."""
    line_no = 0
    with open_maybe_gzip(path) as f:
        try:
            while True:
                line_no += 1
                line = f.readline(limit)
                if not line:
                    return None
                if line.strip():
                    break
        except _READ_ERRORS as e:
            raise read_error(path, e, line_no, exact=True) from None
    try:
        obj = json.loads(line)
    except ValueError:  # malformed JSON, invalid UTF-8, a line longer than `limit`
        return None
    return list(obj) if isinstance(obj, dict) else None


def iter_line_batches(paths: Sequence[str], batch_bytes: int = 1 << 20) -> Iterator[LineBatch]:
    seq = 0
    for path in paths:
        line_no = 1
        pending: list[bytes] = []  # whole lines read and not yet yielded, `size` bytes
        size = 0
        with open_maybe_gzip(path) as f:
            carry = b""  # the start of a line whose end is not read yet
            while True:
                try:
                    block = f.read(_READ_BLOCK)
                except _READ_ERRORS as e:  # the line where reading stopped: complete lines so far + 1
                    done = line_no + sum(p.count(b"\n") for p in pending) + carry.count(b"\n")
                    raise read_error(path, e, done) from None
                if not block:
                    break
                block = carry + block
                cut = block.rfind(b"\n")
                if cut < 0:  # a line longer than the block: keep reading
                    carry = block
                    continue
                carry = block[cut + 1:]
                # cut the block's whole lines into batches of at least batch_bytes, each ending at the
                # first line end that reaches it: batches smaller than a read block are what keeps
                # the workers evenly busy at the start and the end of a run
                start, end_of_lines = 0, cut + 1
                while size + end_of_lines - start >= batch_bytes:
                    end = block.index(b"\n", start + batch_bytes - size - 1) + 1
                    pending.append(block[start:end])
                    data = b"".join(pending)
                    yield LineBatch(path, line_no, data, seq)
                    seq += 1
                    line_no += data.count(b"\n")
                    pending, size, start = [], 0, end
                if start < end_of_lines:
                    pending.append(block[start:end_of_lines])
                    size += end_of_lines - start
            if carry:
                pending.append(carry)
            if pending:
                yield LineBatch(path, line_no, b"".join(pending), seq)
                seq += 1


def describe_keys(keys: Sequence[str], most: int = 8) -> str:
    """'keys present: a, b, c' (the first `most`) or 'no keys', for missing-key messages."""
    if not keys:
        return "no keys"
    more = f", ... ({len(keys)} keys)" if len(keys) > most else ""
    return "keys present: " + ", ".join(map(str, keys[:most])) + more


def parse_document(line: bytes, keys: Sequence[str]):
    """One JSONL line -> (doc, None) or (None, reason). doc maps key -> str or list[str]."""
    if not line.strip():
        return {}, None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start} of the line"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg} at column {e.colno}"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    doc = {}
    for key in keys:
        if key not in obj:
            return None, f"missing key {key!r} ({describe_keys(list(obj))})"
        val = obj[key]
        if isinstance(val, list) and all(isinstance(s, str) for s in val):
            parts = val
        elif isinstance(val, str):
            parts = [val]
        else:
            return None, f"key {key!r} holds {type(val).__name__}, expected a string"
        if not any(parts):
            return None, f"empty document in key {key!r}"
        for s in parts:
            if not s.isascii():
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError as e:  # a "\ud800"-style escape: not valid Unicode text
                    return None, f"invalid UTF-8: lone surrogate escape at character {e.start} of key {key!r}"
        doc[key] = val
    return doc, None
