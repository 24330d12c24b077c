"""Preemption and time-limit handling for the trainer: signal flag, cross-rank agreement, wall-time
guard, requeue policy (spec: megatron-interop.md §7.4, slurm-design.md "Preemption/timeout").

Contract:
* ExitSignal installs handlers (default SIGTERM and SIGUSR2; SIGUSR1 is left alone because NCCL and
  other libraries may use it) that only record the signal — no I/O, no collectives in a handler. The
  trainer polls `.received` once per iteration and restores the old handlers at the end.
* agree(flag, all_reduce_max) turns per-rank flags into one decision: a MAX all-reduce means "any rank
  got it", so all ranks save the same iteration and exit together even when Slurm's signal reached only
  some of them (or arrived between two iterations on different sides of the poll).
* WallTimeGuard says "save and exit now" once the time left before the job's end is smaller than
  margin_s + save_factor x (longest save so far) + (longest step so far): the margin grows with what
  was measured, so big checkpoints start early enough. Times are epoch seconds (time.time()).
* RequeueGuard decides whether the supervisor may requeue: restart cap (SLURM_RESTART_COUNT vs
  max_restarts) and a no-progress loop guard (the checkpointed iteration did not advance for
  max_no_progress consecutive attempts). Its state is a small JSON file in the run dir.
No Slurm command runs here except `scontrol show job` in slurm_job_end_time(), and only if present.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Iterable, Mapping

from hpcmeg.fsutil import write_text_atomic

DEFAULT_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class ExitSignal:
    """Flag-only handlers for `signals`; use as a context manager or install()/restore()."""

    def __init__(self, signals: Iterable[int] = DEFAULT_EXIT_SIGNALS):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: signal.Signals | None = None  # first signal seen
        self.received_at: float | None = None  # time.time() of the first signal
        self.count = 0
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.count += 1
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum), time.time()

    def install(self) -> "ExitSignal":
        if self._previous:
            raise RuntimeError("ExitSignal already installed")
        for s in self.signals:
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError as e:  # not the main thread of the main interpreter
                self.restore()
                raise RuntimeError(f"cannot install a handler for {s.name}: {e}; install ExitSignal "
                                   f"from the main thread") from None
        return self

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    @property
    def flag(self) -> bool:
        return self.received is not None

    def __enter__(self) -> "ExitSignal":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


def agree(flag: bool, all_reduce_max: Callable[[int], int]) -> bool:
    """True on every rank iff at least one rank's flag is set (all_reduce_max: MAX over the world)."""
    return bool(all_reduce_max(int(bool(flag))))


def identity_max(x: int) -> int:
    """all_reduce_max for world size 1."""
    return x


def torch_all_reduce_max(group=None, device: str = "cpu") -> Callable[[int], int]:
    """MAX all-reduce of an int over `group` (None = the default world group, chosen by the caller).
    device must be "cuda" for NCCL, "cpu" for gloo."""
    import torch
    import torch.distributed as dist

    def reduce(x: int) -> int:
        t = torch.tensor([int(x)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())
    return reduce


# -------------------------------------------------------------------------------------- wall time

class WallTimeGuard:
    """Decide when to save-and-exit before the job end (end_time_epoch None: never)."""

    def __init__(self, end_time_epoch: float | None, margin_s: float, save_factor: float = 1.5):
        self.end_time = end_time_epoch
        self.margin_s = float(margin_s)
        self.save_factor = float(save_factor)
        self.longest_save_s = 0.0
        self.longest_step_s = 0.0

    def record_save(self, seconds: float) -> None:
        self.longest_save_s = max(self.longest_save_s, float(seconds))

    def record_step(self, seconds: float) -> None:
        self.longest_step_s = max(self.longest_step_s, float(seconds))

    @property
    def effective_margin_s(self) -> float:
        # the trainer keeps one step in flight and agrees on a stop one iteration later, so up to two
        # steps run after the check that fires; then the save must fit: all of it comes out of the margin
        return self.margin_s + self.save_factor * self.longest_save_s + 2 * self.longest_step_s

    def remaining_s(self, now: float | None = None) -> float | None:
        if self.end_time is None:
            return None
        return self.end_time - (time.time() if now is None else now)

    def should_stop(self, now: float | None = None) -> bool:
        left = self.remaining_s(now)
        return left is not None and left < self.effective_margin_s


def parse_scontrol_end_time(text: str) -> float | None:
    """EndTime=YYYY-MM-DDTHH:MM:SS from `scontrol show job` (local time) -> epoch seconds; None if unknown."""
    for tok in text.split():
        if tok.startswith("EndTime="):
            val = tok[len("EndTime="):]
            try:
                return datetime.strptime(val, "%Y-%m-%dT%H:%M:%S").timestamp()
            except ValueError:
                return None  # "Unknown", "None"
    return None


def slurm_job_end_time(env: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> float | None:
    """The job's end time (epoch s): $SLURM_JOB_END_TIME, else `scontrol show job` when scontrol exists
    (it usually does not inside containers: pass the time in from the host instead), else None."""
    env = os.environ if env is None else env
    v = env.get("SLURM_JOB_END_TIME")
    if v:
        try:
            return float(v)
        except ValueError:
            pass
    job = env.get("SLURM_JOB_ID")
    exe = shutil.which("scontrol")
    if not job or exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "job", "-o", job], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_scontrol_end_time(out)


# ---------------------------------------------------------------------------------------- requeue

def slurm_restart_count(env: Mapping[str, str] | None = None) -> int:
    """Slurm increments SLURM_RESTART_COUNT on every requeue of the same job id (absent: 0)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    reason: str
    no_progress_streak: int


def decide_requeue(*, restart_count: int, max_restarts: int, start_iteration: int | None,
                   current_iteration: int | None, no_progress_streak: int, max_no_progress: int) -> RequeueDecision:
    """Pure policy. Iterations are the checkpointed ones (tracker), None = no checkpoint yet."""
    progressed = (current_iteration if current_iteration is not None else -1) > \
        (start_iteration if start_iteration is not None else -1)
    streak = 0 if progressed else no_progress_streak + 1
    if restart_count >= max_restarts:
        return RequeueDecision(False, f"restart cap reached ({restart_count} >= max_restarts {max_restarts})", streak)
    if streak >= max_no_progress:
        return RequeueDecision(False, f"no progress: checkpointed iteration stayed at {current_iteration} for "
                                      f"{streak} consecutive attempt(s) (max_no_progress {max_no_progress})", streak)
    what = f"progress {start_iteration} -> {current_iteration}" if progressed else f"no progress (streak {streak})"
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

    def decide(self, restart_count: int, iteration: int | None) -> RequeueDecision:
        st = self._read()
        d = decide_requeue(restart_count=restart_count, max_restarts=self.max_restarts,
                           start_iteration=st.get("start_iteration"), current_iteration=iteration,
                           no_progress_streak=int(st.get("no_progress_streak", 0)),
                           max_no_progress=self.max_no_progress)
        st.update(no_progress_streak=d.no_progress_streak, last_decision=d.reason, last_iteration=iteration)
        self._write(st)
        return d
