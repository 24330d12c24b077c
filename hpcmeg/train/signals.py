"""Preemption and time-limit handling inside the trainer: the signal flag and the wall-time guard
(spec: megatron-interop.md section 7.4, slurm-design.md "Preemption/timeout").

Contract:
* ExitSignal installs handlers (default SIGTERM and SIGUSR2) that only record the signal: no I/O, no
  collectives in a handler. The trainer polls it once per iteration (ranks agree through the
  trainer's all-reduced stop code) and restores the old handlers at the end.
* SIGUSR1 (STACK_DUMP_SIGNAL) is the stack dump the supervisor sends every rank when it finds a hang:
  dump_stacks_on_signal() registers faulthandler for it, which writes every thread's Python stack to
  stderr (the rank log) from C, so it works while the main thread waits in a collective or a read
  and the interpreter cannot run a Python handler. The rank keeps running (not chained to any earlier
  handler, whose default would end the process).
* WallTimeGuard says "save and exit now" once the time left before the job's end is smaller than
  margin_s + save_factor x (longest save so far) + 2 x (longest step so far): the margin grows with
  what was measured, so big checkpoints start early enough. Times are epoch seconds (time.time()).
Where the job's end time comes from (Slurm: hpcmeg/procenv.py) and whether to requeue
(hpcmeg/launch/requeue.py) are decided elsewhere: this file knows nothing of Slurm.
"""
from __future__ import annotations

import faulthandler
import signal
import sys
import time
from typing import Iterable

DEFAULT_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
STACK_DUMP_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal(file=None) -> None:
    """On STACK_DUMP_SIGNAL, write every thread's stack to `file` (default: stderr, the rank log).
    faulthandler writes to a file descriptor: a sys.stderr without one (a caller capturing output
    in memory) falls back to descriptor 2, the process's stderr."""
    if file is None:
        try:
            file = sys.stderr.fileno()
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
            file = 2
    faulthandler.register(STACK_DUMP_SIGNAL, file=file, all_threads=True, chain=False)


def stop_dumping_stacks() -> None:
    """Undo dump_stacks_on_signal: the signal's earlier handler again."""
    faulthandler.unregister(STACK_DUMP_SIGNAL)


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
