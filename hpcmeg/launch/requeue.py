"""The requeue policy of a train job: requeue again, or give up (restart cap, no-progress loop guard).

Contract: ``decide_requeue(...)`` is the pure policy over the checkpointed iterations (tracker);
``RequeueGuard(state_path, max_restarts, max_no_progress)`` keeps its small state in a JSON file in
the run directory: ``on_start()`` when an attempt starts, ``decide()`` at its end. Used by the Slurm
supervisor and the local executor. No torch import.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from hpcmeg.fsutil import write_text_atomic


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    reason: str
    no_progress_streak: int


def decide_requeue(*, restart_count: int, max_restarts: int, start_iteration: int | None,
                   current_iteration: int | None, no_progress_streak: int, max_no_progress: int,
                   elsewhere: bool = False) -> RequeueDecision:
    """Pure policy. Iterations are the checkpointed ones (tracker), None = no checkpoint yet.
    elsewhere: the next attempt runs without the node this one hung on, so an attempt without
    progress does not count toward max_no_progress (the restart cap still holds)."""
    progressed = (current_iteration if current_iteration is not None else -1) > \
        (start_iteration if start_iteration is not None else -1)
    streak = 0 if progressed else (no_progress_streak if elsewhere else no_progress_streak + 1)
    if restart_count >= max_restarts:
        return RequeueDecision(False, f"restart cap reached ({restart_count} >= max_restarts {max_restarts})", streak)
    if streak >= max_no_progress:
        return RequeueDecision(False, f"no progress: checkpointed iteration stayed at {current_iteration} for "
                                      f"{streak} consecutive attempt(s) (max_no_progress {max_no_progress})", streak)
    what = (f"progress {start_iteration} -> {current_iteration}" if progressed
            else "no progress, the next attempt without the hung node" if elsewhere else f"no progress (streak {streak})")
    return RequeueDecision(True, f"restart {restart_count + 1}/{max_restarts}, {what}", streak)


class RequeueGuard:
    """File-backed wrapper of decide_requeue: call on_start() when an attempt starts, decide() at its end."""

    def __init__(self, state_path: str, max_restarts: int, max_no_progress: int = 2):
        if max_restarts < 0 or max_no_progress < 1:
            raise ValueError("max_restarts must be >= 0 and max_no_progress >= 1")
        self.path, self.max_restarts, self.max_no_progress = state_path, max_restarts, max_no_progress

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except ValueError as e:
            raise ValueError(f"{self.path}: corrupt requeue state ({e}); delete the file to reset it") from None

    def _write(self, st: dict) -> None:
        write_text_atomic(self.path, json.dumps(st))

    def on_start(self, restart_count: int, iteration: int | None) -> None:
        st = self._read()
        st.update(restart_count=restart_count, start_iteration=iteration, started_at=time.time())
        st.setdefault("no_progress_streak", 0)
        self._write(st)

    def decide(self, restart_count: int, iteration: int | None, elsewhere: bool = False) -> RequeueDecision:
        st = self._read()
        d = decide_requeue(restart_count=restart_count, max_restarts=self.max_restarts,
                           start_iteration=st.get("start_iteration"), current_iteration=iteration,
                           no_progress_streak=int(st.get("no_progress_streak", 0)),
                           max_no_progress=self.max_no_progress, elsewhere=elsewhere)
        st.update(no_progress_streak=d.no_progress_streak, last_decision=d.reason, last_iteration=iteration)
        self._write(st)
        return d
