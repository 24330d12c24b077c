"""Exit signals, cross-rank agreement (2 gloo processes), wall-time guard, requeue policy."""
import json
import os
import signal
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from hpcmeg.train.signals import (ExitSignal, RequeueGuard, WallTimeGuard, agree, decide_requeue, identity_max,
                                  parse_scontrol_end_time, slurm_job_end_time, slurm_restart_count,
                                  torch_all_reduce_max)


def test_exit_signal_sets_flag_and_restores():
    before, before_term = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    with ExitSignal() as sig:
        assert not sig.flag and signal.getsignal(signal.SIGUSR2) != before
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first one as the reason
        assert sig.flag and sig.received == signal.SIGUSR2 and sig.count == 2
        assert agree(sig.flag, identity_max) and not agree(False, identity_max)
    assert signal.getsignal(signal.SIGUSR2) == before and signal.getsignal(signal.SIGTERM) == before_term
    # SIGUSR1 (NCCL's) is untouched by default
    assert signal.SIGUSR1 not in ExitSignal().signals


def _agree_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    reduce_max = torch_all_reduce_max()
    with ExitSignal() as sig:
        open(os.path.join(out_dir, f"ready{rank}"), "w").close()
        stop_at = None
        for it in range(100000):
            time.sleep(0.002)  # "a training step"
            if agree(sig.flag, reduce_max):
                stop_at = it
                break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"stop_at": stop_at, "got_signal": sig.flag}, f)
    dist.destroy_process_group()


@pytest.mark.dist
def test_two_ranks_agree_when_only_rank1_is_signalled(tmp_path):
    ctx = mp.spawn(_agree_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False)
    deadline = time.time() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)) and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # let them run some iterations
    os.kill(ctx.processes[1].pid, signal.SIGUSR2)
    while not ctx.join(timeout=60):
        pass
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert res[0]["got_signal"] is False and res[1]["got_signal"] is True
    assert res[0]["stop_at"] == res[1]["stop_at"] and res[0]["stop_at"] > 0


def test_wall_time_guard_margin_grows_with_save_time():
    now = 1_000_000.0
    g = WallTimeGuard(end_time_epoch=now + 100, margin_s=30)
    assert g.remaining_s(now) == 100 and not g.should_stop(now)
    assert g.should_stop(now + 71)
    g.record_step(5)
    g.record_save(40)  # a 40 s save: margin becomes 30 + 1.5*40 + 2*5 = 100 s (two steps may still run)
    assert g.effective_margin_s == 100 and g.should_stop(now + 1) and not g.should_stop(now - 1)
    assert not WallTimeGuard(None, 30).should_stop()


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
    assert slurm_restart_count({"SLURM_RESTART_COUNT": "3"}) == 3 and slurm_restart_count({}) == 0


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
