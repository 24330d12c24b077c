"""The engine of `hpcmeg preprocess`: JSONL -> Megatron `.bin/.idx`, a drop-in for Megatron's
tools/preprocess_data.py.

This file owns preprocess_files (the library entry point) and the parent side of the pipeline:
PreprocessStats, ordering/partitioning, writing, progress lines and bad-line handling. What a
worker runs (PreprocessConfig, the tokenizer it names, encode_batch) is hpcmeg.data.preprocess_encode;
its names are importable from here too. The command line (flags, config from flags, deprecation
warnings, exit codes via faults.run_tool, and `python -m hpcmeg.data.preprocess_cli`) is
hpcmeg.data.preprocess_cli, which imports this file.

Pipeline (streaming, bounded memory): the parent reads ~256 KB batches of whole lines -> worker
processes parse, validate, (split sentences,) tokenize and return numpy token arrays -> the parent
writes them IN INPUT ORDER to one IndexedDatasetBuilder per JSON key. At most `2*workers+2` batches
are read and not yet written, so memory does not grow with the corpus (Megatron's Pool.imap queue
can: its issue #444).

Contract
- Output: `<prefix>_<key>_document.{bin,idx}` (`_sentence` with --split-sentences), MMIDIDX, uint16
  tokens when the unpadded vocabulary is < 65,500 else int32. One document per JSONL line (blank
  lines ignored); with --append-eod the tokenizer's EOD closes each document's last sequence.
- Same ids as Megatron for the same tokenizer files (bench/preprocess.py checks it).
- Bad lines (invalid UTF-8, malformed JSON, missing key, empty document, ...): by default the run
  stops with `file:line: reason` and exit code 1; --skip-bad-lines drops the whole line (all keys,
  so the per-key datasets stay aligned), counts it and reports at the end.
- Outputs are written under temporary names and renamed only when everything succeeded; a run that
  fails or is stopped leaves no dataset, no temporary and no worker process behind (a SIGKILLed one
  can leave a `.bin.tmp<pid>` temporary, never a loadable pair).
- Faults (hpcmeg.data.faults): one line on stderr naming the file (and line) and the fix; exit 2 for
  flags and paths (bad --workers/--json-keys/--tokenizer-type, missing inputs, an output prefix
  under a file), 1 for data and runtime faults (corrupt or truncated .gz, a bad line, garbage
  tokenizer files, an unwritable output directory, inputs without any document: a 0-document
  dataset is never written). SIGTERM/SIGINT: exit 143/130 after cleanup, polled once per batch.
- Workers: hpcmeg.data.workers.OrderedPool (own socket per worker, killed and joined with a timeout
  on any failure, dead with the parent).
- --partitions N>1 reproduces Megatron's document order (lines dealt round-robin to N partitions,
  partitions concatenated) without writing partition JSONL files; with --keep-sequential-samples
  (or N=1) the order is the input order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hpcmeg.data import indexed
from hpcmeg.data.faults import DataError, StopSignal, UsageError, check_output_dir, check_stop, created_dirs
from hpcmeg.data.jsonl import LineBatch, describe_keys, expand_inputs, first_document_keys, iter_line_batches
from hpcmeg.data.preprocess_encode import BatchEncoder, PreprocessConfig, encode_batch, make_splitter, make_tokenizer
from hpcmeg.data.workers import OrderedPool


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0  # summed over keys
    input_bytes: int = 0
    skipped: int = 0
    seconds: float = 0.0
    outputs: dict = dataclasses.field(default_factory=dict)  # key -> dataset prefix
    bad_lines: list = dataclasses.field(default_factory=list)  # first few "file:line: reason"


class BadInputError(DataError):
    """A bad JSONL line in default (stop) mode; str() is `file:line: reason; what to do` (one line)."""


def _describe_batch(batch: LineBatch) -> str:
    return f"{batch.path} from line {batch.first_line}"


def input_size_estimate(paths: Sequence[str]) -> int:
    """Bytes preprocessing will read (decompressed): plain files' sizes, and for gzip the ISIZE trailer
    (uncompressed size mod 2**32, lifted above the compressed size). A multi-member gzip reports only
    its last member, so percentages are capped below 100 until the end."""
    total = 0
    for p in paths:
        try:
            size = os.path.getsize(p)
            with open(p, "rb") as f:
                if f.read(2) != b"\x1f\x8b" or size < 18:
                    total += size
                    continue
                f.seek(-4, os.SEEK_END)
                isize = int.from_bytes(f.read(4), "little")
        except OSError:
            continue
        while isize < size:
            isize += 1 << 32
        total += isize
    return total


class _Progress:
    """Megatron's 'Processed N documents' line, plus percent done and ETA from the bytes read so far
    against ``total_bytes``; printed every ``log_interval`` documents and at least every
    ``_EVERY_S`` seconds (a Slurm console tails these lines)."""
    _EVERY_S = 5.0

    def __init__(self, cfg: PreprocessConfig, total_bytes: int = 0):
        self.cfg, self.t0, self.next_report = cfg, time.perf_counter(), cfg.log_interval
        self.total, self.last_print = total_bytes, self.t0

    def line(self, st: PreprocessStats, done: bool = False) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = (f"Processed {st.documents} documents ({st.documents / dt:.1f} docs/s, "
               f"{st.tokens / dt / 1e6:.2f} M tokens/s, {st.input_bytes / dt / 2**20:.1f} MB/s)")
        if self.total > 0 and not done:
            frac = min(st.input_bytes / self.total, 0.999)
            eta = dt * (1 - frac) / frac if frac > 0 else None
            out += f" | {100 * frac:.1f}% of {self.total / 2**20:,.1f} MB"
            out += f" | ETA {eta:.0f} s" if eta is not None else ""
        return out

    def update(self, st: PreprocessStats) -> None:
        if self.cfg.quiet or self.cfg.log_interval <= 0:
            return
        now = time.perf_counter()
        if st.documents < self.next_report and now - self.last_print < self._EVERY_S:
            return
        print(self.line(st), file=sys.stderr, flush=True)
        self.last_print = now
        self.next_report = (st.documents // self.cfg.log_interval + 1) * self.cfg.log_interval


def output_prefix_for(output_prefix: str, key: str, split_sentences: bool) -> str:
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def _route(tokens, seq_lens, per_doc, first_doc: int, nparts: int):
    """Split one batch's documents round-robin by global document ordinal -> [(tokens, lens, per_doc)]."""
    doc_tokens = np.zeros(per_doc.size, np.int64)
    nonempty = per_doc > 0
    if seq_lens.size:
        starts = np.concatenate([[0], np.cumsum(per_doc)[:-1]])[nonempty]
        doc_tokens[nonempty] = np.add.reduceat(seq_lens.astype(np.int64), starts)
    part = (first_doc + np.arange(per_doc.size)) % nparts
    out = []
    for p in range(nparts):
        m = part == p
        out.append((tokens[np.repeat(m, doc_tokens)], seq_lens[np.repeat(m, per_doc)], per_doc[m]))
    return out


