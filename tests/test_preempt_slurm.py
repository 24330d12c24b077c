"""Preemption-safe requeue on the local Slurm cluster (issue 5, point 4).

Run B is interrupted twice while run A trains undisturbed on the other node, same recipe:
  1. the lead signal (`scancel --signal=TERM`, what Slurm sends `signal_lead_s` before the time limit or
     at preemption) reaches every rank; they save the same iteration and exit 3; the host-side
     supervisor checks the restart cap and the progress, runs `scontrol requeue` itself;
  2. an external `scontrol requeue` (SIGTERM to everything): the ranks save, Slurm requeues.
B must keep its job id, restart twice, resume from its checkpoints, append its logs, and end with
weights identical to A's.
"""
from __future__ import annotations

import time

import pytest

from conftest import REPO
from hpcmeg.launch.rundir import read_markers
from hpcmeg.megatron.names import latest_iteration
from cli_helpers import TINY, hpcmeg, sets, status, wait_states

pytestmark = pytest.mark.slurm
ITERS = 30  # after the second interruption (at ~12) the run still has ~18 iterations to go


def _submit(tmp_path, name, dataset):
    over = TINY + [f"run.name={name}", "run.output_root=" + str(tmp_path), f"data.data_path=[{dataset}]",
                   f"train.train_iters={ITERS}", "checkpoint.save_interval=5", "checkpoint.keep_last=null",
                   "cluster.max_requeues=3"]
    hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm", *sets(over),
           "--stages", "train", cwd=tmp_path)
    run = tmp_path / name
    return run, status(run)["stages"]["train"]["job_id"]


def _wait(pred, what, timeout=180):
    end = time.time() + timeout
    while not pred():
        if time.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


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


@pytest.mark.slow  # 45-75 s on 2 busy cores; an acceptance test, so it must exist
def test_requeued_training_resumes_and_matches_uninterrupted_run(slurm_cluster, tmp_path, tiny_dataset):
    import subprocess

    run_a, job_a = _submit(tmp_path, "ref", tiny_dataset)
    run_b, job_b = _submit(tmp_path, "pre", tiny_dataset)
    ck = run_b / "checkpoints"
    _wait(lambda: (latest_iteration(ck) or 0) >= 5, "run B's first checkpoint")
    # 1. the time-limit / preemption lead signal to the job's steps (not the batch shell)
    subprocess.run(["scancel", "--signal=TERM", job_b], check=True)
    _wait(lambda: "requeued" in read_markers(run_b).get("train", {}), "the supervisor's requeue decision")
    first = read_markers(run_b)["train"]["requeued"]["iteration"]
    assert first is not None and 5 <= first < ITERS
    _wait(lambda: read_markers(run_b).get("train", {}).get("started", {}).get("restart") == 1, "restart 1")
    _wait(lambda: (latest_iteration(ck) or 0) > first, "progress after restart 1")
    # 2. an external requeue: SIGTERM to everything, Slurm requeues the same job id
    subprocess.run(["scontrol", "requeue", job_b], check=True)
    st = wait_states(run_b, lambda s: s["stages"]["train"]["state"] in ("COMPLETED", "FAILED", "CANCELLED"),
                     timeout=300)
    assert st["stages"]["train"]["state"] == "COMPLETED", st
    assert st["stages"]["train"]["job_id"] == job_b
    assert st["stages"]["train"]["tasks"][""].get("restarts") == 2, st
    m = read_markers(run_b)["train"]
    assert {"requeued", "interrupted", "done"} <= set(m) and m["done"]["restart"] == 2
    # logs appended per restart: three supervisor banners in one batch log, rank logs per restart
    batch = (run_b / "logs" / "train" / f"train.{job_b}.batch.log").read_text()
    assert batch.count("===== hpcmeg train") == 3 and "decision: requeue" in batch
    for r in (0, 1, 2):
        for rank in (0, 1):
            assert (run_b / "logs" / "train" / f"train.{job_b}.r{r}.{rank}.log").exists()
    resumed = (run_b / "logs" / "train" / f"train.{job_b}.r2.0.log").read_text()
    assert "resum" in resumed.lower()
    st_a = wait_states(run_a, lambda s: s["stages"]["train"]["state"] in ("COMPLETED", "FAILED"), timeout=120)
    assert st_a["stages"]["train"]["state"] == "COMPLETED"
    wa, wb = _weights(run_a), _weights(run_b)
    assert wa.keys() == wb.keys() and len(wa) > 5
    import torch

    diff = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not diff, f"weights differ after requeue: {diff[:5]}"
