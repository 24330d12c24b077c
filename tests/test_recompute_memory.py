"""bench/recompute_memory.py on the CPU: each setting trains through the product's own rank builders
and gets its row, the tables are written (the GPU run is the one that measures memory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rows_for_every_setting(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "recompute_memory.py"), "--device", "cpu",
                        "--sizes", "2x64x4", "--seq", "32", "--mb", "2", "--accum", "1", "--steps", "1", "--warm", "0",
                        "--extra", "full:block:1", "--out", str(tmp_path), "--tag", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "recompute_memory_cpu.json").read_text())
    assert [row["setting"] for row in rows] == ["none", "selective", "full", "full:block:1"]
    assert all(row["tokens_per_s"] > 0 and 10 < row["loss"] < 12 for row in rows)  # ~ln(50304) at init
    assert "| 2x64x4 | 32 | full:block:1 | 2 x 1 |" in (tmp_path / "recompute_memory_cpu.md").read_text()
