"""A rank stuck at start-up, in its data fetch and in a checkpoint save, on the local Slurm cluster
(issue 41): each time named with its node and phase, the job requeued, the run finished exactly.

Run B (2 ranks on one node of the two) is watched by `hpcmeg submit --wait` while run A trains the
same recipe undisturbed. Run B's recipe sets HPCMEG_FAULT through cluster.env (hpcmeg/train/faults.py):
rank 1 blocks, as on a read from a dead filesystem,
  attempt 0  at start-up, before the process group: rank 0 waits in the rendezvous; the hang is "at
             start-up" with the start-up allowance, and the job is requeued without that node;
  attempt 1  (the other node; excluding it too would leave the job no node) in the data fetch of
             iteration 8, while rank 0 went on into the step and waits in its all-reduce;
  attempt 2  in the save of iteration 15, at the barrier after the shard write (rank 0's: at DP 2 rank 1
             writes none), while rank 0 waits in that barrier (both are in phase checkpoint: rank 0's
             heartbeat says it waits);
attempt 3 finishes from iteration 10, and the weights equal run A's bit for bit.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from cli_helpers import TINY, hpcmeg, sets, status, wait_states
from conftest import REPO, hpcmeg_cmd
from hpcmeg.launch.health import read_health
from hpcmeg.launch.rundir import read_markers

pytestmark = pytest.mark.slurm
ITERS = 20
# a healthy attempt here, on 2 busy cores: ~7 s from the step's launch to the first heartbeat (srun, imports),
# then ~5 s of start-up whose clock restarts at each of its waits; 45 s leaves room for a loaded CI machine
STARTUP_S = 45
HANG = ["cluster.hang_min_s=15", "cluster.hang_after_steps=5", f"cluster.hang_startup_s={STARTUP_S}",
        "cluster.hang_checkpoint_s=15", "cluster.heartbeat_s=0.5"]
FAULT = ";".join(["rank=1,restart=0,at=init,action=block", "rank=1,restart=1,at=data,iteration=8,action=block",
                  "rank=1,restart=2,at=checkpoint,iteration=15,action=block"])


def _over(tmp_path, name, dataset, *extra):
    return TINY + [f"run.name={name}", "run.output_root=" + str(tmp_path), f"data.data_path=[{dataset}]",
                   f"train.train_iters={ITERS}", "checkpoint.save_interval=5", "checkpoint.keep_last=null",
                   "cluster.max_requeues=3", *extra]


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


@pytest.mark.slow  # four start-ups, three hang allowances and requeues
def test_a_rank_stuck_at_start_up_in_data_and_in_a_save_is_named_each_time_and_the_run_resumes_exactly(
        slurm_cluster, tmp_path, tiny_dataset):
    recipe = str(REPO / "recipes" / "codeparrot_tiny.yaml")
    hpcmeg("submit", recipe, "--profile", "local-slurm", *sets(_over(tmp_path, "ref", tiny_dataset)),
           "--stages", "train", cwd=tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([*hpcmeg_cmd(), "submit", recipe, "--profile", "local-slurm",
                          *sets(_over(tmp_path, "stuck", tiny_dataset, *HANG, f"cluster.env.HPCMEG_FAULT={FAULT}")),
                          "--stages", "train", "--wait"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=420)
    run = tmp_path / "stuck"
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    health = read_health(run)
    assert [e["kind"] for e in health["events"]] == ["hang", "excluded", "hang", "note", "hang", "note"], health
    init, excluded, data, _, save, _ = health["events"]
    (node_a,), (node_b,) = init["nodes"], data["nodes"]
    assert node_a != node_b and health["excluded"] == [node_a] and excluded["line"] == f"excluding {node_a}"
    # attempt 0: the start-up hang, with the start-up allowance; rank 1 named, rank 0 waiting for it
    assert init["line"].startswith("hang at start-up: no rank advanced for "), init
    assert f"(allowed {STARTUP_S} s); rank 1 on {node_a} in start-up for " in init["line"], init
    assert init["line"].endswith("the others wait in start-up") and init["ranks"] == [1], init
    # attempt 1: stuck reading iteration 8's batches; rank 0 went on into the step
    assert data["line"].startswith("hang at iteration 8: ") and data["ranks"] == [1], data
    assert f"rank 1 on {node_b} in data at iteration 8 for " in data["line"], data
    # attempt 2: stuck in the save of iteration 15; rank 0 in the same phase, waiting in the barrier
    assert save["line"].startswith("hang at iteration 15: ") and "(allowed 15 s)" in save["line"], save
    assert f"rank 1 on {node_b} in checkpoint at iteration 15 for " in save["line"], save
    assert save["line"].endswith("the others wait in checkpoint at iteration 15") and save["ranks"] == [1], save
    for e in (init, data, save):
        assert f"health: {e['line']}" in text  # submit --wait showed each as it happened
    job = status(run)["stages"]["train"]["job_id"]
    logs = run / "logs" / "train"
    for restart, at in ((0, "init"), (1, "data, iteration 8"), (2, "checkpoint, iteration 15")):
        log1 = (logs / f"train.{job}.r{restart}.1.log").read_text()  # restart r's rank 1
        assert f"HPCMEG_FAULT: blocking at {at}" in log1, log1[-2000:]
        assert "(most recent call first)" in log1 and "in _block" in log1, log1[-2000:]  # the stack says where
    m = read_markers(run)["train"]
    assert m["done"]["restart"] == 3 and m["started"]["node"] == node_b and m["started"]["start_iteration"] == 10, m
    st = wait_states(run, lambda s: s["stages"]["train"]["state"] in ("COMPLETED", "FAILED"), timeout=60)
    assert st["stages"]["train"]["state"] == "COMPLETED" and st["stages"]["train"]["job_id"] == job
    st_a = wait_states(tmp_path / "ref", lambda s: s["stages"]["train"]["state"] in ("COMPLETED", "FAILED"),
                       timeout=180)
    assert st_a["stages"]["train"]["state"] == "COMPLETED"
    import torch

    wa, wb = _weights(tmp_path / "ref"), _weights(run)
    assert wa.keys() == wb.keys() and len(wa) > 5
    assert not [k for k in wa if not torch.equal(wa[k], wb[k])], "weights differ after three hangs and requeues"
