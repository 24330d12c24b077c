"""Run directory, status sources, requeue decisions, logs: the parts of hpcmeg.launch that need no job.

`hpcmeg status` must answer without accounting: here the job ids are ones Slurm never had (as after
MinJobAge, or on a machine without Slurm) and `sacct` fails like a cluster without slurmdbd, so the
answer has to come from the marker files the jobs write.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import pytest

from hpcmeg.launch import status as ST
from hpcmeg.launch.rundir import (RunDir, dataset_is_current, input_manifest, manifest_path, marker_state, read_json, read_markers, write_jobs, write_manifest, write_marker)
from hpcmeg.megatron.names import committed_iterations, latest_iteration
from hpcmeg.launch.supervisor import _SlurmEnds, convert_iteration, effective_train_rc, train_outcome


@pytest.mark.parametrize("rc,end,verdict,action", [
    (0, 100, (True, ""), "done"),
    (0, 50, (True, "ok"), "requeue"),          # exit 0 before train_iters (Megatron-style signal exit)
    (3, 50, (True, "ok"), "requeue"),
    (3, 50, (False, "restart cap reached"), "fail"),
    (1, 50, (True, "ok"), "fail"),             # a crash is never requeued
    (137, None, (True, "ok"), "fail"),
])
def test_train_outcome(rc, end, verdict, action):
    out = train_outcome(rc, end, 100, verdict)
    assert out.action == action
    if action == "fail":
        assert str(rc) in out.reason or verdict[1] in out.reason


def test_effective_rc_trusts_rank0_status_of_this_attempt(tmp_path):
    t0 = time.time()
    (tmp_path / "train_status.json").write_text(json.dumps({"status": "preempted", "time": t0 - 100}))
    assert effective_train_rc(143, tmp_path, t0) == 143  # written by an earlier attempt: ignored
    (tmp_path / "train_status.json").write_text(json.dumps({"status": "preempted", "time": t0 + 1}))
    assert effective_train_rc(143, tmp_path, t0) == 3
    (tmp_path / "train_status.json").write_text(json.dumps({"status": "failed", "time": t0 + 1}))
    assert effective_train_rc(143, tmp_path, t0) == 143


def _ckpts(d: Path, its, tracker):
    for it in its:
        (d / f"iter_{it:07d}" / "mp_rank_00").mkdir(parents=True)
    (d / "iter_0000099.tmp").mkdir()  # a crashed save's leftover
    (d / "latest_checkpointed_iteration.txt").write_text(str(tracker))


def test_checkpoint_listing_and_convert_iterations(tmp_path):
    _ckpts(tmp_path, [10, 20, 30], tracker=20)  # 30 is newer than the tracker: uncommitted
    assert latest_iteration(tmp_path) == 20 and committed_iterations(tmp_path) == [10, 20]
    base = {"checkpoint_dir": str(tmp_path)}
    assert convert_iteration({**base, "iterations": "last"}) == 20
    assert [convert_iteration({**base, "iterations": "all", "task": i}) for i in range(3)] == [10, 20, None]
    assert convert_iteration({**base, "iterations": "20,10", "task": 1}) == 10
    with pytest.raises(RuntimeError, match="iteration 30 .* no committed checkpoint"):
        convert_iteration({**base, "iterations": "30"})
    with pytest.raises(RuntimeError, match="no checkpoint"):
        convert_iteration({"checkpoint_dir": str(tmp_path / "none"), "iterations": "last"})


def test_dataset_manifest_detects_changed_inputs(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "x"}\n')
    tok = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": None, "append_eod": True}
    prefix = str(tmp_path / "ds")
    outs = [prefix + "_text_document"]
    m = input_manifest([str(src)], tok)
    assert not dataset_is_current(prefix, outs, m)  # no dataset yet
    for ext in (".bin", ".idx"):
        Path(outs[0] + ext).write_bytes(b"0")
    write_manifest(prefix, m)
    assert manifest_path(prefix).exists() and dataset_is_current(prefix, outs, input_manifest([str(src)], tok))
    assert not dataset_is_current(prefix, outs, input_manifest([str(src)], {**tok, "append_eod": False}))
    src.write_text('{"text": "changed"}\n')
    assert not dataset_is_current(prefix, outs, input_manifest([str(src)], tok))


def test_jobs_record_keeps_history(tmp_path):
    run = RunDir(tmp_path).create()
    write_jobs(run, {"executor": "slurm", "stages": {"train": {"job_id": "1"}}})
    write_jobs(run, {"executor": "slurm", "stages": {"train": {"job_id": "2"}}})
    rec = read_json(run.jobs)
    assert rec["stages"]["train"]["job_id"] == "2" and rec["history"][0]["stages"]["train"]["job_id"] == "1"


def test_marker_state_newest_event_wins(tmp_path):
    run = RunDir(tmp_path).create()
    write_marker(run, "train", "started")
    assert marker_state(read_markers(run)["train"]) == "RUNNING?"
    time.sleep(0.01)
    write_marker(run, "train", "requeued", reason="restart 1/3")
    assert marker_state(read_markers(run)["train"]) == "REQUEUED"
    time.sleep(0.01)
    write_marker(run, "train", "started")  # the requeued job started again
    assert marker_state(read_markers(tmp_path)["train"]) == "RUNNING?"


def test_parse_scontrol_line():
    line = ("JobId=57 JobName=hpcmeg-train-x UserId=root(0) JobState=PENDING Reason=BeginTime Dependency=(null) "
            "Requeue=1 Restarts=2 BatchFlag=1 ExitCode=0:0 RunTime=00:00:00 NodeList=(null)")
    (row,) = ST.parse_scontrol(line)
    assert row["JobState"] == "PENDING" and row["Restarts"] == "2" and row["Reason"] == "BeginTime"


def test_parse_squeue_array_tasks_and_noise():
    """``squeue -h -r -o %i|%T|%r|%M|%N`` of array job 123: one entry per real task of THIS job only."""
    text = "\n".join([
        "123_0|RUNNING|None|1:02|node[01-02]",
        "123_1|PENDING|Resources|0:00|",
        "123_[2-3]|PENDING|Priority|0:00|",      # a pending range is no single task
        "1234_5|RUNNING|None|0:01|node03",       # another job whose id starts with ours
        "12_3|RUNNING|None|0:01|node03",
        "99|RUNNING|None|0:01|node04",
        "123_4|RUNNING|None",                    # short (truncated) line
        "squeue: error: Invalid job id specified",
        "",
        " 123_5 |COMPLETING|(null)|2:00|node05",  # padded id, (null) reason
    ])
    assert ST.parse_squeue(text, "123") == {
        "0": {"state": "RUNNING", "reason": "", "elapsed": "1:02", "nodes": "node[01-02]", "source": "squeue"},
        "1": {"state": "PENDING", "reason": "Resources", "elapsed": "0:00", "nodes": "", "source": "squeue"},
        "5": {"state": "COMPLETING", "reason": "", "elapsed": "2:00", "nodes": "node05", "source": "squeue"},
    }
    # a plain (non-array) job answers under the key ""
    assert ST.parse_squeue("77|PENDING|Dependency|0:00|\n", "77") == {
        "": {"state": "PENDING", "reason": "Dependency", "elapsed": "0:00", "nodes": "", "source": "squeue"}}
    assert ST.parse_squeue(None, "123") == {} and ST.parse_squeue("", "123") == {}


def test_parse_sacct_states_and_noise():
    """``sacct -n -P -X -o JobID,State,ExitCode,Elapsed,NodeList``: first word of the state, UNKNOWN when empty."""
    text = "\n".join([
        "123_0|COMPLETED|0:0|00:01:02|node01",
        "123_1|CANCELLED by 0|0:15|00:00:30|node02",
        "123_2||0:0|00:00:00|None assigned",     # empty state
        "123_[3-5]|PENDING|0:0|00:00:00|None assigned",
        "123_0.batch|COMPLETED|0:0|00:01:02|node01",  # a step, not a task
        "1230_1|FAILED|1:0|00:00:01|node09",
        "123_6|FAILED",                          # short line
        "garbled",
    ])
    assert ST.parse_sacct(text, "123") == {
        "0": {"state": "COMPLETED", "exit_code": "0:0", "elapsed": "00:01:02", "nodes": "node01", "source": "sacct"},
        "1": {"state": "CANCELLED", "exit_code": "0:15", "elapsed": "00:00:30", "nodes": "node02", "source": "sacct"},
        "2": {"state": "UNKNOWN", "exit_code": "0:0", "elapsed": "00:00:00", "nodes": "None assigned",
              "source": "sacct"},
    }
    assert ST.parse_sacct("55|OUT_OF_MEMORY|0:125|00:10:00|node7", "55") == {
        "": {"state": "OUT_OF_MEMORY", "exit_code": "0:125", "elapsed": "00:10:00", "nodes": "node7", "source": "sacct"}}
    assert ST.parse_sacct(None, "123") == {} and ST.parse_sacct("", "123") == {}
    # a state field of blanks only: UNKNOWN, not an IndexError
    assert ST.parse_sacct("123_7| |0:0|00:00:00|node3", "123")["7"]["state"] == "UNKNOWN"


def test_status_without_accounting_falls_back_to_markers(tmp_path, monkeypatch, capsys):
    """Slurm does not know the ids (forgotten or never there) and sacct fails: the markers answer."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    (fake / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    assert ST._run(["sacct", "-j", "1"]) is None
    run = RunDir(tmp_path / "run").create()
    ids = {"preprocess": "99999991", "merge": "99999992", "train": "99999993", "convert": "99999994"}
    write_jobs(run, {"executor": "slurm", "stages": {
        "preprocess": {"job_id": ids["preprocess"], "array": 2}, "merge": {"job_id": ids["merge"], "array": None},
        "train": {"job_id": ids["train"], "array": None, "checkpoint_dir": str(tmp_path / "ck"), "train_iters": 40},
        "convert": {"job_id": ids["convert"], "array": None}}})
    for t in (0, 1):
        write_marker(run, "preprocess", "started", task=t)
        write_marker(run, "preprocess", "done", task=t)
    write_marker(run, "merge", "started")
    write_marker(run, "merge", "done")
    write_marker(run, "train", "started")
    time.sleep(0.01)
    write_marker(run, "train", "failed", reason="training stopped at checkpointed iteration 5 of 40: restart cap")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("5")
    st = ST.run_status(run.root)
    got = {s: v["state"] for s, v in st["stages"].items()}
    assert got == {"preprocess": "COMPLETED", "merge": "COMPLETED", "train": "FAILED", "convert": "UNKNOWN"}
    assert all(t["source"] == "markers" for v in st["stages"].values() for t in v["tasks"].values())
    assert "checkpoint iteration 5/40" in st["stages"]["train"]["detail"] and "restart cap" in st["stages"]["train"]["detail"]
    assert not ST.is_final(st)
    # after `hpcmeg cancel` a job that never started is reported CANCELLED
    rec = read_json(run.jobs)
    rec["cancelled_at"] = time.time()
    run.jobs.write_text(json.dumps(rec))
    st = ST.run_status(run.root)
    assert st["stages"]["convert"]["state"] == "CANCELLED" and ST.is_final(st)
    capsys.readouterr()
    # a FAILED stage: exit 1, and the last stderr line (only one) names the cause and `hpcmeg logs`
    assert ST.cli_status(str(run.root)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train FAILED: training stopped at checkpointed iteration 5 of 40: restart cap" in err[0]
    assert f"hpcmeg logs {run.root} --stage train" in err[0]
    assert ST.cli_status(argparse.Namespace(run=str(run.root), json=True)) == 1


def test_logs_select_print_and_follow(tmp_path, capsys):
    run = RunDir(tmp_path).create()
    write_jobs(run, {"executor": "local", "pid": os.getpid(), "stages": {"train": {"job_id": "local"}}})
    d = run.logs("train")
    (d / "train.5.batch.log").write_text("banner\n")
    for r in (0, 1):
        (d / f"train.5.r0.{r}.log").write_text("".join(f"rank {r} line {i}\n" for i in range(100)))
    names = [p.name for p in ST.log_files(tmp_path, "train")]
    assert set(names) == {"train.5.batch.log", "train.5.r0.0.log"}
    assert [p.name for p in ST.log_files(tmp_path, "train", rank=1)] == ["train.5.r0.1.log"]
    assert ST.cli_logs(str(tmp_path), stage="train", rank=1, lines=3) == 0
    out = capsys.readouterr().out
    assert "rank 1 line 99" in out and "rank 1 line 96" not in out and "rank 0" not in out

    def later():  # a restart appears while following
        time.sleep(0.6)
        (d / "train.5.r1.1.log").write_text("after restart\n")
    threading.Thread(target=later).start()
    assert ST.cli_logs(str(tmp_path), follow=True, stage="train", rank=1, lines=0, poll_s=0.2, max_wait_s=2.5) == 0
    out = capsys.readouterr().out
    assert "train.5.r1.1.log" in out and "after restart" in out
    assert ST.cli_logs(str(tmp_path / "nope")) == 2


def test_slurm_ending_writes_its_marker_at_the_first_signal():
    """Slurm SIGKILLs the batch shell KillWait s after SIGTERM (5 s on the local cluster), perhaps before
    the step has finished saving: the supervisor's handler must put what matters on disk at once, once."""
    import signal as sig

    calls = []
    ends = _SlurmEnds(on_first=lambda: calls.append(1))
    ends(sig.SIGTERM, None)
    ends(sig.SIGTERM, None)  # scancel's second TERM, or a requeue's
    assert ends.signal == sig.SIGTERM and calls == [1]
