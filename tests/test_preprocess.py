"""`hpcmeg preprocess` on real stdlib text: round trip, order, inputs, partitions, bad input, interruption."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcmeg.data.corpus import write_stdlib_corpus
from hpcmeg.data.indexed import IndexedDataset, dataset_exists
from hpcmeg.data.preprocess import BadInputError, preprocess_files
from hpcmeg.data.preprocess_cli import main
from hpcmeg.data.tokenizer import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl")
    write_stdlib_corpus(path, key="content", include_tests=False, max_files=60)
    return path


@pytest.fixture(scope="module")
def texts(corpus):
    return [json.loads(line)["content"] for line in open(corpus, encoding="utf-8")]


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer()


def _docs(prefix):
    ds = IndexedDataset(prefix)
    d = ds.document_indices
    return [np.concatenate([ds[i] for i in range(d[k], d[k + 1])]).tolist() for k in range(len(d) - 1)]


def test_round_trip_equals_tokenizer_plus_eod(tmp_path, corpus, texts, gpt2):
    out = str(tmp_path / "cp")
    rc = main(["--input", corpus, "--output-prefix", out, "--json-keys", "content", "--append-eod",
               "--workers", "2", "--batch-bytes", "65536", "--log-interval", "50"])
    assert rc == 0
    prefix = out + "_content_document"
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == len(texts)
    for i in (0, 1, len(texts) // 2, len(texts) - 1):  # ordered like the input, EOD last
        assert ds[i].tolist() == gpt2.encode(texts[i]) + [gpt2.eod]
    assert ds.num_tokens() == sum(len(gpt2.encode(t)) + 1 for t in texts)
    # in-process (workers=0) and multi-process runs write identical bytes
    preprocess_files(corpus, str(tmp_path / "inline"), json_keys=["content"], append_eod=True, workers=0,
                     quiet=True)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(str(tmp_path / "inline_content_document") + ext, "rb").read()


def test_gzip_and_glob_inputs_equal_single_file(tmp_path, corpus):
    lines = open(corpus, "rb").read().splitlines(keepends=True)
    half = len(lines) // 2
    (tmp_path / "shards").mkdir()
    with gzip.open(tmp_path / "shards" / "part_0.jsonl.gz", "wb") as f:
        f.writelines(lines[:half])
    (tmp_path / "shards" / "part_1.jsonl").write_bytes(b"".join(lines[half:]) + b"\n\n")  # blank lines ignored
    preprocess_files(str(tmp_path / "shards" / "part_*"), str(tmp_path / "g"), json_keys=["content"], workers=2,
                     quiet=True, batch_bytes=100_000)
    preprocess_files(corpus, str(tmp_path / "s"), json_keys=["content"], workers=1, quiet=True)
    for ext in (".bin", ".idx"):
        assert (open(str(tmp_path / "g_content_document") + ext, "rb").read()
                == open(str(tmp_path / "s_content_document") + ext, "rb").read())


def test_partitions_reproduce_megatron_round_robin_order(tmp_path, corpus, texts, gpt2):
    st = preprocess_files(corpus, str(tmp_path / "p"), json_keys=["content"], workers=2, partitions=3,
                          quiet=True, batch_bytes=50_000)
    docs = _docs(st.outputs["content"])
    order = [i for p in range(3) for i in range(p, len(texts), 3)]  # partition 0's lines, then 1's, ...
    assert [len(d) for d in docs] == [len(gpt2.encode(texts[i])) for i in order]
    assert sorted(os.listdir(tmp_path)) == ["p_content_document.bin", "p_content_document.idx"]
    st = preprocess_files(corpus, str(tmp_path / "q"), json_keys=["content"], workers=2, partitions=3,
                          keep_sequential_samples=True, quiet=True)
    assert [len(d) for d in _docs(st.outputs["content"])] == [len(gpt2.encode(t)) for t in texts]


def test_several_keys_and_deprecated_aliases(tmp_path, capsys):
    src = tmp_path / "two.jsonl"
    src.write_text("".join(json.dumps({"title": f"Title {i}", "text": f"Body number {i}.\n" * (i + 1)}) + "\n"
                           for i in range(30)))
    vocab, merges = build_tokenizer().vocab_file, build_tokenizer().merge_file
    rc = main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-keys", "title", "text",
               "--vocab", vocab, "--merge-file", merges, "--chunk-size", "25", "--dataset-impl", "lazy",
               "--workers", "1"])
    err = capsys.readouterr().err
    assert rc == 0 and "--vocab is deprecated" in err and "--chunk-size is deprecated" in err
    assert "--dataset-impl lazy is obsolete" in err
    assert len(IndexedDataset(str(tmp_path / "o_title_document"))) == 30
    assert len(IndexedDataset(str(tmp_path / "o_text_document"))) == 30


BAD_LINES = {
    "malformed JSON": b'{"content": "unterminated\n',
    "missing key": b'{"text": "wrong key"}\n',
    "invalid UTF-8": b'{"content": "caf\xe9"}\n',
    "empty document": b'{"content": ""}\n',
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_input_stops_or_skips(tmp_path, corpus, capsys, case):
    good = open(corpus, "rb").read().splitlines(keepends=True)[:40]
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"".join(good[:17]) + BAD_LINES[case] + b"".join(good[17:]))
    out = str(tmp_path / "o")
    args = ["--input", str(src), "--output-prefix", out, "--json-keys", "content", "--workers", "2",
            "--batch-bytes", "20000"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{src}:18: " in err and case.split()[0].lower() in err.lower() and "--skip-bad-lines" in err
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing half-written, not even temp files
    assert main(args + ["--skip-bad-lines"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 bad line" in err and f"{src}:18:" in err
    assert len(IndexedDataset(out + "_content_document")) == 40


def test_bad_input_raises_from_python(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(BadInputError, match=r"x.jsonl:2: expected a JSON object"):
        preprocess_files(str(src), str(tmp_path / "o"), workers=0, quiet=True)


def test_interrupted_run_leaves_no_valid_dataset(tmp_path):
    src = str(tmp_path / "big.jsonl")
    write_stdlib_corpus(src, key="content", include_tests=False)
    out = str(tmp_path / "killed")
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-m", "hpcmeg.data.preprocess_cli", "--input", src, "--output-prefix", out,
                             "--json-keys", "content", "--workers", "1", "--quiet"], env=env)
    deadline = time.time() + 60
    while not any(".tmp" in f for f in os.listdir(tmp_path)) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dataset_exists(out + "_content_document")
    assert not os.path.exists(out + "_content_document.idx") and not os.path.exists(out + "_content_document.bin")
    # SIGTERM (Slurm preemption) is turned into a clean exit that also removes the temp files
    for f in os.listdir(tmp_path):
        if ".tmp" in f:
            os.remove(tmp_path / f)
    proc = subprocess.Popen([sys.executable, "-m", "hpcmeg.data.preprocess_cli", "--input", src, "--output-prefix", out,
                             "--json-keys", "content", "--workers", "1", "--quiet"], env=env)
    while not any(".tmp" in f for f in os.listdir(tmp_path)) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143  # the handler only sets a flag; the batch loop stops and cleans up
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl"]


def test_split_sentences_keep_newlines(tmp_path, gpt2):
    from pydoc_data.topics import topics  # real English prose that ships with every CPython

    texts = [topics[k] for k in sorted(topics)[:12]]
    src = tmp_path / "prose.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cache = str(tmp_path / "nltk")
    st = preprocess_files(str(src), str(tmp_path / "s"), split_sentences=True, keep_newlines=True, append_eod=True,
                          workers=2, quiet=True, punkt_cache_dir=cache)
    assert st.outputs["text"].endswith("_text_sentence")
    ds = IndexedDataset(st.outputs["text"])
    assert len(ds) > 3 * len(texts)  # many sentences per document
    docs = _docs(st.outputs["text"])
    for t, d in zip(texts, docs):
        assert d[-1] == gpt2.eod
        assert gpt2.decode(d[:-1]) == t.strip()  # keep-newlines: sentences re-join into the text
    st = preprocess_files(str(src), str(tmp_path / "n"), split_sentences=True, workers=0, quiet=True,
                          punkt_cache_dir=cache)
    first = IndexedDataset(st.outputs["text"])
    assert "\n" not in gpt2.decode(first[0].tolist())[-1:]  # without it the trailing newlines are dropped
