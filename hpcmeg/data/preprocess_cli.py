"""The command line of `hpcmeg preprocess` (flags as in Megatron's tools/preprocess_data.py).

This file owns the argument parser, the deprecated-flag warnings, the mapping from flags to a
PreprocessConfig (including the default --workers: the cores this process may run on) and main():
run preprocess_files under a StopSignal, then print the warnings, the skipped-line summary and the
"wrote ..." lines, with faults.run_tool turning faults into one stderr line and an exit code.
The preprocessing itself (and its contract) is hpcmeg.data.preprocess; this module imports it,
never the other way round.
Entry points: `hpcmeg preprocess` (hpcmeg.cli PASSTHROUGH) and `python -m hpcmeg.data.preprocess_cli`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

if __name__ == "__main__":  # `python -m hpcmeg.data.preprocess_cli`: as `hpcmeg preprocess` (cli.no_blas_threads says why)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is imported below

from hpcmeg.data.faults import OneLineArgumentParser, StopSignal, positive_int, run_tool
from hpcmeg.data.preprocess import PreprocessConfig, preprocess_files


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(prog="hpcmeg preprocess",
                                 description="Tokenize JSONL into Megatron .bin/.idx (drop-in for tools/preprocess_data.py).")
    g = ap.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=["GPT2BPETokenizer", "HuggingFaceTokenizer"])
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (default: the embedded GPT-2 files)")
    g.add_argument("--vocab", dest="vocab_alias", default=None, help=argparse.SUPPRESS)  # deprecated alias
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a local tokenizer directory")
    g.add_argument("--tokenizer-backend", default="auto", choices=["auto", "tiktoken", "tokenizers"],
                   help="GPT2BPETokenizer engine (hpcmeg extension; identical ids)")
    g = ap.add_argument_group("input data")
    g.add_argument("--input", required=True, nargs="+", help="JSONL file(s) or glob(s); .jsonl.gz is read too")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one dataset each")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (NLTK Punkt, offline)")
    g.add_argument("--keep-newlines", action="store_true", help="keep the newlines after sentences when splitting")
    g.add_argument("--lang", default="english", help="Punkt language for --split-sentences")
    g.add_argument("--skip-bad-lines", action="store_true", help="drop bad lines (counted) instead of stopping")
    g = ap.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    g = ap.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="output path prefix, without _<key>_document")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap", "lazy", "cached"],
                   help="accepted for old scripts; hpcmeg always writes mmap (MMIDIDX)")
    g = ap.add_argument_group("runtime")
    g.add_argument("--workers", type=positive_int(), default=None,
                   help="tokenizing processes, at least 1 (default: available cores)")
    g.add_argument("--partitions", type=positive_int(), default=1,
                   help="reproduce Megatron's round-robin partition order")
    g.add_argument("--keep-sequential-samples", action="store_true", help="with --partitions: keep input order")
    g.add_argument("--log-interval", type=positive_int(0), default=1000,
                   help="documents between progress lines (0: none)")
    g.add_argument("--chunk-size", type=int, default=None, help=argparse.SUPPRESS)  # deprecated, ignored
    g.add_argument("--batch-bytes", type=positive_int(), default=PreprocessConfig.batch_bytes,
                   help="input bytes per work item")
    g.add_argument("--quiet", action="store_true")
    return ap


def deprecation_warnings(args: argparse.Namespace) -> list[str]:
    """Warnings for old flags; main() prints them after a successful run, so that a failing run's
    stderr stays its one error line."""
    out = []
    if args.vocab_alias is not None:
        out.append("--vocab is deprecated, use --vocab-file")
    if args.chunk_size is not None:
        out.append("--chunk-size is deprecated and ignored (work is batched by bytes)")
    if args.dataset_impl != "mmap":
        out.append(f"--dataset-impl {args.dataset_impl} is obsolete (removed from Megatron in 2023); writing "
                   "mmap (MMIDIDX), which every Megatron version reads")
    return [f"hpcmeg preprocess: warning: {w}" for w in out]


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    vocab = args.vocab_file
    if args.vocab_alias is not None:
        vocab = vocab or args.vocab_alias
    return PreprocessConfig(
        json_keys=tuple(args.json_keys), tokenizer_type=args.tokenizer_type, vocab_file=vocab,
        merge_file=args.merge_file, tokenizer_model=args.tokenizer_model, tokenizer_backend=args.tokenizer_backend,
        append_eod=args.append_eod, split_sentences=args.split_sentences, keep_newlines=args.keep_newlines,
        lang=args.lang, workers=_default_workers() if args.workers is None else args.workers,
        partitions=args.partitions, keep_sequential_samples=args.keep_sequential_samples,
        skip_bad_lines=args.skip_bad_lines, log_interval=args.log_interval, batch_bytes=args.batch_bytes,
        quiet=args.quiet)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)

    def body() -> int:
        # Slurm's preemption/timeout SIGTERM (and Ctrl-C) only set a flag that the batch loop polls;
        # the exception it turns into cleans up partial outputs and workers (faults.py says why)
        with StopSignal() as stop:
            st = preprocess_files(args.input, args.output_prefix, cfg, stop=stop)
        for w in deprecation_warnings(args):
            print(w, file=sys.stderr)
        if st.skipped:
            for m in st.bad_lines:
                print(f"  skipped {m}", file=sys.stderr)
            more = st.skipped - len(st.bad_lines)
            print(f"hpcmeg preprocess: skipped {st.skipped} bad line(s)" + (f" ({more} not shown)" if more else ""),
                  file=sys.stderr)
        for key, prefix in st.outputs.items():
            print(f"wrote {prefix}.bin/.idx ({key})", file=sys.stderr)
        return 0

    return run_tool("hpcmeg preprocess", body)


if __name__ == "__main__":
    sys.exit(main())
