"""Why a stage failed, in one line: the failing task's log path and that task's own error line.

Contract: ``failure_cause(run_dir, stage, tag=None, restart=None) -> Cause | None`` scans the task
logs of one attempt (``logs/<stage>/<stage>.<tag>.r<restart>.<task>.log``; by default the newest
attempt) in task order (rank 0 first) and returns the first task's cause: its last hpcmeg error line
(``hpcmeg train: ...``, ``hpcmeg train [rank 1]: ...``, ``hpcmeg: ...``), else the last line of a
Python traceback. ``Cause.describe(run_dir)`` is the one-line form the console, markers and
``hpcmeg status`` show. ``error_line(line)`` is the pure matcher. ``failure_lines(run_dir, status)``:
(stage, 'stage STATE: cause') for every failed stage of a ``run_status`` result, the cause being the
failed marker's reason (the supervisor stores the cause there), else the logs'. No torch, no Slurm calls.

Why rank 0 first: ranks stopped by ``srun --kill-on-bad-exit`` (or the local executor) after the first
failure print nothing useful, and recipe-level errors are printed by rank 0 only.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpcmeg.launch.job_states import BAD

_HPCMEG = re.compile(r"^hpcmeg(?: [a-z][\w-]*)?(?: \[rank \d+\])?: \S")
_NOT_CAUSE = re.compile(r"^hpcmeg[^:]*: (?:warning|note|wrote|skipped \d+ bad)|\s\|\s")
_PY_ERROR = re.compile(r"^(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt|Exit)\b.*")
_TASK_LOG = re.compile(r"^(?P<stage>[a-z]+)\.(?P<tag>[^.]+)\.r(?P<restart>\d+)\.(?P<task>\d+)\.log$")
_TAIL_BYTES = 256 * 1024


@dataclass(frozen=True)
class Cause:
    stage: str
    task: int
    log: Path
    line: str

    def describe(self, run_dir: str | os.PathLike | None = None) -> str:
        who = f"rank {self.task}" if self.stage == "train" else f"task {self.task}"
        log = self.log
        if run_dir is not None:
            try:
                log = self.log.relative_to(Path(run_dir))
            except ValueError:
                pass
        return f"{who}: {self.line} (log: {log})"


def error_line(line: str) -> bool:
    """True for an hpcmeg error line (not its banner, metric, warning or 'wrote' lines)."""
    return bool(_HPCMEG.match(line)) and not _NOT_CAUSE.search(line)


def _tail_lines(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_BYTES))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def line_cause(lines: list[str]) -> Optional[str]:
    """The last hpcmeg error line, else the exception line that ends the last traceback."""
    for line in reversed(lines):
        if error_line(line.rstrip()):
            return line.strip()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)"):
            for line in lines[i + 1:]:
                if _PY_ERROR.match(line):
                    return line.strip()
            break
    return None


def task_logs(run_dir: str | os.PathLike, stage: str, tag: Optional[str] = None,
              restart: Optional[int] = None) -> list[tuple[int, Path]]:
    """(task, path) of one attempt's task logs; default: the attempt whose logs changed last."""
    d = Path(run_dir) / "logs" / stage
    groups: dict[tuple[str, int], list[tuple[int, Path]]] = {}
    try:
        names = os.listdir(d)
    except OSError:
        return []
    for name in names:
        m = _TASK_LOG.match(name)
        if not m or m["stage"] != stage:
            continue
        groups.setdefault((m["tag"], int(m["restart"])), []).append((int(m["task"]), d / name))
    if tag is not None:
        key = (tag, restart if restart is not None else max((r for t, r in groups if t == tag), default=0))
        chosen = groups.get(key, [])
    elif groups:
        def newest(k):
            return max(_mtime(p) for _, p in groups[k])
        chosen = groups[max(groups, key=newest)]
    else:
        chosen = []
    return sorted(chosen)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def failure_cause(run_dir: str | os.PathLike, stage: str, tag: Optional[str] = None,
                  restart: Optional[int] = None) -> Optional[Cause]:
    for task, path in task_logs(run_dir, stage, tag, restart):
        line = line_cause(_tail_lines(path))
        if line:
            return Cause(stage, task, path, line[:600])
    return None


def failure_lines(run_dir: str | os.PathLike, st: dict) -> list[tuple[str, str]]:
    """(stage, one-line cause) of every failed stage, upstream first; a stage cancelled because an
    earlier one failed is not listed separately."""
    from hpcmeg.launch.rundir import read_markers

    markers = read_markers(Path(run_dir))
    out = []
    for stage, s in st["stages"].items():
        if s["state"] not in BAD or (s["state"] == "CANCELLED" and (out or st.get("cancelled"))):
            continue
        failed = [ev["failed"] for name, ev in markers.items()
                  if (name == stage or name.startswith(stage + ".")) and ev.get("failed", {}).get("reason")]
        if failed:
            text = max(failed, key=lambda e: e.get("time", 0))["reason"]
        else:
            cause = failure_cause(run_dir, stage)
            text = cause.describe(run_dir) if cause else (s.get("detail") or "no error line in its logs")
        out.append((stage, f"{stage} {s['state']}: {text}"))
    return out
