"""bench/scaling.py on CPU: real torchrun + gloo with 2 processes, tiny model, both kinds (hpcmeg
trainer path and the DDP nanoGPT baseline), so the multi-GPU run is one call later."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_allreduce_volume_on_paper():
    import scaling
    table = scaling.allreduce_table({"124M": 124_475_904}, [1, 2, 8], {"124M": 0.0277}, 450.0)
    rows = [ln for ln in table.splitlines() if ln.startswith("| 124M")]
    assert len(rows) == 2  # n=1 sends nothing and has no row
    # ring: 2(n-1)/n x 4 bytes x N; n=8 -> 1.75 x 497.9 MB = 871 MB, 1.94 ms at 450 GB/s
    assert "| 8 | 871 MB | 1.94 ms | 27.7 ms | 7.0% |" in rows[1]
    assert "| 2 | 498 MB |" in rows[0]


@pytest.mark.slow
@pytest.mark.dist
def test_scaling_bench_cpu_gloo_two_processes(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "scaling.py"), "--device", "cpu", "--gpus", "1,2",
           "--sizes", "2x64x4", "--kinds", "hpcmeg,nano", "--seq", "64", "--mb", "2", "--steps", "2", "--warmup", "1",
           "--precision", "fp32", "--n-files", "200", "--data", str(tmp_path / "data"), "--out", str(out),
           "--tag", "cpu", "--timeout-s", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.load(open(out / "scaling_cpu.json"))["rows"]
    got = {(r["kind"], r["n"]) for r in rows if r.get("tokens_per_s", 0) > 0}
    assert got == {("hpcmeg", 1), ("hpcmeg", 2), ("nano", 1), ("nano", 2)}
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_gpu"] * r["n"], rel=1e-2)
        assert r["scaling_eff"] > 0
    md = (out / "scaling_cpu.md").read_text()
    assert "| 2x64x4 | hpcmeg | 2 |" in md and "bytes sent per GPU per step" in md
