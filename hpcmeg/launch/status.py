"""`hpcmeg status | logs | cancel RUN`: watch, tail and stop a run's job chain.

Contract: ``run_status(run_dir) -> dict`` ({"run_dir", "executor", "stages": {stage: {"job_id",
"state", "tasks": {task: {...}}, "detail"}}, "health": hpcmeg.launch.health's record, whose newest events end the table}); ``cli_status(run, as_json)`` (1 when a stage failed, with one
stderr line naming the failing task's own cause and ``hpcmeg logs``), ``cli_logs(run, follow, stage,
rank, lines)``, ``cli_cancel(run)`` (only jobs not yet final; an ended chain: "nothing to cancel" and
the run is not marked cancelled) return exit codes (following a chain until every job is final is
hpcmeg.launch.watch, which builds on this file). ``parse_squeue/parse_sacct(text, job_id)`` and
``parse_scontrol(text)`` are the pure parsers of the three commands' output (squeue and sacct share one
line loop for their ``|``-separated lines).

Where a job's state comes from, first answer wins per task: ``squeue`` (queued/running), then
``scontrol show job`` (also finished jobs, for MinJobAge ~5 min), then ``sacct`` (needs accounting:
absent or disabled on many clusters), then the marker files the jobs write themselves
(``markers/<stage>[.<task>].<event>``). So status keeps working without accounting and after Slurm
forgot a job; each task says which source answered.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from hpcmeg.launch.causes import failure_lines
from hpcmeg.launch.health import health_lines, read_health
from hpcmeg.launch.job_states import BAD, FINAL
from hpcmeg.launch.rundir import (STAGES, RunDir, marker_state, read_jobs, read_markers, write_atomic)
from hpcmeg.megatron.names import latest_iteration


def _run(cmd: list[str], timeout: float = 30) -> Optional[str]:
    """stdout of a Slurm command, or None when it is missing or fails (no accounting, unknown job...)."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _task_key(job_id: str, full_id: str) -> Optional[str]:
    """'123' -> '' (the job itself); '123_4' -> '4'; anything else (pending ranges '123_[1-3]') -> None."""
    if full_id == job_id:
        return ""
    head, _, tail = full_id.partition("_")
    if head == job_id and tail.isdigit():
        return tail
    return None


def _pipe_rows(text: Optional[str], job_id: str, n_fields: int) -> Iterator[tuple[str, list[str]]]:
    """(task key, fields) of each ``|``-separated squeue/sacct line that belongs to ``job_id``;
    short lines and other jobs' ids (pending ranges '123_[1-3]') are skipped."""
    for line in (text or "").splitlines():
        parts = line.split("|")
        if len(parts) < n_fields:
            continue
        key = _task_key(job_id, parts[0].strip())
        if key is not None:
            yield key, parts


def parse_squeue(text: Optional[str], job_id: str) -> dict[str, dict]:
    """``squeue -o %i|%T|%r|%M|%N`` output -> {task key: info}."""
    return {key: {"state": p[1], "reason": "" if p[2] in ("None", "(null)") else p[2], "elapsed": p[3],
                  "nodes": p[4], "source": "squeue"}
            for key, p in _pipe_rows(text, job_id, 5)}


def parse_sacct(text: Optional[str], job_id: str) -> dict[str, dict]:
    """``sacct -P -o JobID,State,ExitCode,Elapsed,NodeList`` output -> {task key: info}; the state's
    first word only ('CANCELLED by 1000' -> 'CANCELLED')."""
    return {key: {"state": (p[1].split() or ["UNKNOWN"])[0], "exit_code": p[2], "elapsed": p[3],
                  "nodes": p[4], "source": "sacct"}
            for key, p in _pipe_rows(text, job_id, 5)}


def from_squeue(job_id: str) -> dict[str, dict]:
    return parse_squeue(_run(["squeue", "-h", "-r", "-j", job_id, "-o", "%i|%T|%r|%M|%N"]), job_id)


