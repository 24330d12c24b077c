"""`hpcmeg tokenizer train`: a byte-level BPE trained on JSONL, saved in GPT-2's file layout.

CodeParrot trained its own 32,768-token code tokenizer this way; the result is used with
`--tokenizer-type GPT2BPETokenizer --vocab-file DIR/vocab.json --merge-file DIR/merges.txt`.

Contract (output directory)
- `vocab.json`: token -> id, GPT-2 layout: ids 0..255 are the 256 single bytes in GPT-2's order (the
  printable bytes first, as OpenAI's encoder.json), then one id per merge in merge order, and
  `<|endoftext|>` is the LAST id (vocab_size - 1), as in GPT-2 (50256 of 50257). This layout makes the
  ids equal the merge ranks, which the fast tiktoken path requires.
- `merges.txt`: `#version: 0.2` then one "left right" merge per line, in training order.
- `tokenizer_config.json`: lets `AutoTokenizer.from_pretrained(DIR)` (HuggingFaceTokenizer) load it.
- Training streams the text (the JSONL files are read line by line, not loaded whole).
- Faults are one line (hpcmeg.data.faults): a bad JSONL line names file:line (the same checks as
  preprocess), an unreadable .gz names the file, no documents at all is refused; exit 1, nothing
  written. The three files appear together at the end (each written to a temporary name; the renames
  run back to back, with SIGTERM/SIGINT held for those few microseconds); the output directory is
  created only then. A SIGTERM while training kills the process at once (its default action): the
  trainer runs in Rust for minutes without returning to Python, so a flag would not be seen, and
  nothing exists on disk yet that would need cleaning up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import Iterator, Sequence

from hpcmeg.data.faults import (STOP_SIGNALS, DataError, OneLineArgumentParser, UsageError, check_output_dir,
                                positive_int, run_tool, signals_blocked)
from hpcmeg.data.jsonl import _READ_ERRORS, describe_keys, expand_inputs, first_document_keys, open_maybe_gzip
from hpcmeg.data.jsonl import parse_document, read_error
from hpcmeg.data.tokenizer import EOD_TOKEN, bytes_to_unicode
from hpcmeg.fsutil import atomic_path


def iter_texts(paths: Sequence[str], key: str, max_docs: int | None = None) -> Iterator[str]:
    """The texts under `key`, file by file (pre-split sentence lists joined); a bad line is a DataError."""
    n = 0
    for path in paths:
        with open_maybe_gzip(path) as f:
            line_no = 0
            while True:
                try:
                    line = f.readline()
                except _READ_ERRORS as e:
                    raise read_error(path, e, line_no + 1, exact=True) from None
                if not line:
                    break
                line_no += 1
                doc, reason = parse_document(line[:-1] if line.endswith(b"\n") else line, (key,))
                if reason is not None:
                    raise DataError(f"{path}:{line_no}: {reason}; fix or remove that line")
                if not doc:
                    continue  # blank line
                text = doc[key]
                yield "".join(text) if isinstance(text, list) else text
                n += 1
                if max_docs is not None and n >= max_docs:
                    return


def train_bpe(inputs: Sequence[str] | str, output_dir: str, vocab_size: int = 32768, json_key: str = "text",
              min_frequency: int = 2, max_docs: int | None = None) -> dict[str, int]:
    """Train and save; returns the vocabulary (token -> id). vocab_size includes <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise UsageError(f"--vocab-size {vocab_size}: need at least 257 (256 bytes + {EOD_TOKEN})")
    paths = expand_inputs(inputs)
    new_dirs = check_output_dir(output_dir, "--output", is_dir=True)
    for path in paths:  # a wrong --json-key shows in the first document: say so before reading everything
        present = first_document_keys(path)
        if present is not None and json_key not in present:
            raise UsageError(f"--json-key {json_key}: the first document of {path} has no key {json_key!r} "
                             f"({describe_keys(present)}); pass the key holding the text")
    counted = _Counter(iter_texts(paths, json_key, max_docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # no special tokens while training: the trainer would give them id 0; EOD is appended last below
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    try:
        tok.train_from_iterator(counted, trainer=trainer)
    except Exception:  # the Rust trainer re-raises the iterator's exception wrapped or as is
        if counted.error is not None:
            raise counted.error from None
        raise
    if counted.error is not None:
        raise counted.error
    if counted.n == 0:
        where = paths[0] if len(paths) == 1 else f"the {len(paths)} input files ({paths[0]}, ...)"
        raise DataError(f"{where}: no documents (empty or only blank lines); nothing written, check --input")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]

    vocab: dict[str, int] = {}
    for ch in bytes_to_unicode().values():  # GPT-2's byte order: printable bytes first
        vocab[ch] = len(vocab)
    kept = []
    for left, right in merges:
        token = left + right
        if token in vocab:  # a second route to an existing token adds no id; keep the merge for BPE order
            kept.append((left, right))
            continue
        vocab[token] = len(vocab)
        kept.append((left, right))
    vocab[EOD_TOKEN] = len(vocab)

    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in kept),
        "tokenizer_config.json": json.dumps({"tokenizer_class": "GPT2Tokenizer", "bos_token": EOD_TOKEN,
                                             "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN,
                                             "model_max_length": 1024}, indent=2),
    }
    _write_together(output_dir, new_dirs, files)
    return vocab


