"""The training loop's waits for the other ranks: how long a collective may wait, and where a rank
says (in its heartbeat) that it waits for the others.

Contract
- `collective_timeout_s(step_s, factor, floor_s)`: the collective timeout for a median step of
  step_s seconds.
- `CollectiveTimeout(ctx, factor, floor_s, long_s)`: the process group starts with 30 minutes (init,
  loading, compiling). `timed(seconds)` is told each completed iteration's wall time; after this
  process's COLLECTIVE_TIMEOUT_AFTER-th it sets collective_timeout_s(median of the last STEP_WINDOW)
  on every group and returns (seconds, median) (else None). `long()` is a context: inside it (saving,
  evaluating) the timeout is max(long_s, that), the short one again after; nothing before the timeout
  was shortened. It nests (a save waits for the previous save).
- `SaveBarrier(barrier, progress, fault, iteration)`: the world barrier a checkpoint save calls
  (hpcmeg/checkpoint/store.py save_checkpoint: one before the shard write, then two around the
  commit). Around each call the rank reports progress("checkpoint", waiting=True) (the heartbeat's
  `waiting`: a rank still writing is then told apart from the ranks waiting for it), and before the
  barrier that follows the shard write (the save's second) it calls fault("checkpoint", iteration)
  (hpcmeg/train/faults.py: a test's injected hang; nothing otherwise). `barrier` is called as given
  at each call.
"""
from __future__ import annotations

import contextlib
import math
import statistics
from typing import Callable

from hpcmeg.heartbeat import STEP_WINDOW  # the median over this many of the last iterations, as the heartbeat's

# The collective timeout once steps are timed: a collective that waits much longer than a step means a
# rank is gone or stuck. 10 x the median step: in a healthy iteration a rank waits for the slowest one
# by a fraction of a step (a GC pause, rank 0's log line, a slow batch). Floor 300 s: a healthy step
# can stall on a parallel filesystem's read for minutes (a metadata server under load), and a small
# model's 0.1 s step must not turn that into a failure.
COLLECTIVE_TIMEOUT_FACTOR = 10.0
COLLECTIVE_TIMEOUT_FLOOR_S = 300.0
# Around a checkpoint save and an evaluation: one rank writing its shard (or all of them, on a slow
# filesystem) or running a long evaluation makes the others wait in the save's barrier for that long;
# the start's 30 minutes again, as every save was allowed before the timeout was shortened.
COLLECTIVE_TIMEOUT_LONG_S = 1800.0
COLLECTIVE_TIMEOUT_AFTER = 3  # iterations of this process: the first one includes compiling and warm-up
_SAVE_WRITE_BARRIER = 2  # save_checkpoint's barrier after the shard write (the first one precedes it)


def collective_timeout_s(step_s: float, factor: float = COLLECTIVE_TIMEOUT_FACTOR,
                         floor_s: float = COLLECTIVE_TIMEOUT_FLOOR_S) -> int:
    """The collective timeout for a median step of step_s seconds: max(factor x step_s, floor_s), whole
    seconds rounded up."""
    return math.ceil(max(factor * step_s, floor_s))


class CollectiveTimeout:
    """This rank's collective timeout (module docstring)."""

    def __init__(self, ctx, factor: float = COLLECTIVE_TIMEOUT_FACTOR, floor_s: float = COLLECTIVE_TIMEOUT_FLOOR_S,
                 long_s: float = COLLECTIVE_TIMEOUT_LONG_S):
        self.ctx, self.factor, self.floor_s, self.long_s = ctx, factor, floor_s, long_s
        self._step_times: tuple[float, ...] = ()  # the last STEP_WINDOW iterations' wall times
        self._steps_timed = 0  # iterations this process completed
        self.short: int | None = None  # seconds, once shortened
        self._long_depth = 0  # nesting of long()

    def timed(self, seconds: float) -> tuple[int, float] | None:
        """One completed iteration's wall time; (timeout set, median step) when it shortened the timeout."""
        self._step_times = (*self._step_times[1 - STEP_WINDOW:], seconds)
        self._steps_timed += 1
        if self._steps_timed != COLLECTIVE_TIMEOUT_AFTER or not self.ctx.distributed:
            return None
        median = statistics.median(self._step_times)
        self.short = collective_timeout_s(median, self.factor, self.floor_s)
        if self._long_depth == 0:
            self.ctx.set_timeout(self.short)
        return self.short, median

    @contextlib.contextmanager
    def long(self):
        short = self.short
        if short is None:
            yield
            return
        if self._long_depth == 0:
            self.ctx.set_timeout(max(self.long_s, short))
        self._long_depth += 1
        try:
            yield
        finally:
            self._long_depth -= 1
            if self._long_depth == 0:
                self.ctx.set_timeout(short)


class SaveBarrier:
    """One save's barrier, reported as a wait (module docstring)."""

    def __init__(self, barrier: Callable[[], None], progress: Callable[..., None],
                 fault: Callable[..., None], iteration: int):
        self.barrier, self.progress, self.fault, self.iteration = barrier, progress, fault, iteration
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == _SAVE_WRITE_BARRIER:
            self.fault("checkpoint", self.iteration)
        self.progress("checkpoint", waiting=True)
        self.barrier()
        self.progress("checkpoint")