def parse_scontrol(text: str) -> list[dict[str, str]]:
    """``scontrol show job -o`` lines -> one {Key: value} dict per job/array task."""
    rows = []
    for line in text.splitlines():
        row = {}
        for tok in line.split():
            k, eq, v = tok.partition("=")
            if eq:
                row[k] = v
        if row:
            rows.append(row)
    return rows


def from_scontrol(job_id: str) -> dict[str, dict]:
    out = _run(["scontrol", "show", "job", "-o", job_id])
    tasks: dict[str, dict] = {}
    for row in parse_scontrol(out or ""):
        tid = row.get("ArrayTaskId")
        full = f"{row.get('ArrayJobId')}_{tid}" if tid and tid.isdigit() else row.get("JobId", "")
        key = _task_key(job_id, full)
        if key is not None:
            tasks[key] = {"state": row.get("JobState", "UNKNOWN"), "reason": "" if row.get("Reason") == "None" else row.get("Reason", ""),
                          "exit_code": row.get("ExitCode", ""), "restarts": int(row.get("Restarts", "0") or 0),
                          "elapsed": row.get("RunTime", ""), "nodes": row.get("NodeList", ""), "source": "scontrol"}
    return tasks


def from_sacct(job_id: str) -> dict[str, dict]:
    return parse_sacct(_run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State,ExitCode,Elapsed,NodeList"]),
                       job_id)


def from_markers(markers: dict, stage: str, keys: list[str], cancelled: bool) -> dict[str, dict]:
    tasks = {}
    for key in keys:
        ev = markers.get(stage if key == "" else f"{stage}.{key}", {})
        state = marker_state(ev)
        if cancelled and state in ("UNKNOWN", "RUNNING?", "INTERRUPTED", "REQUEUED"):
            state = "CANCELLED"
        last = max(ev.values(), key=lambda i: i.get("time", 0)) if ev else {}
        tasks[key] = {"state": state, "reason": last.get("reason", ""), "source": "markers"}
    return tasks


def _expected_keys(info: dict) -> list[str]:
    n = info.get("array")
    return [str(i) for i in range(n)] if n else [""]


