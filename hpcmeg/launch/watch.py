"""What `hpcmeg submit --wait`, `hpcmeg demo` and the local executor print while a chain runs.

Contract:
- ``LogFollower(path)``: ``.new_lines()`` returns the complete lines appended since the last call.
- ``shown(line) -> bool``: the lines worth echoing from a stage's first task (rank 0): training and
  validation lines, checkpoint saves, preprocessing progress, start banners, 'wrote' lines; never a
  traceback or an error line (a failure is reported once, at the end, as one line on stderr).
- ``Ticker(out, heartbeat_s)``: prints ``[m:ss] text`` lines stamped with the time since it started
  and says when it last printed, so a caller can keep the console from going silent.
- ``watch_run(run_dir, poll_s, heartbeat_s) -> exit code``: follows a Slurm chain until every stage
  is final: a line per stage transition (queued with the reason, running on which node, done or
  failed), the rank-0 / task-0 log lines ``shown`` picks from the logs of the stage's current job
  only (never those of an earlier submit's job of the same run), each health event the supervisor
  records meanwhile (a hang, whom it names, the node excluded), and a heartbeat line when nothing else
  was printed for ``heartbeat_s`` (default 10 s, so never 15 s of silence). Ends with the status
  table; when a stage failed, one last line on stderr names the stage, the failing task's own
  error line and log (hpcmeg.launch.causes) and the ``hpcmeg logs`` command. Ctrl-C stops watching
  (the jobs keep running) with exit code 130.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

from hpcmeg.launch.causes import failure_lines, task_logs
from hpcmeg.launch.job_states import FINAL
from hpcmeg.launch.rundir import RunDir
from hpcmeg.launch.status import cli_status, run_status

_SHOWN = re.compile(r"^(iteration \s*\d+/\d+ \||validation at iteration|saved (checkpoint )?iteration|already at "
                    r"iteration|hpcmeg train: .* \| .*process\(es\)|note: |Processed \d+ documents|wrote |"
                    r"hpcmeg convert: wrote|\[hpcmeg local\])")


def shown(line: str) -> bool:
    return bool(_SHOWN.match(line))


class LogFollower:
    """New complete lines of a growing log file (a partial last line waits for its newline)."""

    def __init__(self, path: str | os.PathLike, from_start: bool = True):
        self.path = Path(path)
        self.offset = 0 if from_start else _size(self.path)
        self._partial = b""

    def new_lines(self) -> list[str]:
        size = _size(self.path)
        if size < self.offset:  # truncated or replaced: start over
            self.offset, self._partial = 0, b""
        if size == self.offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _mtime_ns(p: Path) -> int:
    try:
        return p.stat().st_mtime_ns
    except OSError:
        return 0


def clock(seconds: float) -> str:
    """1234.5 -> '20:34'; 4000 -> '1:06:40'."""
    s = int(max(0, seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Ticker:
    def __init__(self, out: Optional[TextIO] = None, heartbeat_s: float = 10.0, t0: Optional[float] = None):
        self.out = out if out is not None else sys.stdout
        self.heartbeat_s = heartbeat_s
        self.t0 = time.time() if t0 is None else t0
        self.last = time.time()

    def say(self, text: str) -> None:
        print(f"[{clock(time.time() - self.t0)}] {text}", file=self.out, flush=True)
        self.last = time.time()

    def quiet_for(self) -> float:
        return time.time() - self.last


# ----------------------------------------------------------------------------- the Slurm chain


def describe_stage(s: dict) -> str:
    """One stage's state for a transition line: 'PENDING (Dependency)', 'RUNNING on node1',
    'FAILED on node1 after 00:00:04', ... (array stages: their counts)."""
    tasks = list(s["tasks"].values())
    state = s["state"]
    if len(tasks) > 1:
        return f"{state} ({s['detail']})" if s.get("detail") else state
    t = tasks[0] if tasks else {}
    if state == "PENDING" and t.get("reason"):
        return f"PENDING ({t['reason']})"
    nodes = t.get("nodes", "")
    ran = nodes not in ("", "None assigned", "(null)", "None")
    if state in ("RUNNING", "COMPLETING") and ran:
        return f"{state} on {nodes}"
    if state != "COMPLETED" and ran and t.get("elapsed"):
        # a job that fails within one Slurm poll is never seen RUNNING: say where and how long it ran
        return f"{state} on {nodes} after {t['elapsed']}"
    return state


def _rank0_log(run_dir: Path, stage: str, job_id: str) -> Optional[Path]:
    """Task 0's log of this job's newest attempt, None until it has one. The stage's folder also holds
    the logs of the jobs an earlier submit of the same run made (a resume by hand): those are not
    this job's news, however recent, so a log counts only when its tag is this job's id (or, for an
    array, the id and a task: '123_4')."""
    logs = task_logs(run_dir, stage)
    if not logs or not job_id:
        return None
    tag = logs[0][1].name.split(".")[1]  # <stage>.<tag>.r<restart>.<task>.log
    return logs[0][1] if tag == job_id or tag.startswith(job_id + "_") else None


def _show_new_log_lines(root: Path, st: dict, started: dict[str, float], followers: dict, tick: Ticker) -> None:
    """The new lines worth showing of every stage that has run (rank 0 / task 0's log)."""
    for stage in started:
        log = _rank0_log(root, stage, str(st["stages"].get(stage, {}).get("job_id", "")))
        if log is not None:
            f = followers.setdefault(log, LogFollower(log))
            for line in f.new_lines():
                if shown(line):
                    tick.say(f"{stage}: {line}")


def watch_run(run_dir: str | os.PathLike, poll_s: float = 5.0, heartbeat_s: float = 10.0,
              out: Optional[TextIO] = None, prog: str = "hpcmeg submit", tick_s: float = 1.0) -> int:
    """See the module docstring. Slurm is asked every ``poll_s`` (squeue/scontrol: cheap, but not to be
    hammered), and every ``tick_s`` for ``poll_s`` after a job's supervisor wrote a marker (a stage
    started or ended: its job is about to change state, and the chain's end is then seen within a
    tick, not up to ``poll_s`` later); the logs are read every ``tick_s`` and the heartbeat is checked
    as often, so the longest silence is about ``heartbeat_s`` plus one Slurm query."""
    root = Path(run_dir)
    tick = Ticker(out, heartbeat_s)
    seen: dict[str, str] = {}
    followers: dict[Path, LogFollower] = {}
    started: dict[str, float] = {}
    st: dict = {"stages": {}}
    next_poll = 0.0
    shown_until = time.time()  # health events: only those that happen while watching
    markers, markers_mtime, eager_until = RunDir(root).markers, None, 0.0
    try:
        while True:
            mtime = _mtime_ns(markers)  # a marker is written by rename: the directory's mtime moves
            if mtime != markers_mtime:
                markers_mtime, eager_until = mtime, time.time() + poll_s
            if time.time() >= next_poll or time.time() < eager_until:
                st = run_status(root)
                next_poll = time.time() + poll_s
                for stage, s in st["stages"].items():
                    desc = describe_stage(s)
                    if seen.get(stage) != desc:
                        seen[stage] = desc
                        tick.say(f"{stage}: {desc}")
                    if s["state"] in ("RUNNING", "COMPLETING") or s["state"] in FINAL:
                        started.setdefault(stage, time.time())
                done = all(s["state"] in FINAL for s in st["stages"].values())
                for e in (st.get("health") or {}).get("events", []):  # a hang found by the supervisor, what it did
                    if e.get("time", 0) > shown_until:
                        tick.say(f"health: {e['line']}")
                        shown_until = e["time"]
            else:
                done = False
            _show_new_log_lines(root, st, started, followers, tick)
            if done:
                break
            if tick.quiet_for() >= heartbeat_s:
                active = [(k, s) for k, s in st["stages"].items() if s["state"] not in FINAL]
                if active:
                    k, s = active[0]
                    since = f", {clock(time.time() - started[k])} so far" if k in started else ""
                    tick.say(f"{k}: still {describe_stage(s)}{since}")
            time.sleep(tick_s)
    except KeyboardInterrupt:
        print(f"\nstopped watching; the jobs keep running: hpcmeg status {shlex.quote(str(root))}",
              file=tick.out, flush=True)
        return 130
    cli_status(str(root), quiet=True)
    bad = failure_lines(root, st)
    if bad:
        stage, line = bad[0]
        print(f"{prog}: {line}; more: hpcmeg logs {shlex.quote(str(root))} --stage "
              f"{'preprocess' if stage == 'merge' else stage}", file=sys.stderr, flush=True)
        return 1
    return 0 if all(s["state"] == "COMPLETED" for s in st["stages"].values()) else 1
