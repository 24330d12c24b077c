"""A hung and a dead rank on the local Slurm cluster (issue 41): found, named, routed around.

Run B (2 ranks on one node of the two) is watched by `hpcmeg submit --wait` while run A trains the
same recipe undisturbed. Attempt 0: rank 1 is SIGSTOPped mid-training (by pid, from its own heartbeat
file). The supervisor must see that no rank advances within the recipe's allowance, name rank 1
with its node, phase and iteration (batch log, `submit --wait`, `hpcmeg status`), have the ranks'
stacks dumped, cancel the step and requeue the same job with that node excluded. Attempt 1 runs on
the other node; after it checkpointed, its rank 1 is killed (-9): the supervisor names the dead rank
from srun's line, and requeues WITHOUT excluding that node too (the partition would keep no node for
the job). Attempt 2 finishes; the weights equal run A's bit for bit.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import REPO, hpcmeg_cmd
from hpcmeg.heartbeat import read_beats
from hpcmeg.launch.health import read_health
from hpcmeg.launch.rundir import read_markers
from cli_helpers import TINY, hpcmeg, sets, status, wait_states

pytestmark = pytest.mark.slurm
ITERS = 30
# a step of this model takes ~0.1-0.5 s on 2 busy cores: 15 s without progress is a hang (a healthy
# step on a loaded CI machine stalls for seconds, not 15)
HANG = ["cluster.hang_min_s=15", "cluster.hang_after_steps=5", "cluster.hang_startup_s=300", "cluster.heartbeat_s=0.5"]
TRAINING = ("data", "forward-backward", "optimizer", "sync")


def _over(tmp_path, name, dataset, *extra):
    return TINY + [f"run.name={name}", "run.output_root=" + str(tmp_path), f"data.data_path=[{dataset}]",
                   f"train.train_iters={ITERS}", "checkpoint.save_interval=5", "checkpoint.keep_last=null",
                   "cluster.max_requeues=2", *extra]


def _weights(run):
    import torch

    from hpcmeg.checkpoint.safe import safe_torch_load

    sd = safe_torch_load(str(run / "checkpoints" / f"iter_{ITERS:07d}" / "mp_rank_00" / "model_optim_rng.pt"))
    flat = {}

    def walk(d, pre):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{pre}{k}.")
            elif isinstance(v, torch.Tensor):
                flat[pre + k] = v
    walk(sd["model"], "")
    return flat


def _beat(directory, rank):
    return next((b for b in read_beats(directory) if b["rank"] == rank), None)


def _wait_rank1(run, job, restart, at_least, end):
    """Rank 1's heartbeat of this attempt once it trains at iteration >= at_least."""
    rec = None
    while time.time() < end:
        rec = _beat(run / "health" / f"{job}.r{restart}", 1)
        if rec and rec["phase"] in TRAINING and rec["iteration"] >= at_least:
            return rec
        time.sleep(0.2)
    raise AssertionError(f"rank 1 of restart {restart} never trained at iteration {at_least}; last heartbeat {rec}")


@pytest.mark.slow  # ~2-3 min on 2 busy cores: three start-ups, the hang allowance, two requeues
def test_a_stopped_then_a_killed_rank_are_named_routed_around_and_the_run_resumes_exactly(slurm_cluster, tmp_path,
                                                                                       tiny_dataset):
    recipe = str(REPO / "recipes" / "codeparrot_tiny.yaml")
    hpcmeg("submit", recipe, "--profile", "local-slurm", *sets(_over(tmp_path, "ref", tiny_dataset)), "--stages", "train",
           cwd=tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    watcher = subprocess.Popen([*hpcmeg_cmd(), "submit", recipe, "--profile", "local-slurm",
                                *sets(_over(tmp_path, "hung", tiny_dataset, *HANG)), "--stages", "train", "--wait"],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "hung"
    try:
        end = time.time() + 400
        while not (run / "jobs.json").exists() and time.time() < end:
            time.sleep(0.2)
        job = status(run)["stages"]["train"]["job_id"]
        # attempt 0: rank 1 stopped (SIGSTOP) mid-training
        rec = _wait_rank1(run, job, 0, 8, end)
        os.kill(rec["pid"], signal.SIGSTOP)
        stopped_at, node_a = time.time(), rec["node"]
        # attempt 1 runs elsewhere; rank 1 killed (-9) after it checkpointed again
        resumed = read_markers_wait(run, 1, end)
        rec = _wait_rank1(run, job, 1, resumed + 7, end)
        node_b = rec["node"]
        os.kill(rec["pid"], signal.SIGKILL)
        out, _ = watcher.communicate(timeout=max(30, end - time.time()))
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, out[-3000:]
    assert node_b != node_a
    health = read_health(run)
    kinds = [e["kind"] for e in health["events"]]
    assert kinds == ["hang", "excluded", "dead", "note"], health
    hang, _, dead, note = health["events"]
    # the hang: found within the allowance (15 s, then a 2 s poll), named where a user looks
    named = f"rank 1 on {node_a} in "
    assert named in hang["line"] and "stopped or dead" in hang["line"], hang
    assert hang["time"] - stopped_at < 15 + 12, (hang["time"] - stopped_at, hang)
    assert hang["ranks"] == [1] and hang["nodes"] == [node_a] and hang["iteration"] >= 8
    assert f"health: {hang['line']}" in out  # submit --wait showed it as it happened
    batch = (run / "logs" / "train" / f"train.{job}.batch.log").read_text()
    assert named in batch and f"excluding {node_a}" in batch
    log0 = (run / "logs" / "train" / f"train.{job}.r0.0.log").read_text()
    assert "(most recent call first)" in log0  # rank 0 waited in a collective and dumped its stack when asked
    # the death: named from srun's line; excluding node_b too would leave the partition no node for
    # the job, so it is requeued without more exclusions
    assert dead["line"].startswith(f"rank 1 on {node_b} died in ") and "Killed" in dead["line"], dead
    assert f"health: {dead['line']}" in out
    assert "would keep 0 usable node(s)" in note["line"], note
    assert health["excluded"] == [node_a]
    shown = hpcmeg("status", str(run)).stdout
    assert f"rank 1 on {node_b} died" in shown and f"excludes {node_a}" in shown
    # the same job, requeued twice, finished; weights equal to the undisturbed run's
    st = wait_states(run, lambda s: s["stages"]["train"]["state"] in ("COMPLETED", "FAILED"), timeout=60)
    assert st["stages"]["train"]["state"] == "COMPLETED" and st["stages"]["train"]["job_id"] == job
    m = read_markers(run)["train"]
    assert m["done"]["restart"] == 2 and m["started"]["node"] == node_b, m
    st_a = wait_states(tmp_path / "ref", lambda s: s["stages"]["train"]["state"] in ("COMPLETED", "FAILED"),
                       timeout=180)
    assert st_a["stages"]["train"]["state"] == "COMPLETED"
    import torch

    wa, wb = _weights(tmp_path / "ref"), _weights(run)
    assert wa.keys() == wb.keys() and len(wa) > 5
    assert not [k for k in wa if not torch.equal(wa[k], wb[k])], "weights differ after the hang, the death and requeues"


def read_markers_wait(run, restart, end) -> int:
    """The iteration restart `restart` resumed from (its started marker), once it started."""
    while time.time() < end:
        st = read_markers(run).get("train", {}).get("started", {})
        if st.get("restart") == restart:
            return st.get("start_iteration") or 0
        time.sleep(0.2)
    raise AssertionError(f"restart {restart} never started")
