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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, Sequence

from hpcmeg.data.jsonl import expand_inputs, open_maybe_gzip
from hpcmeg.data.tokenizer import EOD_TOKEN, bytes_to_unicode
from hpcmeg.fsutil import write_text_atomic


def iter_texts(paths: Sequence[str], key: str, max_docs: int | None = None) -> Iterator[str]:
    n = 0
    for path in paths:
        with open_maybe_gzip(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[key]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{line_no}: cannot read key {key!r}: {e}") from None
                if isinstance(text, list):
                    text = "".join(text)
                if text:
                    yield text
                    n += 1
                    if max_docs is not None and n >= max_docs:
                        return


def train_bpe(inputs: Sequence[str] | str, output_dir: str, vocab_size: int = 32768, json_key: str = "text",
              min_frequency: int = 2, max_docs: int | None = None) -> dict[str, int]:
    """Train and save; returns the vocabulary (token -> id). vocab_size includes <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size}: need at least 256 bytes + <|endoftext|>")
    paths = expand_inputs(inputs)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # no special tokens while training: the trainer would give them id 0; EOD is appended last below
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(iter_texts(paths, json_key, max_docs), trainer=trainer)
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

    os.makedirs(output_dir, exist_ok=True)
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in kept),
        "tokenizer_config.json": json.dumps({"tokenizer_class": "GPT2Tokenizer", "bos_token": EOD_TOKEN,
                                             "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN,
                                             "model_max_length": 1024}, indent=2),
    }
    for name, text in files.items():
        write_text_atomic(os.path.join(output_dir, name), text, encoding="utf-8")
    return vocab


def main(argv: Sequence[str] | None = None) -> int:
    """`hpcmeg tokenizer train --input ... --output DIR` (the leading `train` word is optional here)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        argv = argv[1:]
    ap = argparse.ArgumentParser(prog="hpcmeg tokenizer train",
                                 description="Train a byte-level BPE on JSONL; save GPT-2 style vocab.json/merges.txt.")
    ap.add_argument("--input", nargs="+", required=True, help="JSONL file(s) or glob(s) (.jsonl.gz too)")
    ap.add_argument("--json-key", default="text", help="key holding the text (default: text)")
    ap.add_argument("--vocab-size", type=int, default=32768, help="including <|endoftext|> (CodeParrot: 32768)")
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--max-docs", type=int, default=None, help="train on the first N documents only")
    ap.add_argument("--output", "-o", required=True, help="output directory")
    args = ap.parse_args(argv)
    try:
        vocab = train_bpe(args.input, args.output, args.vocab_size, args.json_key, args.min_frequency, args.max_docs)
    except (FileNotFoundError, ValueError) as e:
        print(f"hpcmeg tokenizer train: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}/vocab.json and merges.txt: {len(vocab)} tokens, "
          f"{EOD_TOKEN} = {vocab[EOD_TOKEN]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
