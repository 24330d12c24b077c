"""Shared pytest fixtures, and the heartbeat (tests/heartbeat.py: a line naming the test that has been
running for 30 s, then every 60 s; HPCMEG_TEST_HEARTBEAT=FIRST[,EVERY] seconds, 0 for off).

``slurm_cluster`` (session scope) starts the project's own local Slurm cluster
(``slurm/local-cluster.sh start``: two emulated nodes, accounting, fake pyxis) once per test
session; tests that need it are marked ``slurm``. Set HPCMEG_SKIP_SLURM=1 to skip them on a
machine where the cluster cannot be installed.

When the session ends, any rank process (tests/preloaded.py) a timed-out test left running is killed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# MKL's conditional numerical reproducibility, before anything loads torch (MKL reads it once) and
# inherited by every process the tests start (Slurm jobs included): on AVX-512 machines MKL picks
# GEMM code paths by the operands' memory alignment, so the same fp32 GEMM on the same values could
# differ in the last bit between a DP rank and a single process: tests/test_parallel_slurm.py's
# bit-for-bit DP2 == one process failed in every run on such a machine without this (and with
# MKL_CBWR=AVX2) and passed 6 out of 6 with it. "AUTO,STRICT" keeps the auto-detected code path and makes it alignment-independent.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest

import heartbeat

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "slurm" / "local-cluster.sh"


def pytest_configure(config):
    heartbeat.register(config)


def pytest_unconfigure(config):
    from preloaded import kill_leftovers

    kill_leftovers()


def hpcmeg_cmd() -> list[str]:
    """How tests invoke the CLI: the console script when installed, else ``python -m hpcmeg.cli``."""
    exe = shutil.which("hpcmeg")
    return [exe] if exe else [sys.executable, "-m", "hpcmeg.cli"]


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.environ.get("HPCMEG_SKIP_SLURM") == "1":
        pytest.skip("HPCMEG_SKIP_SLURM=1")
    env = dict(os.environ, SLURM_CI_FAKE_PYXIS=os.environ.get("SLURM_CI_FAKE_PYXIS", "1"))
    r = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(f"local Slurm cluster did not start:\n{r.stderr[-3000:]}")
    return {"nodes": 2, "partition": "debug", "preempt_partition": "urgent"}


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """A tokenized dataset made once (locally) for the tests that only train."""
    from cli_helpers import corpus_shards, hpcmeg

    tmp = tmp_path_factory.mktemp("tinydata")
    (src,) = corpus_shards(tmp, n=1)
    prefix = tmp / "cp"
    hpcmeg("preprocess", "--input", str(src), "--output-prefix", str(prefix), "--json-keys", "content",
           "--append-eod", "--workers", "1", "--quiet")
    return str(prefix) + "_content_document"


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def dist_pool():
    """``dist_pool(world).run(fn, *args)``: a gloo process pool per world size, started once per session."""
    from dist_pool import DistPool

    pools: dict[int, DistPool] = {}

    def get(world: int) -> DistPool:
        if world not in pools:
            pools[world] = DistPool(world)
        return pools[world]

    yield get
    for p in pools.values():
        p.close()
