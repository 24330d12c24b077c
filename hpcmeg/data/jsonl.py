"""JSONL input for preprocessing: file/glob expansion, streaming line batches, per-line validation.

Contract
- `expand_inputs(specs)`: each spec is a file or a glob; globs expand in sorted order; no match is an
  error naming the spec. Order between specs is kept.
- `iter_line_batches(paths, batch_bytes)`: yields `LineBatch`es of WHOLE lines (`.jsonl` or gzip
  `.jsonl.gz`, sniffed by the gzip magic), about `batch_bytes` each, never spanning two files, with
  the 1-based number of their first line. Memory: one batch plus one read block.
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
from dataclasses import dataclass
from typing import Iterator, Sequence

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
                raise FileNotFoundError(f"--input {spec}: the glob matches no file")
            out.extend(found)
        elif os.path.isfile(spec):
            out.append(spec)
        else:
            raise FileNotFoundError(f"--input {spec}: no such file")
    return out


def open_maybe_gzip(path: str):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def iter_line_batches(paths: Sequence[str], batch_bytes: int = 1 << 20) -> Iterator[LineBatch]:
    seq = 0
    for path in paths:
        line_no = 1
        pending: list[bytes] = []
        size = 0
        with open_maybe_gzip(path) as f:
            carry = b""
            while True:
                block = f.read(max(_READ_BLOCK, batch_bytes))
                if not block:
                    break
                block = carry + block
                cut = block.rfind(b"\n")
                if cut < 0:  # a line longer than the block: keep reading
                    carry = block
                    continue
                carry = block[cut + 1:]
                pending.append(block[:cut + 1])
                size += cut + 1
                if size >= batch_bytes:
                    data = b"".join(pending)
                    yield LineBatch(path, line_no, data, seq)
                    seq += 1
                    line_no += data.count(b"\n")
                    pending, size = [], 0
            if carry:
                pending.append(carry)
            if pending:
                yield LineBatch(path, line_no, b"".join(pending), seq)
                seq += 1


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
            present = ", ".join(list(obj)[:8])
            return None, f"missing key {key!r} (keys present: {present}); pick the key with --json-keys"
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