def check_config(cfg: PreprocessConfig) -> None:
    """Refuse settings that cannot work (UsageError, exit 2), before anything is read or written."""
    if not cfg.json_keys or any(not k for k in cfg.json_keys):
        raise UsageError(f"--json-keys {' '.join(cfg.json_keys)!r}: give one or more non-empty keys")
    if len(set(cfg.json_keys)) != len(cfg.json_keys):
        raise UsageError(f"--json-keys {' '.join(cfg.json_keys)}: a key is repeated; give each key once")
    for flag, value, least in (("--workers", cfg.workers, 0), ("--partitions", cfg.partitions, 1),
                               ("--batch-bytes", cfg.batch_bytes, 1)):
        if not isinstance(value, int) or value < least:
            raise UsageError(f"{flag} {value}: must be an integer of at least {least}")


def _check_json_keys(paths: Sequence[str], keys: Sequence[str]) -> None:
    """A key missing from a file's first document is a wrong --json-keys, not a bad line: say so first."""
    for path in paths:
        present = first_document_keys(path)
        if present is None:
            continue  # empty file, or a first line that is not a JSON object: the full pass reports it
        missing = [k for k in keys if k not in present]
        if missing:
            raise UsageError(f"--json-keys {' '.join(keys)}: the first document of {path} has no key "
                             f"{missing[0]!r} ({describe_keys(present)}); pass the key(s) holding the text")


def _no_documents(paths: Sequence[str], st: PreprocessStats) -> DataError:
    where = paths[0] if len(paths) == 1 else f"the {len(paths)} input files ({paths[0]}, ...)"
    if st.skipped:
        return DataError(f"{where}: all {st.skipped} non-blank line(s) were bad and dropped by --skip-bad-lines "
                         f"(first: {st.bad_lines[0]}); nothing written, fix the input")
    return DataError(f"{where}: no documents (empty or only blank lines); nothing written, check --input")


