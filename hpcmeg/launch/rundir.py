"""The run directory: where every stage of one run writes, and what `hpcmeg status/logs/cancel` read.

Layout (all under ``<run.output_root>/<run.name>`` on the shared filesystem)::

    recipe.yaml                 the resolved recipe every stage reads (absolute paths)
    jobs.json                   executor + job ids per stage (+ earlier submissions under "history")
    scripts/<stage>.sbatch      the exact sbatch text submitted (written before submission / by --dry-run)
    scripts/<stage>_step.sh     the srun step each job's supervisor runs (container wrapping lives here)
    logs/<stage>/               <stage>.<jobid>.batch.log   supervisor (batch shell) log, appended
                                <stage>.<jobid>.r<R>.<task>.log  one per task and restart R, appended
    markers/<name>.<event>      JSON {time, job_id, restart, host, ...}; event = started|done|failed|
                                requeued|interrupted; name = stage, or stage.<array task>
    submitit/<stage>/           submitit's pickles (host Python only)
    data/  checkpoints/  hf/    the stages' products (unless the recipe points elsewhere)

Markers make `status` work without Slurm accounting and after `squeue`/`scontrol` forgot a job.
Everything here is plain files written atomically (hpcmeg.fsutil: temp name, fsync, os.replace); no torch import.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hpcmeg.fsutil import write_text_atomic

STAGES = ("preprocess", "merge", "train", "convert")
EVENTS = ("started", "done", "failed", "requeued", "interrupted")


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (pure; nothing is created until asked)."""

    root: Path

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs.json"

    @property
    def scripts(self) -> Path:
        return self.root / "scripts"

    @property
    def markers(self) -> Path:
        return self.root / "markers"

    def logs(self, stage: str) -> Path:
        return self.root / "logs" / stage

    def submitit(self, stage: str) -> Path:
        return self.root / "submitit" / stage

    def sbatch_script(self, stage: str) -> Path:
        return self.scripts / f"{stage}.sbatch"

    def step_script(self, stage: str) -> Path:
        return self.scripts / f"{stage}_step.sh"

    def create(self) -> "RunDir":
        for d in (self.root, self.scripts, self.markers, *(self.logs(s) for s in STAGES)):
            d.mkdir(parents=True, exist_ok=True)
        return self


def write_atomic(path: str | os.PathLike, text: str, mode: Optional[int] = None) -> Path:
    """Write text atomically (hpcmeg.fsutil), creating parent dirs; ``mode`` e.g.
    ``fsutil.executable_mode()`` for step scripts (default: the umask's, fsutil.default_mode)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text, mode=mode)
    return path


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete or fix the file") from None


# ----------------------------------------------------------------------------- job ids


def write_jobs(run: RunDir, record: dict) -> None:
    """Store this submission's job record; an earlier record moves to ``history`` (never lost)."""
    old = read_json(run.jobs, None)
    history = []
    if old:
        history = old.pop("history", [])
        history.append(old)
    write_atomic(run.jobs, json.dumps({**record, "history": history}, indent=2) + "\n")


def read_jobs(run: RunDir) -> dict:
    rec = read_json(run.jobs, None)
    if rec is None:
        raise FileNotFoundError(f"{run.jobs}: no job record; is {run.root} a run directory written by 'hpcmeg submit'?")
    return rec


# ----------------------------------------------------------------------------- markers


def marker_name(stage: str, task: Optional[int] = None) -> str:
    return stage if task is None else f"{stage}.{task}"


def write_marker(run: RunDir, stage: str, event: str, task: Optional[int] = None, **info: Any) -> Path:
    """Record that ``stage`` (array task ``task``) reached ``event`` now; the JSON says who and when."""
    if event not in EVENTS:
        raise ValueError(f"unknown marker event {event!r}")
    body = {"time": time.time(), "host": socket.gethostname(),
            "job_id": os.environ.get("SLURM_JOB_ID"), "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            **info}
    return write_atomic(run.markers / f"{marker_name(stage, task)}.{event}", json.dumps(body) + "\n")


def read_markers(run: RunDir | str | os.PathLike) -> dict[str, dict[str, dict]]:
    """{name: {event: info}} for every marker file (name = stage or stage.task)."""
    run = run if isinstance(run, RunDir) else RunDir(Path(run))
    out: dict[str, dict[str, dict]] = {}
    if not run.markers.is_dir():
        return out
    for p in run.markers.iterdir():
        name, _, event = p.name.rpartition(".")
        if event not in EVENTS or not name:
            continue
        try:
            info = json.loads(p.read_text() or "{}")
        except ValueError:
            info = {}
        out.setdefault(name, {})[event] = info
    return out


def marker_state(events: dict[str, dict]) -> str:
    """The state one marker set implies: the newest event wins (a requeued run that restarted is 'started')."""
    if not events:
        return "UNKNOWN"
    newest = max(events, key=lambda e: (events[e].get("time", 0), EVENTS.index(e)))
    return {"started": "RUNNING?", "done": "COMPLETED", "failed": "FAILED", "requeued": "REQUEUED",
            "interrupted": "INTERRUPTED"}[newest]


# ----------------------------------------------------------------------------- dataset manifest


def manifest_path(prefix: str) -> Path:
    return Path(f"{prefix}.hpcmeg-inputs.json")


def input_manifest(files: list[str], tokenizer: dict) -> dict:
    """What a tokenized dataset was made from: input paths, sizes, mtimes, and the tokenizer settings.

    The dataset is reused only when a fresh manifest equals the stored one (any touched input or a
    different tokenizer setting means preprocessing again)."""
    def stat(p: Optional[str]) -> Optional[list]:
        if not p:
            return None
        st = os.stat(p)
        return [os.path.abspath(p), st.st_size, st.st_mtime_ns]

    tok = dict(tokenizer)
    for k in ("vocab_file", "merge_file"):
        if tok.get(k):
            tok[k] = stat(tok[k])
    return {"inputs": [stat(f) for f in files], "tokenizer": tok}


def dataset_is_current(prefix: str, outputs: list[str], manifest: dict) -> bool:
    """True when every output ``<path>.bin/.idx`` exists and the stored manifest equals ``manifest``."""
    if not all(Path(f"{o}.bin").is_file() and Path(f"{o}.idx").is_file() for o in outputs):
        return False
    stored = read_json(manifest_path(prefix), None)
    return stored == json.loads(json.dumps(manifest))


def write_manifest(prefix: str, manifest: dict) -> Path:
    return write_atomic(manifest_path(prefix), json.dumps(manifest, indent=1) + "\n")
