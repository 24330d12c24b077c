"""Fault injection for tests of hang detection: one rank of `hpcmeg train` blocks at a chosen point,
as a rank does whose read from a dead filesystem never returns.

Inert unless the HPCMEG_FAULT environment variable is set: `Faults.from_env` then returns a Faults
with nothing in it, and calling it does nothing. Tests set the variable (on Slurm through the
recipe's cluster.env, which reaches every task) to check that the supervisor names the stuck rank,
its node and its phase, and routes the job around it.

HPCMEG_FAULT: one or more faults separated by ';', each a list of key=value separated by ',':
    rank=R         the global rank that blocks (required)
    at=POINT       where (required):
                     init        early in start-up, before the process group exists (the other ranks
                                 wait for it in the process group's rendezvous)
                     data        in the data fetch of an iteration (before its batches are read)
                     checkpoint  in a save, after this rank wrote its shard (if it writes one),
                                 before the save's barrier that follows the write
    action=block   sleep forever, in small sleeps (signal handlers still run: SIGUSR1 dumps the
                   stack that ends here; SIGTERM is noted and ignored like any stop request, SIGKILL
                   ends it) (required; the only action)
    iteration=N    data and checkpoint: that iteration (the one being read / the one saved); without
                   it, the first one this process reaches
    restart=K      only in the attempt whose $SLURM_RESTART_COUNT is K (unset counts as 0), so the
                   requeued attempt runs clean; without it, every attempt
e.g. HPCMEG_FAULT="rank=1,restart=0,at=init,action=block;rank=1,restart=1,at=data,iteration=8,action=block".
`Faults.from_env(rank, environ)` parses it once, keeping this rank's faults of this attempt; a
malformed value raises ValueError naming the variable. `faults(point, iteration=None)` blocks when
a kept fault matches.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Mapping

ENV = "HPCMEG_FAULT"
POINTS = ("init", "data", "checkpoint")
ACTIONS = ("block",)
_KEYS = ("rank", "at", "action", "iteration", "restart")
_EXAMPLE = "rank=1,restart=0,at=data,iteration=8,action=block"


@dataclass(frozen=True)
class Fault:
    point: str
    iteration: int | None  # None: the first time the point is reached


def _int(key: str, raw: str, spec: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV}: {key}={raw!r} in {spec!r} is not a non-negative integer; e.g. {_EXAMPLE}")
    return value


def parse(text: str) -> list[tuple[int, int | None, Fault]]:
    """[(rank, restart or None, Fault)] of HPCMEG_FAULT's value; ValueError naming the problem."""
    out = []
    for spec in (s.strip() for s in text.split(";")):
        if not spec:
            continue
        kv: dict[str, str] = {}
        for item in spec.split(","):
            key, eq, value = (x.strip() for x in item.partition("="))
            if not eq or key not in _KEYS or key in kv:
                what = "repeated" if key in kv else "not key=value" if not eq else "unknown"
                raise ValueError(f"{ENV}: {item.strip()!r} in {spec!r} is {what}; keys: {', '.join(_KEYS)} "
                                 f"(e.g. {_EXAMPLE})")
            kv[key] = value
        missing = [k for k in ("rank", "at", "action") if k not in kv]
        if missing:
            raise ValueError(f"{ENV}: {spec!r} has no {', '.join(missing)}; e.g. {_EXAMPLE}")
        if kv["at"] not in POINTS:
            raise ValueError(f"{ENV}: at={kv['at']!r} in {spec!r}; use one of {', '.join(POINTS)}")
        if kv["action"] not in ACTIONS:
            raise ValueError(f"{ENV}: action={kv['action']!r} in {spec!r}; use one of {', '.join(ACTIONS)}")
        if kv["at"] == "init" and "iteration" in kv:
            raise ValueError(f"{ENV}: {spec!r}: iteration applies to at=data and at=checkpoint, not init")
        it = _int("iteration", kv["iteration"], spec) if "iteration" in kv else None
        restart = _int("restart", kv["restart"], spec) if "restart" in kv else None
        out.append((_int("rank", kv["rank"], spec), restart, Fault(kv["at"], it)))
    if not out:
        raise ValueError(f"{ENV} is set but holds no fault; unset it, or e.g. {_EXAMPLE}")
    return out


@dataclass(frozen=True)
class Faults:
    """This rank's faults of this attempt; calling it at a point blocks when one matches."""
    rank: int = 0
    faults: tuple[Fault, ...] = ()

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] | None = None) -> "Faults":
        environ = os.environ if environ is None else environ
        text = environ.get(ENV, "")
        if not text.strip():
            return cls(rank)
        restart = _int("SLURM_RESTART_COUNT", environ.get("SLURM_RESTART_COUNT", "0") or "0", "the environment")
        return cls(rank, tuple(f for r, k, f in parse(text) if r == rank and k in (None, restart)))

    def __call__(self, point: str, iteration: int | None = None) -> None:
        for f in self.faults:
            if f.point == point and f.iteration in (None, iteration):
                self._block(point, iteration)

    def _block(self, point: str, iteration: int | None) -> None:
        at = point if iteration is None else f"{point}, iteration {iteration}"
        print(f"hpcmeg train [rank {self.rank}]: {ENV}: blocking at {at} (a test's injected fault)",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(0.1)