def preprocess_files(inputs: Sequence[str] | str, output_prefix: str, config: PreprocessConfig | None = None,
                     *, stop: StopSignal | None = None, **overrides) -> PreprocessStats:
    """Tokenize JSONL file(s)/glob(s) into `<output_prefix>_<key>_<level>.{bin,idx}`; returns stats.

    Raises a faults.ToolError subclass for every fault of the inputs, flags or output location
    (BadInputError for a bad line in default mode, UsageError/MissingPathError for arguments,
    DataError for unreadable inputs or no documents); `stop` (a StopSignal) is polled once per batch.
    On any exception nothing is left under the output names, no temporary file and no worker process."""
    cfg = dataclasses.replace(config or PreprocessConfig(), **overrides)
    cfg.json_keys = tuple(cfg.json_keys)
    check_config(cfg)
    paths = expand_inputs(inputs)
    new_dirs = check_output_dir(output_prefix, "--output-prefix")
    if not cfg.skip_bad_lines:
        _check_json_keys(paths, cfg.json_keys)
    tokenizer = make_tokenizer(cfg)
    if cfg.append_eod and tokenizer.eod is None:
        raise UsageError(f"--append-eod: tokenizer {tokenizer.name} has no EOD/EOS token; drop --append-eod "
                         "or use a tokenizer with an end-of-text token")
    splitter = make_splitter(cfg)
    dtype = np.dtype(indexed.DType.optimal(tokenizer.vocab_size))
    check_stop(stop)
    nparts = cfg.partitions if (cfg.partitions > 1 and not cfg.keep_sequential_samples) else 1
    part_prefixes = [output_prefix if nparts == 1 else f"{output_prefix}_{p}" for p in range(nparts)]
    st = PreprocessStats()
    progress = _Progress(cfg, input_size_estimate(paths))
    builders: dict = {}
    finished_parts: list[str] = []  # per-partition datasets: only a means to Megatron's order
    committed: list[str] = []  # final datasets renamed into place so far
    batches = iter_line_batches(paths, cfg.batch_bytes)
    with created_dirs(new_dirs):
        try:
            for p, pp in enumerate(part_prefixes):
                for k in cfg.json_keys:
                    builders[p, k] = indexed.IndexedDatasetBuilder(
                        indexed.data_file_path(output_prefix_for(pp, k, cfg.split_sentences)), dtype)
            if cfg.workers <= 0:
                results = (encode_batch(b, cfg, tokenizer, splitter, dtype) for b in batches)
                _write_results(results, cfg, builders, nparts, st, progress, stop)
            else:
                with OrderedPool(BatchEncoder(cfg, tokenizer, splitter, dtype), cfg.workers, stop,
                                 name="tokenizing worker") as pool:
                    _write_results(pool.map(batches, _describe_batch), cfg, builders, nparts, st, progress, stop)
            if st.documents == 0:
                raise _no_documents(paths, st)
            check_stop(stop)  # last point at which a stop leaves nothing behind
            _finalize(builders, part_prefixes, output_prefix, cfg, stop, finished_parts, committed)
        except BaseException:
            for b in builders.values():
                b.abort()
            # a failure after some key's dataset was committed (several keys, or while merging
            # partitions) must not leave that one behind as if the run had produced it
            _remove_datasets(finished_parts + committed)
            raise
        _remove_datasets(finished_parts)
    st.seconds = time.perf_counter() - progress.t0
    st.outputs = {k: output_prefix_for(output_prefix, k, cfg.split_sentences) for k in cfg.json_keys}
    if not cfg.quiet:
        print(progress.line(st, done=True) + " done.", file=sys.stderr)
    return st


def _finalize(builders: dict, part_prefixes: list[str], output_prefix: str, cfg: PreprocessConfig,
              stop: StopSignal | None, finished_parts: list[str], committed: list[str]) -> None:
    """Rename every builder's dataset into place; with partitions, merge each key's partition datasets
    in Megatron's order. Each prefix is appended to `finished_parts` (a partition's, removed once merged)
    or `committed` (a final one, removed if a later step fails) as soon as it exists."""
    nparts = len(part_prefixes)
    for (p, key), builder in builders.items():
        prefix = output_prefix_for(part_prefixes[p], key, cfg.split_sentences)
        builder.finalize(indexed.index_file_path(prefix))  # a failing finalize leaves nothing itself
        (finished_parts if nparts > 1 else committed).append(prefix)
    if nparts > 1:
        for key in cfg.json_keys:
            parts = [output_prefix_for(pp, key, cfg.split_sentences) for pp in part_prefixes]
            merged = output_prefix_for(output_prefix, key, cfg.split_sentences)
            indexed.merge_datasets(parts, merged, stop=stop)
            committed.append(merged)


def _remove_datasets(prefixes: Sequence[str]) -> None:
    for prefix in prefixes:
        for path in (indexed.index_file_path(prefix), indexed.data_file_path(prefix)):  # .idx first: it commits
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def _write_results(results, cfg: PreprocessConfig, builders: dict, nparts: int, st: PreprocessStats,
                   progress: _Progress, stop: StopSignal | None) -> None:
    """Append each batch's documents to the builders in input order; bad lines stop or are counted."""
    for res in results:
        check_stop(stop)
        for line_no, reason in res["errors"]:
            msg = f"{res['path']}:{line_no}: {reason}"
            if not cfg.skip_bad_lines:
                raise BadInputError(f"{msg}; fix or remove that line, or pass --skip-bad-lines to drop bad "
                                    "lines and count them")
            st.skipped += 1
            if len(st.bad_lines) < 20:
                st.bad_lines.append(msg)
        for key, (tokens, seq_lens, per_doc) in res["keys"].items():
            if nparts == 1:
                builders[0, key].add_documents(tokens, seq_lens, per_doc)
            else:
                for p, chunk in enumerate(_route(tokens, seq_lens, per_doc, st.documents, nparts)):
                    builders[p, key].add_documents(*chunk)
            st.tokens += int(tokens.size)
        st.documents += res["docs"]
        st.input_bytes += res["nbytes"]
        progress.update(st)
