"""Shared pytest fixtures, and the heartbeat (tests/heartbeat.py: a line naming the test that has been
running for 30 s, then every 60 s; HPCMEG_TEST_HEARTBEAT=FIRST[,EVERY] seconds, 0 for off).

``slurm_cluster`` (session scope) starts the project's own local Slurm cluster
(``slurm/local-cluster.sh start``: two emulated nodes, accounting, fake pyxis) once per test
session; tests that need it are marked ``slurm``. Set HPCMEG_SKIP_SLURM=1 to skip them on a
machine where the cluster cannot be installed.

When the session ends, any rank process (tests/preloaded.py) a timed-out test left running is killed.

Under pytest-xdist (`-n 2 --dist loadgroup`, the README's command) each test gets a group
(pytest_collection_modifyitems): the Slurm tests run one at a time on one worker, each other module on
one worker; every worker has its own session fixtures and its own tests/preloaded.py forkserver.
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
# Inductor compiles in this process, not in a pool of compile workers (its default on 2 cores is a
# pool of 2 subprocesses, each importing torch: ~2 s of CPU per process that compiles, the test
# processes and every rank process the tests start). The generated code is the same either way.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest

import heartbeat

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "slurm" / "local-cluster.sh"


def pytest_configure(config):
    heartbeat.register(config)
    if getattr(config.option, "dist", None) == "loadgroup" and getattr(config.option, "numprocesses", None):
        config.pluginmanager.register(GroupCheck(), "hpcmeg-xdist-group-check")
    if hasattr(config.option, "loadscopereorder"):
        # pytest-xdist hands out the groups in collection order, not largest-count first: the order that
        # pytest_collection_modifyitems below gives (the Slurm group first)
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """The groups of `pytest -n 2 --dist loadgroup` (the README's test command): pytest-xdist runs each
    group on one worker, one test after another, and different groups side by side.

    - "slurm": every test that uses the local cluster (marker ``slurm`` or the ``slurm_cluster``
      fixture). The cluster's two nodes fit one test's jobs at a time, and these tests spend much of
      their time waiting (sbatch, squeue polls, the jobs' start-up), which the other worker fills.
    - "transformers-converter": the modules that call helpers.run_transformers_converter, which on a
      fresh machine downloads transformers' converter into ~/.cache/hpcmeg (one download at a time).
    - the test module's name, for every other test: a module-scoped fixture (a training run that
      several tests read) is then built once, on one worker, and tests of one module never overlap.
    A test that names its own ``xdist_group`` keeps it. Without xdist (a plain `pytest tests/test_x.py`)
    the marker is inert.

    In an xdist worker the tests are also reordered, as the workers are handed the groups in collection
    order (pytest_configure): the Slurm group first, so the longest group (~10 min) starts at once on
    one worker while the other works through the rest; then the groups that hold a ``slow`` test, so
    the run does not end with one worker on a minute-long test while the other has nothing left."""
    group_of = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark:
            group_of[item] = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
            continue
        if item.get_closest_marker("slurm") or "slurm_cluster" in item.fixturenames:
            group = "slurm"
        elif "run_transformers_converter" in getattr(getattr(item, "module", None), "__dict__", {}):
            group = "transformers-converter"
        else:
            group = item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))
        group_of[item] = group
    if hasattr(config, "workerinput"):
        slow = {group_of[it] for it in items if it.get_closest_marker("slow")}
        rank = {g: (g != "slurm", g not in slow) for g in group_of.values()}
        items.sort(key=lambda it: rank[group_of[it]])  # stable: collection order within each rank


class GroupCheck:
    """In pytest-xdist's controller under --dist loadgroup: a run whose workers collected test ids without
    their group stops in one line. Its Slurm tests would run side by side on the one cluster and fail at
    random (pytest 9.2 with pytest-xdist 3.8: pytest-dev/pytest-xdist#1386)."""

    def pytest_xdist_node_collection_finished(self, node, ids):
        if any("@" not in i for i in ids):
            pytest.exit(f"pytest-xdist's --dist loadgroup ignores the test groups under pytest {pytest.__version__} "
                        f"(pytest-dev/pytest-xdist#1386): install pytest<9.2 (bash slurm/setup-dev.sh does)",
                        returncode=pytest.ExitCode.USAGE_ERROR)


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
