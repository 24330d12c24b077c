"""What the training loop (hpcmeg/train/trainer.py) carries from one iteration to the next: the log
window's accumulators and the iteration queued on the device whose numbers are not checked yet."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass


class LogWindow:
    """Per-log-interval accumulators (plain floats: TrainStep already returned host values)."""

    def __init__(self, after_resume: bool = False):
        self.after_resume = after_resume  # the first window of a run resumed from a checkpoint
        self.t0 = time.perf_counter()
        self.loss_sum, self.n, self.steps, self.skipped = 0.0, 0, 0, 0
        self.lr = self.grad_norm = self.loss_scale = None

    def add(self, res, lr: float) -> None:
        if not res.skipped or math.isfinite(res.loss):  # an overflowed fp16 forward must not poison the mean
            self.loss_sum += res.loss
            self.n += 1
        self.steps += 1
        self.skipped += int(res.skipped)
        self.lr, self.loss_scale = lr, res.loss_scale
        if not res.skipped:
            self.grad_norm = res.grad_norm


@dataclass
class LoopState:
    """What one iteration of Trainer._run hands to the next."""
    win: LogWindow
    """The current log window."""
    first: int
    """The iteration this run started from."""
    t_iter: float
    """When the previous iteration's host work ended (perf_counter): the step time starts there."""
    pending: tuple | None = None
    """(PendingStep, iteration, lr) queued on the device, its numbers not checked yet."""
    last_reason: str | None = None
    """The latest stop reason this rank gave."""
