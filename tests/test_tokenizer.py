"""Tokenizers: tiktoken fast path (fast split regex) == tiktoken with GPT-2's own regex == `tokenizers`
twin on real stdlib text and on edge cases; HF directory; training layout."""

import json
import os
import random

import pytest

from hpcmeg.data.corpus import write_stdlib_corpus
from hpcmeg.data.tokenizer import (GPT2_SPLIT_PATTERN, GPT2_SPLIT_PATTERN_FAST, HuggingFaceTokenizer, TiktokenBPE,
                                   TokenizersBPE, build_tokenizer, bytes_to_unicode, default_gpt2_files)
from hpcmeg.data.tokenizer_train import main as train_main


@pytest.fixture(scope="module")
def stdlib_texts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("c") / "stdlib.jsonl")
    write_stdlib_corpus(path, include_tests=False, max_files=80)
    return path, [json.loads(line)["content"] for line in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def fast():
    return TiktokenBPE()


@pytest.fixture(scope="module")
def plain():
    return TokenizersBPE()


def test_embedded_gpt2_files(fast):
    vocab, merges = default_gpt2_files()
    assert os.path.basename(vocab) == "encoder.json" and os.path.isfile(merges)
    assert fast.encode("Hello world") == [15496, 995]
    assert fast.vocab_size == 50257 and fast.eod == 50256


def test_tiktoken_equals_tokenizers_on_stdlib(stdlib_texts, fast, plain):
    _, texts = stdlib_texts
    extra = ["héllo wörld ÿ\x00\x7f", "日本語のテキスト", "tabs\t\tand\r\nCRLF  \n\n  ", "emoji 🙂 x" * 3,
             "literal <|endoftext|> inside text"]
    n = 0
    for t in texts + extra:
        a, b = fast.encode(t), plain.encode(t)
        assert a == b, t[:80]
        assert fast.encode_np(t).tolist() == a
        n += len(a)
    assert n > 200_000  # the comparison covered a real amount of code
    assert fast.decode(fast.encode(texts[0])) == texts[0]


def test_fast_split_pattern_equals_gpt2_pattern(stdlib_texts, fast, plain):
    """GPT2_SPLIT_PATTERN_FAST (the default) is GPT-2's regex with its lookahead-free alternatives grouped:
    same pieces, so same ids, as tiktoken with the plain pattern and as `tokenizers`, on code and on
    strings built to hit every alternative and the whitespace-run rules (run before a word / at the
    end / of one character, non-ASCII and non-space whitespace, contractions, specials)."""
    assert fast.split_pattern == GPT2_SPLIT_PATTERN_FAST != GPT2_SPLIT_PATTERN
    ref = TiktokenBPE(split_pattern=GPT2_SPLIT_PATTERN)
    edge = ["", " ", "  ", "\n", "x ", "x  ", " x", "  x", "\n    def f():\n        return 1\n", "a \n\tb", "a\t\n  b",
            "x\r\n\r\n  y", "  123  4.5", "  ...!?", "don't 's 've 're 'll 'm 'd 'S", " 's", "  'll", "\u00a0\u00a0x",
            "\u3000 \u3000y", "a\u2028\u2029b", "\x0b\x0c\x85z", "٣٤ ٥", "<|endoftext|>  x", "x  <|endoftext|>\n"]
    rng = random.Random(0)
    alphabet = [" ", " ", " ", "\n", "\t", "\r", "\u00a0", "\u3000", "a", "Z", "é", "日", "1", "٣", ".", "(", "'", "s",
                "ll", "_", "🙂", "\x00", "<|endoftext|>"]
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30))) for _ in range(3000)]
    _, texts = stdlib_texts
    for t in edge + fuzz + texts:
        a = fast.encode(t)
        assert a == ref.encode(t) == plain.encode(t), repr(t[:80])


def test_special_token_parsing():
    s = "a<|endoftext|>b"
    for backend in ("tiktoken", "tokenizers"):
        assert 50256 in build_tokenizer(backend=backend).encode(s)
        assert 50256 not in build_tokenizer(backend=backend, parse_special=False).encode(s)


