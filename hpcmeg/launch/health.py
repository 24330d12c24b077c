"""A training step's health, as the supervisor sees it from the ranks' heartbeats: is it hung, and
which rank is the cause. Pure decisions and the run's health record; no Slurm calls (the supervisor's
answer to a hang is hpcmeg/launch/hang.py).

Contract
- `HangPolicy` (the recipe's cluster.hang_* keys): a step hangs when no rank has advanced (entered
  another phase or iteration, hpcmeg/heartbeat.py) for
    * `startup_s` until some rank has finished an iteration (start-up: build, data index, checkpoint
      load, the first step's compilation),
    * `checkpoint_s` while any rank saves a checkpoint or evaluates,
    * else max(`after_steps` x the slowest rank's median step time, `min_s`).
- `diagnose(beats, world_size, now, started, policy) -> Hang | None` (pure; beats: read_beats' records,
  `started`: when the step was launched, for ranks that never wrote one). The culprits, in order:
    1. ranks without a heartbeat for `stale_s` (stopped or dead: their writer thread stopped too), or
       that never wrote one;
    2. else the ranks furthest behind (lowest iteration, then earliest phase, then working before
       waiting: heartbeat `waiting`): the others went on until they waited for them in a collective;
       so when every rank is in the same phase (a save, start-up), the one still in it is named;
    3. else none: every rank is at the same place (a shared cause: filesystem, network).
  `Hang.line` is the one line the batch log, `hpcmeg status` and `submit --wait` show.
- `died(srun_text, beats) -> [Culprit]`: after a failed step, the rank(s) srun saw die of a signal
  first (its 'task N: Killed' lines in the batch log), with their last phase and iteration.
- The health record `<run_dir>/health.json`: {"events": [{"time", "kind", "line", ...}], "excluded":
  [node, ...]}: `record_event`, `read_health`, `excluded_nodes`. Written atomically by the supervisor
  (one writer: the job's batch shell).
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hpcmeg.fsutil import write_text_atomic
from hpcmeg.heartbeat import PHASES

HEALTH_FILE = "health.json"
_ORDER = {p: i for i, p in enumerate(PHASES)}
_LONG = ("checkpoint", "eval")


@dataclass(frozen=True)
class HangPolicy:
    after_steps: float = 10.0
    min_s: float = 300.0
    startup_s: float = 1800.0
    checkpoint_s: float = 1800.0
    beat_s: float = 5.0

    @property
    def stale_s(self) -> float:
        """A heartbeat older than this: the rank's process is stopped or dead (its writer thread
        beats every beat_s whatever the main thread does; 3 beats of slack for a slow filesystem).
        Shorter than any hang allowance worth having, so a silent rank is named as such."""
        return 4 * self.beat_s

    @classmethod
    def of(cls, d: Optional[dict]) -> "HangPolicy":
        return cls(**(d or {}))


@dataclass(frozen=True)
class Culprit:
    rank: int
    node: str
    phase: str
    iteration: Optional[int]
    why: str


@dataclass(frozen=True)
class Hang:
    phase: str  # where the step is: 'init' (no iteration finished yet), the culprits' phase, ...
    iteration: Optional[int]
    stuck_s: float
    allowance_s: float
    culprits: list[Culprit] = field(default_factory=list)
    others: str = ""

    @property
    def nodes(self) -> list[str]:
        return sorted({c.node for c in self.culprits if c.node})

    @property
    def line(self) -> str:
        where = "at start-up" if self.phase == "init" else f"at iteration {self.iteration}"
        head = f"hang {where}: no rank advanced for {self.stuck_s:.0f} s (allowed {self.allowance_s:.0f} s)"
        if not self.culprits:
            return f"{head}; every rank is {self.others}: no rank is behind the others"
        who = "; ".join(f"rank {c.rank} on {c.node or '?'} {c.why}" for c in self.culprits[:8])
        more = f" (+{len(self.culprits) - 8} more)" if len(self.culprits) > 8 else ""
        return f"{head}; {who}{more}" + (f"; the others wait {self.others}" if self.others else "")


def _where(b: dict) -> str:
    where = "in start-up" if b["phase"] == "init" else f"in {b['phase']} at iteration {b['iteration']}"
    return f"waiting {where}" if b.get("waiting") else where


def _position(b: dict) -> tuple:
    """Where a rank is: a rank still working in a phase is behind one waiting in it for the others."""
    return b.get("iteration") or 0, _ORDER.get(b["phase"], 0), bool(b.get("waiting"))


def allowance(beats: list[dict], policy: HangPolicy) -> float:
    """Seconds without progress that make a hang (module docstring)."""
    steps = [b["step_s"] for b in beats if b.get("step_s")]
    if not steps or any(b["phase"] == "init" for b in beats):
        return policy.startup_s
    if any(b["phase"] in _LONG for b in beats):
        return policy.checkpoint_s
    return max(policy.after_steps * max(steps), policy.min_s)


def diagnose(beats: list[dict], world_size: int, now: float, started: float, policy: HangPolicy) -> Optional[Hang]:
    """The hang, if the step is hung now (see the module docstring)."""
    seen = {b["rank"] for b in beats}
    missing = [r for r in range(world_size) if r not in seen]
    last = max([started, *(b["since"] for b in beats)])
    allowed = allowance(beats, policy) if beats and not missing else policy.startup_s
    stuck = now - last
    if stuck <= allowed:
        return None
    culprits = [Culprit(r, "", "init", None, "never reported (did not start, or died at start)") for r in missing]
    culprits += [Culprit(b["rank"], b.get("node", ""), b["phase"], b.get("iteration"),
                         f"{_where(b)}: no heartbeat for {now - b['beat']:.0f} s (stopped or dead)")
                 for b in beats if now - b["beat"] > policy.stale_s]
    fresh = [b for b in beats if now - b["beat"] <= policy.stale_s]
    if not culprits and fresh:
        pos = {b["rank"]: _position(b) for b in fresh}
        low = min(pos.values())
        if any(p != low for p in pos.values()):
            culprits = [Culprit(b["rank"], b.get("node", ""), b["phase"], b.get("iteration"),
                                f"{_where(b)} for {now - b['since']:.0f} s") for b in fresh if pos[b["rank"]] == low]
    named = {c.rank for c in culprits}
    rest = [b for b in fresh if b["rank"] not in named]
    others = ""
    if rest:
        b = max(rest, key=_position)
        others = _where(dict(b, waiting=False) if culprits else b)  # "the others wait in ..." says it
    if culprits:
        phase, it = culprits[0].phase, culprits[0].iteration
    else:
        phase, it = (rest[0]["phase"], rest[0].get("iteration")) if rest else ("init", None)
    return Hang(phase, it, stuck, allowed, culprits, others)


_SRUN_TASK = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,-]+): (?P<how>.+?)\s*$")
_BY_ITSELF = ("Exited with exit code", "Terminated", "Done")


def _ranks(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def died(srun_text: str, beats: list[dict]) -> list[Culprit]:
    """The rank(s) that ended a failed step by dying of a signal (kill -9, the OOM killer, a crash):
    srun's first 'srun: error: NODE: task N: HOW' line in the batch log, when HOW is not an exit of
    the task's own (an exit code; 'Terminated' is srun stopping the rest after the first). Phase and
    iteration from the rank's last heartbeat. [] when the first task srun reports exited by itself
    (its own error line then says why: hpcmeg.launch.causes)."""
    last = {b["rank"]: b for b in beats}
    for line in srun_text.splitlines():
        m = _SRUN_TASK.match(line.strip())
        if not m:
            continue
        if m["how"].startswith(_BY_ITSELF):
            return []
        out = []
        for r in _ranks(m["tasks"]):
            b = last.get(r)
            where = f" {_where(b)}" if b else ""
            out.append(Culprit(r, m["node"], b["phase"] if b else "?", b.get("iteration") if b else None,
                               f"died{where} ({m['how']}: a signal, not an error of its own; kill -9, the OOM "
                               f"killer or a crash)"))
        return out
    return []


# ------------------------------------------------------------------------------ the health record


def read_health(run_dir: str | os.PathLike) -> dict:
    try:
        with open(Path(run_dir) / HEALTH_FILE) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {"events": [], "excluded": []}
    return {"events": list(d.get("events") or []), "excluded": list(d.get("excluded") or [])}


def record_event(run_dir: str | os.PathLike, kind: str, line: str, excluded: Optional[list[str]] = None,
                 **info) -> dict:
    """Append one event (kind: hang | dead | straggler | excluded | note) and, when given, the job's
    excluded nodes now; returns the record."""
    d = read_health(run_dir)
    d["events"].append({"time": time.time(), "kind": kind, "line": line, **info})
    d["events"] = d["events"][-50:]  # a bounded file: the newest events
    if excluded is not None:
        d["excluded"] = sorted(set(excluded))
    write_text_atomic(str(Path(run_dir) / HEALTH_FILE), json.dumps(d, indent=1))
    return d


def excluded_nodes(run_dir: str | os.PathLike) -> list[str]:
    return read_health(run_dir)["excluded"]


def last_event(run_dir: str | os.PathLike, since: float = 0.0) -> Optional[dict]:
    ev = [e for e in read_health(run_dir)["events"] if e.get("time", 0) >= since]
    return ev[-1] if ev else None


def health_lines(record: dict, last: int = 3) -> list[str]:
    """`hpcmeg status`'s lines: the newest events (hangs, dead ranks, what the supervisor did) and the
    train job's excluded nodes."""
    lines = [f"health: {e['line']}" for e in record.get("events", [])[-last:]]
    if record.get("excluded"):
        lines.append(f"health: the train job excludes {', '.join(record['excluded'])} (a rank hung or died there)")
    return lines
