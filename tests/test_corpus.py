"""Embedded stdlib corpus: deterministic, unique, non-empty, valid JSONL; gzip variant."""

import gzip
import json

from hpcmeg.data.corpus import main, write_stdlib_corpus


def test_corpus_is_deterministic_and_clean(tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    st = write_stdlib_corpus(a, key="content", include_tests=False, max_files=200)
    write_stdlib_corpus(b, key="content", include_tests=False, max_files=200)
    assert open(a, "rb").read() == open(b, "rb").read()
    rows = [json.loads(line) for line in open(a, encoding="utf-8")]
    assert len(rows) == st.files == 200
    paths = [r["path"] for r in rows]
    assert paths == sorted(paths) and all(p.endswith(".py") for p in paths)
    assert all(r["content"] for r in rows) and len({r["content"] for r in rows}) == len(rows)
    assert not any(p.startswith(("test/", "idlelib/idle_test/")) for p in paths)
    assert st.bytes == sum(len(r["content"].encode()) for r in rows)


def test_corpus_cli_gzip_and_key(tmp_path):
    out = str(tmp_path / "c.jsonl.gz")
    assert main(["-o", out, "--key", "text", "--no-tests", "--max-files", "5"]) == 0
    with gzip.open(out, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 5 and all("text" in r for r in rows)
    assert [p.name for p in tmp_path.iterdir()] == ["c.jsonl.gz"]  # no temp file left behind
