"""What a tokenizing worker of `hpcmeg preprocess` runs: one batch of JSONL lines -> token arrays.

Owns the run's settings (`PreprocessConfig`: the workers receive them), the tokenizer and sentence
splitter they name, `encode_batch` (parse, validate, split sentences, tokenize; a bad line is
reported with its line number and contributes to no key) and `BatchEncoder`, the workers' task
function. The parent side (ordering, writing, progress, bad-line policy) is hpcmeg.data.preprocess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcmeg.data.jsonl import LineBatch, parse_document


@dataclass
class PreprocessConfig:
    """The settings of one run (the flags of `hpcmeg preprocess`); every worker holds a copy."""

    json_keys: tuple = ("text",)
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None  # GPT-2 vocab.json; None -> the embedded GPT-2 files
    merge_file: str | None = None
    tokenizer_model: str | None = None  # HuggingFaceTokenizer: local directory
    tokenizer_backend: str = "auto"  # GPT2BPETokenizer: auto | tiktoken | tokenizers
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    workers: int = 1  # tokenizing processes; 0 = tokenize in this process
    partitions: int = 1
    keep_sequential_samples: bool = False
    skip_bad_lines: bool = False
    log_interval: int = 1000  # documents between progress lines
    # input bytes per work item: small, so that the first result is back ~0.05 s after the workers
    # start and they finish together (with 1 MB the first result took ~0.15 s on a 2-core host, a
    # core waiting meanwhile); the per-batch costs (pickling, sockets) of 4x more batches did not
    # show in CPU time there
    batch_bytes: int = 256 << 10
    punkt_cache_dir: str | None = None
    quiet: bool = False


def make_tokenizer(cfg: PreprocessConfig):
    from hpcmeg.data.tokenizer import build_tokenizer

    return build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model,
                           backend=cfg.tokenizer_backend)


def make_splitter(cfg: PreprocessConfig):
    if not cfg.split_sentences:
        return None
    from hpcmeg.data.punkt import make_sentence_splitter

    return make_sentence_splitter(cfg.lang, cfg.keep_newlines, cfg.punkt_cache_dir)


def encode_batch(batch: LineBatch, cfg: PreprocessConfig, tokenizer, splitter, dtype) -> dict:
    """Returns {"seq", "docs", "nbytes", "errors": [(line, reason)], "keys": {key: (tokens,
    seq_lengths int32, seqs_per_doc int32)}}. A bad line contributes to no key."""
    from hpcmeg.data.punkt import split_sentences

    lines = batch.data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    parts = {k: ([], [], []) for k in cfg.json_keys}
    errors, docs = [], 0
    if cfg.append_eod and tokenizer.eod is None:
        raise ValueError("--append-eod: the tokenizer has no EOD/EOS token")
    eod = np.asarray([tokenizer.eod], dtype=dtype) if cfg.append_eod else None
    for i, line in enumerate(lines):
        doc, reason = parse_document(line, cfg.json_keys)
        if reason is not None:
            errors.append((batch.first_line + i, reason))
            continue
        if not doc:
            continue  # blank line
        encoded = {}
        for key in cfg.json_keys:
            val = doc[key]
            sentences = val if isinstance(val, list) else [val]
            if splitter is not None and not isinstance(val, list):
                sentences = split_sentences(splitter, val)
            ids = [tokenizer.encode_np(s) for s in sentences]
            ids = [a for a in ids if a.size]
            if not ids:
                reason = f"empty document in key {key!r} (no tokens)"
                break
            if eod is not None:
                ids.append(eod)
            lens = [a.size for a in ids]
            if eod is not None:
                lens[-2] += 1  # EOD belongs to the document's last sequence, as in Megatron
                lens.pop()
            encoded[key] = (ids, lens)
        if reason is not None:
            errors.append((batch.first_line + i, reason))
            continue
        docs += 1
        for key, (ids, lens) in encoded.items():
            toks, seq_lens, per_doc = parts[key]
            toks.extend(ids)
            seq_lens.extend(lens)
            per_doc.append(len(lens))
    keys = {}
    for key, (toks, seq_lens, per_doc) in parts.items():
        tokens = np.concatenate(toks).astype(dtype, copy=False) if toks else np.zeros(0, dtype)
        keys[key] = (tokens, np.asarray(seq_lens, np.int32), np.asarray(per_doc, np.int32))
    return {"seq": batch.seq, "path": batch.path, "docs": docs, "nbytes": len(batch.data),
            "errors": errors, "keys": keys}


class BatchEncoder:
    """encode_batch with its tokenizer, as the worker processes' task function. Forked workers inherit
    the parent's ready tokenizer; under the spawn start method only the config is pickled and each
    worker builds its own tokenizer on its first batch."""

    def __init__(self, cfg: PreprocessConfig, tokenizer, splitter, dtype):
        self.cfg, self.tokenizer, self.splitter, self.dtype = cfg, tokenizer, splitter, dtype

    def __getstate__(self):
        return {"cfg": self.cfg, "tokenizer": None, "splitter": None, "dtype": self.dtype}

    def __call__(self, batch: LineBatch) -> dict:
        if self.tokenizer is None:
            self.tokenizer = make_tokenizer(self.cfg)
            self.splitter = make_splitter(self.cfg)
        return encode_batch(batch, self.cfg, self.tokenizer, self.splitter, self.dtype)
