"""Rank layout from torchrun / Slurm environments and the pure-Python hostlist expander."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hpcmeg.procenv import dist_env, expand_hostlist, port_from_job_id, tasks_per_node


@pytest.mark.parametrize("spec,hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu-a[1-2]-ib,login", ["gpu-a1-ib", "gpu-a2-ib", "login"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("c[098-101],d5", ["c098", "c099", "c100", "c101", "d5"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node]1[", "node[3-1]", "node[a-b]"])
def test_expand_hostlist_rejects_garbage(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]


def test_torchrun_env_wins():
    e = dist_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "h0", "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_addr, e.master_port, e.source) == \
        (3, 4, 1, 2, "h0", 1234, "torchrun")


def test_slurm_step_env():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "16",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_STEP_NODELIST": "gpu[08-09]", "SLURM_JOB_ID": "123456"}
    e = dist_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.source) == (5, 8, 1, 4, "slurm")
    assert e.master_addr == "gpu08"  # first host of the STEP, not of the job
    assert e.master_port == port_from_job_id(123456) and 20000 <= e.master_port < 32000
    # never the local test cluster's slurmd ports (17001..) nor an ephemeral port, whatever the job id
    assert all(20000 <= port_from_job_id(j) < 32000 for j in (2001, 2002, 12768, 31999, 10 ** 7 + 1))
    assert dist_env({**env, "MASTER_ADDR": "x", "MASTER_PORT": "999"}).master_port == 999


def test_batch_script_is_not_a_step():
    # the batch shell sees SLURM_PROCID=0 and the job's task count, but no srun started the others
    e = dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "7"})
    assert (e.world_size, e.source) == (1, "single")


def test_inconsistent_env_is_refused():
    with pytest.raises(ValueError, match="rank 4 of world size 4"):
        dist_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="not an integer"):
        dist_env({"RANK": "x", "WORLD_SIZE": "4"})


def test_env_module_does_not_import_torch():
    code = "import sys, hpcmeg.procenv; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
