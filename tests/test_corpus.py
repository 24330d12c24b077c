"""Embedded stdlib corpus: deterministic, unique, non-empty, valid JSONL; gzip variant; SIGTERM."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

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


def test_corpus_sigterm_leaves_nothing(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "c.jsonl.gz"
    proc = subprocess.Popen([sys.executable, "-m", "hpcmeg.cli", "corpus", "-o", str(out)], stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=repo))
    deadline = time.time() + 60
    while not os.listdir(tmp_path) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)  # the temporary exists: writing has begun
    assert proc.poll() is None, "finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip().splitlines() == [
        "hpcmeg corpus: stopped by SIGTERM; partial outputs were removed, nothing was written; run the same "
        "command again to redo it"], err
    assert os.listdir(tmp_path) == []  # the temporary is gone too
