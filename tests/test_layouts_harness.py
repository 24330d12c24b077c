"""bench/layouts_gpu.py, the every-layout-on-one-GPU harness, run on CPU (fp32, a tiny model, 3 steps).

Its ranks are real gloo processes and its model, optimizer and step are the product's, so on CPU it
checks what the GPU run relies on: the layouts with sequence parallelism, the interleaved pipeline and
the distributed optimizer follow the single-rank curve within the fp32 tolerance while every
collective the product calls goes through the harness's host staging (--stage all: on CPU nothing
needs it, so this is the run that executes the wrappers: send/recv of the pipeline, the raw
reduce-scatter/all-gather/all-reduce of the TP regions, the buffer's reduce-scatter and the
parameter all-gather of the distributed optimizer); the table and the JSON are written; a curve off
by more than the tolerance is reported as a disagreement; and bench/lease.sh's `layouts` stage
logs commands the tool accepts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

pytestmark = pytest.mark.dist

TINY = ["--device", "cpu", "--dtype", "fp32", "--fused", "on", "--layers", "4", "--hidden", "64", "--heads", "4",
        "--seq", "32", "--vocab", "512", "--micro", "2", "--global-batch", "8", "--steps", "3", "--warmup", "1",
        "--threads", "1"]


def test_layouts_follow_one_rank_through_the_staged_collectives(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "layouts_gpu.py"), *TINY,
                        "--layouts", "tp2_sp,pp2_v2,dp2_do", "--stage", "all", "--out", str(tmp_path), "--tag", "t"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "layouts_t.json").read_text())
    assert list(report["layouts"]) == ["ref", "tp2_sp", "pp2_v2", "dp2_do"] and report["all_agree"]
    ref = report["layouts"]["ref"]["ranks"][0]
    assert len(ref["losses"]) == 3 and ref["losses"][-1] < ref["losses"][0]  # it trains
    calls = {}
    for name in ("tp2_sp", "pp2_v2", "dp2_do"):
        row = report["layouts"][name]
        c = row["compare"]
        assert row["ok"] and c["agree"] and c["loss_rel"] <= 1e-4 and c["grad_norm_rel"] <= 1e-3, (name, c)
        assert c["ranks_consistent"]
        assert c["graph_breaks_after_warmup"] == 0 and c["recompiles_after_warmup"] == 0
        assert len(row["ranks"]) == 2 and all(x["backend"] == "gloo" for x in row["ranks"])
        calls[name] = {k: sum(x["staged_calls"][k] for x in row["ranks"]) for k in row["ranks"][0]["staged_calls"]}
    # every kind of collective the product issues went through a wrapper
    assert calls["tp2_sp"]["hpcmeg.parallel.comm.reduce_scatter"] and calls["tp2_sp"]["hpcmeg.parallel.comm.all_gather"]
    assert calls["pp2_v2"]["torch.distributed.send"] and calls["pp2_v2"]["torch.distributed.recv"]
    scatter = [k for k in calls["dp2_do"] if "reduce_scatter_" in k and k.startswith("torch.")]
    gather = [k for k in calls["dp2_do"] if "all_gather_" in k and k.startswith("torch.")]
    assert sum(calls["dp2_do"][k] for k in scatter) and sum(calls["dp2_do"][k] for k in gather), calls["dp2_do"]
    assert report["layouts"]["dp2_do"]["ranks"][0]["sharded"]
    md = (tmp_path / "layouts_t.md").read_text()
    for name in ("ref", "tp2_sp", "pp2_v2", "dp2_do"):
        assert f"| {name} | {'ref' if name == 'ref' else 'yes'} |" in md, md
    assert "python bench/layouts_gpu.py " in md and "--stage all" in md


def test_a_curve_off_by_more_than_the_tolerance_disagrees():
    import layouts_gpu

    def res(losses, norms, dp=1):
        return {"ranks": [{"coords": {"dp": d}, "losses": losses, "grad_norms": norms, "graph_breaks_after_warmup": 0,
                           "recompiles_after_warmup": 0, "step_s_median": 0.1, "peak_mem_gb": None}
                          for d in range(dp)]}

    ref = res([6.0, 5.0, 4.0], [1.0, 0.9, 0.8])
    tol = layouts_gpu.TOLERANCE["fp32"]
    assert layouts_gpu.compare(res([6.0, 5.0, 4.0002], [1.0, 0.9, 0.8], dp=2), ref, tol)["agree"]
    assert not layouts_gpu.compare(res([6.0, 5.0, 4.01], [1.0, 0.9, 0.8]), ref, tol)["agree"]
    assert not layouts_gpu.compare(res([6.0, 5.0, 4.0], [1.0, 0.9, 0.81]), ref, tol)["agree"]
    assert not layouts_gpu.compare(res([6.0, 5.0, float("nan")], [1.0, 0.9, 0.8]), ref, tol)["agree"]
    assert not layouts_gpu.compare(res([6.0, 5.0], [1.0, 0.9]), ref, tol)["agree"]  # a short curve
    split = res([6.0, 5.0, 4.0], [1.0, 0.9, 0.8], dp=2)
    split["ranks"][1]["grad_norms"] = [1.0, 0.9, 0.79]  # the ranks disagree on the global norm
    assert not layouts_gpu.compare(split, ref, tol)["ranks_consistent"]


def test_bad_layout_and_lease_stage(tmp_path, capsys):
    """An unknown layout, or one the model cannot be cut into, is refused with one line before anything
    starts; bench/lease.sh layouts (no GPU here) logs both its runs, whose arguments the tool parses."""
    import layouts_gpu

    for extra, msg in ((["--layouts", "tp3"], "unknown layout(s) ['tp3']"),
                       (["--layouts", "pp2_v2", "--layers", "2"], "pp2_v2: model.num_layers"),
                       (["--layouts", "nccl1"], "nccl1 needs --device cuda"),
                       (["--recompute", "full:sideways:1"], "recompute_method='sideways'")):
        assert layouts_gpu.main([*TINY, *extra, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())  # nothing ran
    out = tmp_path / "lease"
    env = {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": "",  # `python` in lease.sh: this interpreter
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    lease = ["bash", os.path.join(ROOT, "bench", "lease.sh"), "layouts"]
    r = subprocess.run(lease, capture_output=True, text=True, timeout=60, env={**env, "LAYOUTS_DTYPES": "bf16 fp16"})
    assert r.returncode == 2 and "LAYOUTS_DTYPES holds 'fp16'" in r.stderr and not out.exists(), r.stderr
    r = subprocess.run(lease, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       env={**env, "LAYOUTS": "tp2,pp2", "LAYOUTS_ARGS": "--stage all"})
    assert r.returncode == 0, r.stderr
    with tarfile.open(out / "lease.tgz") as t:
        logged = t.extractfile("lease.log").read().decode()
        logs = {n: t.extractfile(n).read().decode() for n in t.getnames() if n.startswith("layouts")}
    assert "--dtype bf16" in logged and "--dtype fp32" in logged, logged
    assert logged.count("--layouts tp2,pp2 --stage all") == 2, logged
    assert sorted(logs) == ["layouts_bf16.log", "layouts_fp32.log"], sorted(logs)
    for log in logs.values():  # past argparse: it stops at the missing GPU
        assert "torch sees no CUDA device" in log, log
