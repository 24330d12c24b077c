"""hpcmeg.data.jsonl.iter_line_batches: whole lines, the fewest that reach batch_bytes, right line numbers."""

import gzip
import random

import pytest

from hpcmeg.data import jsonl
from hpcmeg.data.jsonl import iter_line_batches


def _files(tmp_path):
    rng = random.Random(1)
    lines = [b"x" * rng.choice([0, 1, 5, 80, 3000, 70_000]) for _ in range(400)]
    plain = b"\n".join(lines) + b"\n"
    out = {"plain": plain, "no final newline": plain[:-1], "one long line": b"y" * 2_500_000 + b"\nz\n",
           "empty": b"", "blank lines": b"\n\n\n"}
    paths = {}
    for name, data in out.items():
        p = tmp_path / (name.replace(" ", "_") + ".jsonl")
        p.write_bytes(data)
        paths[name] = (str(p), data)
    gz = tmp_path / "plain.jsonl.gz"
    gz.write_bytes(gzip.compress(plain))
    paths["gzip"] = (str(gz), plain)
    return paths


@pytest.mark.parametrize("batch_bytes", [1, 7, 1000, 65_536, 1 << 20, 5 << 20])
def test_batches_are_the_fewest_whole_lines_reaching_batch_bytes(tmp_path, batch_bytes, monkeypatch):
    monkeypatch.setattr(jsonl, "_READ_BLOCK", 100_000)  # several read blocks per file, lines across them
    for name, (path, data) in _files(tmp_path).items():
        batches = list(iter_line_batches([path], batch_bytes))
        assert b"".join(b.data for b in batches) == data, name
        line = 1
        for i, b in enumerate(batches):
            assert b.path == path and b.first_line == line, (name, i)
            line += b.data.count(b"\n")
            if i < len(batches) - 1:  # all but the last: ends a line, reaches batch_bytes, fewest lines
                assert b.data.endswith(b"\n") and len(b.data) >= batch_bytes, (name, i)
                without_last = b.data[:b.data.rfind(b"\n", 0, len(b.data) - 1) + 1]
                assert len(without_last) < batch_bytes, (name, i)
        assert [b.seq for b in batches] == list(range(len(batches)))


def test_batches_never_span_files_and_seq_counts_on(tmp_path):
    files = _files(tmp_path)
    names = ["plain", "empty", "no final newline", "gzip"]
    batches = list(iter_line_batches([files[n][0] for n in names], 50_000))
    assert [b.seq for b in batches] == list(range(len(batches)))
    for n in names:
        path, data = files[n]
        mine = [b for b in batches if b.path == path]
        assert b"".join(b.data for b in mine) == data and (mine or not data), n
        assert not mine or mine[0].first_line == 1
