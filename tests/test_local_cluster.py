"""The project's own local Slurm cluster really runs jobs: single-node, two-node, arrays."""

from __future__ import annotations

import subprocess
import time

import pytest

from conftest import CLUSTER_SCRIPT

pytestmark = pytest.mark.slurm


def _sbatch(*args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]


def _final_state(job_id: str, timeout: float = 60) -> str:
    """Poll until the job leaves the queue; read its state from sacct (accounting lags ~0.2 s)."""
    end = time.time() + timeout
    state = ""
    while time.time() < end:
        q = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        if not q:
            s = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                               capture_output=True, text=True).stdout.split()
            if s and s[0] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
                return s[0]
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s (last state {state!r})")


def test_job_completes(slurm_cluster, tmp_path):
    out = tmp_path / "out.txt"
    jid = _sbatch("-o", str(out), "--wrap", "echo hello from $SLURMD_NODENAME")
    assert _final_state(jid) == "COMPLETED"
    assert out.read_text().startswith("hello from node")


def test_failing_job_is_failed(slurm_cluster, tmp_path):
    jid = _sbatch("-o", str(tmp_path / "o"), "--wrap", "exit 3")
    assert _final_state(jid) == "FAILED"


def test_two_nodes_have_distinct_node_ids(slurm_cluster, tmp_path):
    out = tmp_path / "out.txt"
    jid = _sbatch("--nodes=2", "--ntasks-per-node=1", "-o", str(out),
                  "--wrap", "srun bash -c 'echo node=$SLURM_NODEID name=$SLURMD_NODENAME'")
    assert _final_state(jid) == "COMPLETED"
    lines = sorted(out.read_text().split())
    node_ids = {x for x in lines if x.startswith("node=")}
    names = {x for x in lines if x.startswith("name=")}
    assert node_ids == {"node=0", "node=1"}
    assert names == {"name=node1", "name=node2"}


def test_array_job(slurm_cluster, tmp_path):
    jid = _sbatch("--array=0-3", "-o", str(tmp_path / "a_%a.txt"), "--wrap", "echo $SLURM_ARRAY_TASK_ID")
    for i in range(4):
        assert _final_state(f"{jid}_{i}") == "COMPLETED"
        assert (tmp_path / f"a_{i}.txt").read_text().strip() == str(i)


def test_start_is_idempotent(slurm_cluster):
    t0 = time.time()
    r = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Slurm is up" in r.stderr
    assert time.time() - t0 < 30  # nothing to install or restart the second time
    st = subprocess.run(["bash", str(CLUSTER_SCRIPT), "status"], capture_output=True, text=True)
    assert st.returncode == 0 and "slurmctld: running" in st.stdout
