"""hpcmeg/procenv.py (the job's end time) and launch/requeue.py (the requeue policy and its state file)."""
import json
import os

import pytest

from hpcmeg.launch.requeue import RequeueGuard, decide_requeue
from hpcmeg.procenv import parse_scontrol_end_time, slurm_job_end_time


def test_slurm_end_time_sources():
    assert slurm_job_end_time({"SLURM_JOB_END_TIME": "1700000000"}) == 1700000000.0
    assert slurm_job_end_time({}) is None
    # a job id without a reachable scontrol (containers): None, no exception
    env = {"SLURM_JOB_ID": "123", "PATH": "/nonexistent"}
    old = os.environ.get("PATH")
    os.environ["PATH"] = "/nonexistent"
    try:
        assert slurm_job_end_time(env) is None
    finally:
        os.environ["PATH"] = old
    line = "JobId=7 JobName=train UserId=u(1) StartTime=2026-01-02T03:04:05 EndTime=2026-01-02T05:04:05 Deadline=N/A"
    assert parse_scontrol_end_time(line) - parse_scontrol_end_time(line.replace("EndTime=2026-01-02T05", "EndTime=2026-01-02T03")) == 7200
    assert parse_scontrol_end_time("EndTime=Unknown") is None


def test_requeue_policy_cap_and_no_progress(tmp_path):
    kw = dict(max_restarts=3, max_no_progress=2)
    assert decide_requeue(restart_count=0, start_iteration=None, current_iteration=100, no_progress_streak=0, **kw).requeue
    assert not decide_requeue(restart_count=3, start_iteration=100, current_iteration=200, no_progress_streak=0, **kw).requeue
    guard = RequeueGuard(str(tmp_path / "requeue.json"), max_restarts=5, max_no_progress=2)
    guard.on_start(0, None)
    assert guard.decide(0, 100).requeue  # progress: None -> 100
    guard.on_start(1, 100)
    d = guard.decide(1, 100)  # preempted before the next checkpoint: tolerated once
    assert d.requeue and d.no_progress_streak == 1
    guard.on_start(2, 100)
    d = guard.decide(2, 100)  # a loop: stop
    assert not d.requeue and "no progress" in d.reason
    guard.on_start(3, 100)
    assert guard.decide(3, 150).requeue  # progress resets the streak
    assert json.loads((tmp_path / "requeue.json").read_text())["no_progress_streak"] == 0
    (tmp_path / "requeue.json").write_text("{oops")
    with pytest.raises(ValueError, match="requeue.json"):
        guard.decide(4, 150)
