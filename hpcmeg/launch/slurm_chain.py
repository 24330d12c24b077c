"""A run's plan put into the Slurm queue, and the question whether it is still there.

Contract: ``submit_plan(prep) -> {stage: job id}`` submits every job of ``prep.plan`` (a
``hpcmeg.launch.submit.Prepared``) through submitit in order, each with ``afterok`` on the one before,
and rewrites jobs.json after every submission, so a failure mid-chain still leaves the ids for
``hpcmeg cancel``. ``active_jobs(run)``: the ids of the run's last submission that Slurm still has
queued or running. ``job_environment(values)``: secret values in this process's environment only
while sbatch runs. ``placeholder_dependency(plan, stage)``: the dependency a script shows before the
job ids exist (``--dry-run``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import time
from typing import Iterator, Optional

from hpcmeg.launch import scripts
from hpcmeg.launch.rundir import RunDir, read_json, write_atomic, write_jobs


def _previous_stage(plan: scripts.Plan, stage: str) -> Optional[str]:
    stages = [job.stage for job in plan.jobs]
    i = stages.index(stage)
    return stages[i - 1] if i > 0 else None


def placeholder_dependency(plan: scripts.Plan, stage: str) -> Optional[str]:
    prev = _previous_stage(plan, stage)
    return f"afterok:<{prev} job id>" if prev else None


def active_jobs(run: RunDir) -> list[str]:
    """Job ids of this run's last submission that Slurm still has queued or running."""
    rec = read_json(run.jobs, None)
    if not rec or rec.get("executor") != "slurm":
        return []
    ids = [s["job_id"] for s in rec.get("stages", {}).values() if s.get("job_id")]
    if not ids:
        return []
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%A", "-j", ",".join(ids)], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({x.strip() for x in out.split() if x.strip()})


def submit_plan(prep) -> dict[str, str]:
    """Submit every job of the plan in order; returns {stage: job id} (array jobs: the array's id)."""
    import submitit

    from hpcmeg.launch.supervisor import run_task

    run, plan = prep.run, prep.plan
    record = {"executor": "slurm", "submitted": time.time(), "recipe": str(run.recipe), "stages": {}}
    ids: dict[str, str] = {}
    write_jobs(run, record)  # an earlier submission's record moves to "history"
    for job in plan.jobs:
        prev = _previous_stage(plan, job.stage)
        dep = f"afterok:{ids[prev]}" if prev else None
        folder = run.submitit(job.stage)
        # the script as submitted, dependency included (submitit keeps its own copy in the folder too)
        write_atomic(run.sbatch_script(job.stage),
                     scripts.render_sbatch(job, str(folder), shlex.quote(prep.host_python), dep))
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=shlex.quote(prep.host_python))
        ex.update_parameters(**scripts.with_dependency(job.params, dep))
        if job.array:
            jobs = ex.map_array(run_task, job.tasks)
            jid = str(jobs[0].job_id).split("_")[0]
        else:
            jid = str(ex.submit(run_task, job.tasks[0]).job_id)
        ids[job.stage] = jid
        extra = {k: job.tasks[0][k] for k in ("checkpoint_dir", "train_iters") if k in job.tasks[0]}
        record["stages"][job.stage] = {"job_id": jid, "array": job.array, "dependency": dep, **extra}
        _update_jobs(run, record)
    return ids


def _update_jobs(run: RunDir, record: dict) -> None:
    cur = read_json(run.jobs, {}) or {}
    write_atomic(run.jobs, json.dumps({**record, "history": cur.get("history", [])}, indent=2) + "\n")


@contextlib.contextmanager
def job_environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while sbatch runs (submitit starts it with ours), so
    secrets reach the jobs through Slurm's --export and no file; the old environment comes back after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