class _Counter:
    """Wraps the text iterator for the Rust trainer: counts documents and keeps the exception a bad
    line raised (so it is re-raised as itself, whatever the trainer makes of it)."""

    def __init__(self, it: Iterator[str]):
        self.it, self.n, self.error = it, 0, None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            text = next(self.it)
        except StopIteration:
            raise
        except BaseException as e:
            self.error = e
            raise
        self.n += 1
        return text


def _write_together(output_dir: str, new_dirs: Sequence[str], files: dict[str, str]) -> None:
    """Write every file under a temporary name, then rename them all (module docstring)."""
    made = []
    try:
        for d in new_dirs:
            os.mkdir(d)
            made.append(d)
        # entered first, so it is left last: a stop signal waits until all three renames are done
        with signals_blocked(), contextlib.ExitStack() as stack:
            for name, text in files.items():
                tmp = stack.enter_context(atomic_path(os.path.join(output_dir, name)))
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
    except BaseException:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise


@contextlib.contextmanager
def _default_stop_signals():
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    """`hpcmeg tokenizer train --input ... --output DIR` (the leading `train` word is optional here)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        argv = argv[1:]
    ap = OneLineArgumentParser(prog="hpcmeg tokenizer train",
                               description="Train a byte-level BPE on JSONL; save GPT-2 style vocab.json/merges.txt.")
    ap.add_argument("--input", nargs="+", required=True, help="JSONL file(s) or glob(s) (.jsonl.gz too)")
    ap.add_argument("--json-key", default="text", help="key holding the text (default: text)")
    ap.add_argument("--vocab-size", type=positive_int(257), default=32768,
                    help="including <|endoftext|>, at least 257 (CodeParrot: 32768)")
    ap.add_argument("--min-frequency", type=positive_int(0), default=2)
    ap.add_argument("--max-docs", type=positive_int(1), default=None, help="train on the first N documents only")
    ap.add_argument("--output", "-o", required=True, help="output directory")
    args = ap.parse_args(argv)

    def body() -> int:
        # SIGTERM and SIGINT keep (get) their default action: see the module docstring
        with _default_stop_signals():
            vocab = train_bpe(args.input, args.output, args.vocab_size, args.json_key, args.min_frequency,
                              args.max_docs)
        print(f"wrote {args.output}/vocab.json and merges.txt: {len(vocab)} tokens, "
              f"{EOD_TOKEN} = {vocab[EOD_TOKEN]}", file=sys.stderr)
        return 0

    return run_tool("hpcmeg tokenizer train", body)


if __name__ == "__main__":
    sys.exit(main())