def test_bad_tokenizer_arguments(tmp_path):
    vocab, _ = default_gpt2_files()
    with pytest.raises(ValueError, match="both"):
        build_tokenizer(vocab_file=vocab)
    with pytest.raises(FileNotFoundError):
        build_tokenizer(vocab_file=str(tmp_path / "nope.json"), merge_file=str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="not supported"):
        build_tokenizer("BertWordPieceCase")
    with pytest.raises(FileNotFoundError, match="local tokenizer directory"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))


def test_huggingface_tokenizer_directory(tmp_path, stdlib_texts, fast):
    import shutil

    vocab, merges = default_gpt2_files()
    d = tmp_path / "gpt2dir"
    d.mkdir()
    shutil.copy(vocab, d / "vocab.json")
    shutil.copy(merges, d / "merges.txt")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                          "eos_token": "<|endoftext|>"}))
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(d))
    assert isinstance(hf, HuggingFaceTokenizer) and hf.vocab_size == 50257 and hf.eod == 50256
    for t in stdlib_texts[1][:10]:
        assert hf.encode(t) == fast.encode(t)


def test_tokenizer_training_layout(tmp_path, stdlib_texts):
    path, texts = stdlib_texts
    out = tmp_path / "tok"
    assert train_main(["train", "--input", path, "--json-key", "content", "--vocab-size", "2000", "-o", str(out)]) == 0
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    merges = (out / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == 2000 and vocab["<|endoftext|>"] == 1999  # EOD last, GPT-2 style
    assert sorted(vocab.values()) == list(range(2000))
    assert [vocab[c] for c in bytes_to_unicode().values()] == list(range(256))  # GPT-2 byte order
    assert merges[0].startswith("#version") and len(merges) - 1 == 2000 - 257
    assert all(vocab["".join(m.split())] == 256 + i for i, m in enumerate(merges[1:]))
    # the layout lets the fast path load it, and it agrees with the plain twin on real code
    fast = build_tokenizer(vocab_file=str(out / "vocab.json"), merge_file=str(out / "merges.txt"))
    plain = build_tokenizer(vocab_file=str(out / "vocab.json"), merge_file=str(out / "merges.txt"),
                            backend="tokenizers")
    assert isinstance(fast, TiktokenBPE) and fast.vocab_size == 2000 and fast.eod == 1999
    for t in texts[:60]:
        assert fast.encode(t) == plain.encode(t)
    code = "def add(a, b):\n    return a + b\n"
    assert len(fast.encode(code)) < len(code.encode())  # it learned merges
    hf = HuggingFaceTokenizer(str(out))  # tokenizer_config.json makes the directory loadable too
    assert hf.encode(code) == fast.encode(code) and hf.eod == 1999


def test_tokenizer_train_sigterm_writes_nothing(tmp_path, stdlib_texts):
    """SIGTERM while the (Rust) trainer runs: its default action ends the process at once; the output
    directory is only created with the finished files, so nothing exists."""
    import signal
    import subprocess
    import sys
    import time

    path, _ = stdlib_texts
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    big = tmp_path / "big.jsonl"
    # 60 copies of the 1.6 MB corpus: ~9 s of training on 2 idle cores (6 copies took 1.5 s in all,
    # and a fixed 1.5 s sleep then raced the finish); the signal ends it long before that
    big.write_bytes(open(path, "rb").read() * 60)
    out = tmp_path / "tok"
    proc = subprocess.Popen([sys.executable, "-m", "hpcmeg.cli", "tokenizer", "train", "--input", str(big),
                             "--json-key", "content", "--vocab-size", "20000", "-o", str(out)],
                            env=dict(os.environ, PYTHONPATH=repo))

    def cpu_seconds() -> float:  # the process's user + system time so far (all its threads)
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    # past the imports (~0.2 s of CPU) and into the trainer, however loaded the machine is
    deadline = time.time() + 60
    while proc.poll() is None and cpu_seconds() < 2.0 and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl"]
