"""Embedded corpus: the running interpreter's standard-library sources as JSONL.

A real, CodeParrot-like code corpus that exists on every machine without a download (about
1,700 unique files / 31 MB / 15 M GPT-2 tokens for CPython 3.11 with its test suites, 12 MB without).

Contract
- One line per unique, non-empty, valid-UTF-8 `.py` file: {"<key>": source, "path": relative path}.
- Deterministic: files sorted by relative path, duplicates (same bytes) keep the first path only,
  so the same interpreter always yields the same bytes. `.gz` output is written with mtime 0 and
  no file name in its header.
- Written under a temporary name and renamed at the end; a SIGTERM/SIGINT (polled once per source
  file, hpcmeg.data.faults.StopSignal) or any error removes the temporary and writes nothing; bad
  flags and unwritable outputs are one line on stderr (exit 2 / 1).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Iterator, Sequence

from hpcmeg.data.faults import (DataError, OneLineArgumentParser, StopSignal, ToolError, UsageError,
                                check_output_dir, check_stop, created_dirs, positive_int, run_tool)
from hpcmeg.fsutil import atomic_path

# directories that hold the test suites (CPython's own plus the per-package ones)
_TEST_DIRS = {"test", "tests", "idle_test", "unittest/test", "lib2to3/tests"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class CorpusStats:
    files: int
    bytes: int  # UTF-8 bytes of source text (before JSON escaping)
    path: str


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def iter_stdlib_sources(include_tests: bool = True, root: str | None = None) -> Iterator[tuple[str, str]]:
    """(relative path, source text) for each unique non-empty UTF-8 .py file, sorted by path."""
    root = root or stdlib_dir()
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        keep = []
        for d in dirnames:
            rel = os.path.normpath(os.path.join(rel_dir, d)).replace(os.sep, "/")
            if d in _SKIP_DIRS or (not include_tests and (d in _TEST_DIRS or rel in _TEST_DIRS)):
                continue
            keep.append(d)
        dirnames[:] = keep  # prune the walk
        rels.extend(os.path.normpath(os.path.join(rel_dir, f)).replace(os.sep, "/")
                    for f in filenames if f.endswith(".py"))
    seen: set[bytes] = set()
    for rel in sorted(rels):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # CPython's test suite deliberately carries some non-UTF-8 files
        if not text:
            continue
        digest = hashlib.sha1(data).digest()
        if digest in seen:
            continue
        seen.add(digest)
        yield rel, text


def write_stdlib_corpus(out_path: str, key: str = "content", include_tests: bool = True,
                        max_files: int | None = None, root: str | None = None,
                        stop: StopSignal | None = None) -> CorpusStats:
    """Write the stdlib corpus to `out_path` (.jsonl, or .jsonl.gz when it ends in .gz)."""
    if not key:
        raise UsageError("--key: give a non-empty JSON key")
    if max_files is not None and max_files < 1:
        raise UsageError(f"--max-files {max_files}: must be at least 1")
    if os.path.isdir(out_path) or out_path.endswith(("/", os.sep)):
        raise ToolError(f"--output {out_path}: is a directory; give a file name such as "
                         f"{os.path.join(out_path, 'stdlib.jsonl')}")
    files = nbytes = 0
    with created_dirs(check_output_dir(out_path, "--output")):
        with atomic_path(out_path) as tmp, open(tmp, "wb") as raw:
            # filename="": gzip would otherwise record the temp file's (pid-carrying) name in its header
            out = gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) if out_path.endswith(".gz") else raw
            for rel, text in iter_stdlib_sources(include_tests, root):
                check_stop(stop)
                if max_files is not None and files >= max_files:
                    break
                out.write(json.dumps({key: text, "path": rel}, ensure_ascii=False).encode("utf-8") + b"\n")
                files += 1
                nbytes += len(text.encode("utf-8"))
            if out is not raw:
                out.close()
            if files == 0:
                raise DataError(f"{root or stdlib_dir()}: no readable .py files; nothing written")
    return CorpusStats(files=files, bytes=nbytes, path=out_path)


def main(argv: Sequence[str] | None = None) -> int:
    """`hpcmeg corpus --output stdlib.jsonl [--key content] [--no-tests] [--max-files N]`."""
    ap = OneLineArgumentParser(prog="hpcmeg corpus",
                               description="Write this Python's standard library sources as JSONL (a small real code corpus).")
    ap.add_argument("--output", "-o", required=True, help="output .jsonl or .jsonl.gz path")
    ap.add_argument("--key", default="content", help="JSON key holding the source text (default: content)")
    ap.add_argument("--no-tests", action="store_true", help="leave out the test suites (about 12 MB instead of 31 MB)")
    ap.add_argument("--max-files", type=positive_int(1), default=None,
                    help="stop after this many files (small test corpora)")
    args = ap.parse_args(argv)

    def body() -> int:
        with StopSignal() as stop:
            stats = write_stdlib_corpus(args.output, key=args.key, include_tests=not args.no_tests,
                                        max_files=args.max_files, stop=stop)
        print(f"wrote {stats.files} files, {stats.bytes / 1e6:.1f} MB of source to {stats.path}", file=sys.stderr)
        return 0

    return run_tool("hpcmeg corpus", body)


if __name__ == "__main__":
    sys.exit(main())