def summarize(tasks: dict[str, dict]) -> str:
    states = [t["state"] for t in tasks.values()]
    if len(set(states)) == 1:
        return states[0]
    for s in ("RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "PENDING"):
        if s in states:
            return s
    bad = [s for s in states if s in BAD]
    return bad[0] if bad else states[0]


def stage_status(stage: str, info: dict, markers: dict, cancelled: bool, executor: str) -> dict:
    job_id = str(info.get("job_id", ""))
    keys = _expected_keys(info)
    tasks: dict[str, dict] = {}
    sources = (from_squeue, from_scontrol, from_sacct) if executor == "slurm" and job_id else ()
    for src in sources:
        missing = [k for k in keys if k not in tasks]
        if not missing:
            break
        got = src(job_id)
        if keys == ["0"] and "" in got:  # a finished one-task array is reported under the bare job id
            got["0"] = got.pop("")
        tasks.update({k: v for k, v in got.items() if k in missing})
    missing = [k for k in keys if k not in tasks]
    if missing:
        tasks.update(from_markers(markers, stage, missing, cancelled))
    if executor == "local" and info.get("pid") and not _alive(int(info["pid"])):
        for t in tasks.values():  # the local chain is gone: what never ended, never will
            if t["state"] == "UNKNOWN":
                t["state"], t["reason"] = "CANCELLED", "never started (an earlier stage did not complete)"
            elif t["state"] in ("RUNNING?", "INTERRUPTED"):
                t["state"] = "CANCELLED" if cancelled else "FAILED"
    st = {"job_id": job_id, "state": summarize(tasks), "tasks": tasks, "detail": ""}
    counts: dict[str, int] = {}
    for t in tasks.values():
        counts[t["state"]] = counts.get(t["state"], 0) + 1
    if len(tasks) > 1:
        st["detail"] = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    if stage == "train":
        t = next(iter(tasks.values()))
        bits = []
        if info.get("checkpoint_dir"):
            it, total = latest_iteration(info["checkpoint_dir"]), info.get("train_iters", "?")
            bits.append(f"checkpoint iteration {it}/{total}" if it is not None else f"checkpoint none yet (0/{total})")
        if t.get("restarts"):
            bits.append(f"restarts {t['restarts']}")
        ev = markers.get("train", {})
        if ev:
            last = max(ev, key=lambda e: ev[e].get("time", 0))
            if ev[last].get("reason"):
                bits.append(f"last: {last}: {ev[last]['reason']}")
        st["detail"] = "; ".join(bits)
    return st


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def run_status(run_dir: str | os.PathLike) -> dict:
    run = RunDir(Path(run_dir))
    rec = read_jobs(run)
    markers = read_markers(run)
    executor = rec.get("executor", "slurm")
    cancelled = bool(rec.get("cancelled_at"))
    stages = {s: stage_status(s, {**info, "pid": rec.get("pid")}, markers, cancelled, executor)
              for s, info in sorted(rec.get("stages", {}).items(), key=lambda kv: STAGES.index(kv[0]))}
    return {"run_dir": str(run.root), "executor": executor, "cancelled": cancelled, "stages": stages,
            "health": read_health(run.root)}


def is_final(status: dict) -> bool:
    return all(s["state"] in FINAL for s in status["stages"].values())


def _args(a, *names):
    """The CLI passes its argparse Namespace; library callers pass plain values."""
    if hasattr(a, "run"):
        return [getattr(a, n, None) for n in names]
    return None


def cli_status(run, as_json: bool = False, quiet: bool = False) -> int:
    """Print the table (or JSON); exit 1 when a stage failed (then, unless ``quiet``, one last line on
    stderr with the failing task's own error line and the ``hpcmeg logs`` command), else 0."""
    if (got := _args(run, "run", "json")) is not None:
        run, as_json = got
    try:
        st = run_status(run)
    except (FileNotFoundError, ValueError) as e:
        print(f"hpcmeg status: {e}", file=sys.stderr)
        return 2
    bad = failure_lines(run, st)
    if as_json:
        print(json.dumps(st, indent=2))
        return 1 if bad else 0
    print(f"run {st['run_dir']} ({st['executor']}{', cancelled' if st['cancelled'] else ''})")
    print(f"{'stage':<11}{'job':<9}{'state':<14}{'source':<10}detail")
    for stage, s in st["stages"].items():
        srcs = sorted({t["source"] for t in s["tasks"].values()})
        reasons = sorted({t.get("reason", "") for t in s["tasks"].values() if t.get("reason") and t["reason"] not in s["detail"]})
        detail = "; ".join(x for x in [s["detail"], *reasons[:2]] if x)
        print(f"{stage:<11}{s['job_id']:<9}{s['state']:<14}{','.join(srcs):<10}{detail}")
    for line in health_lines(st["health"]):
        print(line)
    sys.stdout.flush()
    if bad:
        if not quiet:
            stage, line = bad[0]
            print(f"hpcmeg status: {line}; more: hpcmeg logs {shlex.quote(str(run))} --stage "
                  f"{'preprocess' if stage == 'merge' else stage}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- logs


def log_files(run_dir: str | os.PathLike, stage: Optional[str] = None, rank: Optional[int] = None) -> list[Path]:
    """Log files of a run, oldest first: batch (supervisor) logs and task logs; ``rank`` selects task logs
    of that srun task id (for train: the rank); without it, task logs of task 0 only."""
    run = RunDir(Path(run_dir))
    out = []
    for s in ([stage] if stage else STAGES):
        # --stage preprocess covers merge too: it is the last part of preprocessing
        for st in ([s, "merge"] if stage == "preprocess" else [s]):
            d = run.logs(st)
            if not d.is_dir():
                continue
            for p in d.iterdir():
                if not p.name.endswith(".log"):
                    continue
                is_batch = p.name.endswith(".batch.log")
                task = None if is_batch else p.name[:-4].rsplit(".", 1)[-1]
                if rank is None and (is_batch or task == "0"):
                    out.append(p)
                elif rank is not None and not is_batch and task == str(rank):
                    out.append(p)
    return sorted(set(out), key=lambda p: (p.stat().st_mtime, p.name))


def _tail(path: Path, n: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 256 * 1024))
        data = f.read().decode("utf-8", "replace")
    return data.splitlines()[-n:] if n > 0 else []


def cli_logs(run, follow: bool = False, stage: Optional[str] = None, rank: Optional[int] = None,
             lines: int = 40, poll_s: float = 1.0, max_wait_s: Optional[float] = None) -> int:
    if (got := _args(run, "run", "follow", "stage", "rank", "lines")) is not None:
        run, follow, stage, rank, lines = got
        lines = 40 if lines is None else lines
    root = Path(run)
    if not (root / "jobs.json").exists() and not (root / "logs").is_dir():
        print(f"hpcmeg logs: {run} is not a run directory (no jobs.json, no logs/)", file=sys.stderr)
        return 2
    files = log_files(root, stage, rank)
    offsets: dict[Path, int] = {}
    for p in files:
        print(f"==> {p.relative_to(root)} <==")
        for line in _tail(p, lines):
            print(line)
        offsets[p] = p.stat().st_size
    if not files:
        print(f"(no logs yet under {root / 'logs'}{'/' + stage if stage else ''})")
    if not follow:
        return 0
    t0 = time.time()
    last_check = 0.0
    try:
        while True:
            sys.stdout.flush()
            time.sleep(poll_s)
            for p in log_files(root, stage, rank):  # picks up new files: a restart, the next stage
                size = p.stat().st_size
                off = offsets.get(p)
                if off is None:
                    print(f"==> {p.relative_to(root)} <==")
                    off = 0
                if size > off:
                    with open(p, "rb") as f:
                        f.seek(off)
                        sys.stdout.write(f.read(size - off).decode("utf-8", "replace"))
                offsets[p] = size
            if time.time() - last_check > 5 * poll_s:  # stop following once the whole chain has ended
                last_check = time.time()
                try:
                    if is_final(run_status(root)):
                        return 0
                except (FileNotFoundError, ValueError):
                    pass
            if max_wait_s is not None and time.time() - t0 > max_wait_s:
                return 0
    except KeyboardInterrupt:
        return 0


# ----------------------------------------------------------------------------- cancel


def cli_cancel(run) -> int:
    if (got := _args(run, "run")) is not None:
        (run,) = got
    root = RunDir(Path(run))
    try:
        rec = read_jobs(root)
    except (FileNotFoundError, ValueError) as e:
        print(f"hpcmeg cancel: {e}", file=sys.stderr)
        return 2
    try:
        st = run_status(root.root)
    except (FileNotFoundError, ValueError) as e:
        print(f"hpcmeg cancel: {e}", file=sys.stderr)
        return 2
    states = ", ".join(f"{k} {s['state']}" for k, s in st["stages"].items()) or "no stages recorded"
    if rec.get("executor") == "local":
        pid = rec.get("pid")
        if not (pid and _alive(int(pid))):
            print(f"nothing to cancel: the local chain of {root.root} is not running ({states})")
            return 0
        _mark_cancelled(root, rec)
        os.kill(int(pid), signal.SIGTERM)  # the local chain forwards it to its ranks, which save and exit
        print(f"sent SIGTERM to the local chain (pid {pid})")
        return 0
    live = {k: s for k, s in st["stages"].items() if s["state"] not in FINAL and s.get("job_id")}
    if not live:
        print(f"nothing to cancel: every job of {root.root} has ended ({states})")
        return 0
    _mark_cancelled(root, rec)
    ids = [str(s["job_id"]) for s in live.values()]
    # newest first, so no dependant starts in between
    r = subprocess.run(["scancel", *reversed(ids)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"hpcmeg cancel: scancel failed: {r.stderr.strip()}", file=sys.stderr)
        return 1
    what = ", ".join(f"{k} (job {s['job_id']}, was {s['state']})" for k, s in live.items())
    print(f"cancelled {what} of {root.root}")
    return 0


def _mark_cancelled(root: RunDir, rec: dict) -> None:
    rec["cancelled_at"] = time.time()
    write_atomic(root.jobs, json.dumps(rec, indent=2) + "\n")
