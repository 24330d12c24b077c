"""`hpcmeg smoke` without a cluster: its recipe fits every packaged Slurm profile, the verdicts on what
ranks report (GPU layouts the local CPU cluster cannot produce), and the heartbeat."""
from __future__ import annotations

import io
import re
import time

import pytest

from conftest import REPO
from hpcmeg.launch import smoke
from hpcmeg.recipe import derive, load_recipe

SLURM_PROFILES = ["local-slurm", "example-apptainer", "example-pyxis"]


@pytest.mark.parametrize("profile", SLURM_PROFILES)
def test_smoke_recipe_fits_every_packaged_profile(profile):
    first = load_recipe(None, [], profile, data=smoke.smoke_recipe("runs", smoke._ANY_WORLD, False, "c.jsonl"))
    world = first.cluster.tasks_per_node()
    r = load_recipe(None, [], profile, data=smoke.smoke_recipe("/x", world, first.cluster.gpus_per_node > 0, "c.jsonl"))
    d = derive(r)
    assert r.cluster.nodes == 1 and d.world_size == world and d.grad_accum_steps == 1
    assert r.cluster.partition == load_recipe(REPO / "recipes" / "codeparrot_tiny.yaml", [], profile).cluster.partition
    assert r.train.precision == ("bf16" if r.cluster.gpus_per_node else "fp32") and r.train.compile == "off"
    assert r.cluster.time_limit_minutes() == 20 and r.train.train_iters == 6


def _rank(i, host="gpu01", device=None, gpus=8):
    return {"rank": i, "host": host, "device": device or f"cuda:{i}", "gpus": ["NVIDIA H200"] * gpus,
            "cuda_visible_devices": "0,1,2,3,4,5,6,7", "torch": "2.11.0+cu130"}


def test_devices_per_rank_verdicts():
    ok, text = smoke.describe_ranks([_rank(i) for i in range(8)], gpus_per_node=8)
    assert ok and text.startswith("rank 0 cuda:0; rank 1 cuda:1") and "NVIDIA H200" in text
    ok, text = smoke.describe_ranks([_rank(0), _rank(1, device="cuda:0")], gpus_per_node=2)
    assert not ok and "two ranks share a GPU" in text
    ok, text = smoke.describe_ranks([_rank(0), {**_rank(1), "gpus": [], "cuda_visible_devices": ""}], 2)
    assert not ok and text.startswith("rank(s) 1 see no GPU") and "--nv" in text
    ok, text = smoke.describe_ranks([{"rank": 0, "cpus_usable": 4, "slurm_cpus_per_task": "4"}], 0)
    assert ok and text.startswith("CPU ranks: 1 rank(s)") and "--cpus-per-task 4, cores usable per rank 4" in text


def test_a_line_comes_while_nothing_else_happens(monkeypatch):
    monkeypatch.setattr(smoke, "HEARTBEAT_S", 0.4)
    out = io.StringIO()
    with smoke.Reporter(out=out) as rep:
        rep.waiting = "waiting for train: PENDING (Resources)"
        time.sleep(1.5)
        rep.result("first loss line", True, "iteration 1/6 | loss 10.5")
        rep.result("first loss line", False, "a second verdict is ignored")
    lines = out.getvalue().splitlines()
    beats = [ln for ln in lines if ln.endswith("... waiting for train: PENDING (Resources)")]
    assert 2 <= len(beats) <= 4 and re.match(r"^\[smoke +\d+s\] PASS first loss line: ", lines[-1])
    assert not rep.failed and sum("first loss line" in ln for ln in lines) == 1
