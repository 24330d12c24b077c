"""The training loop's (hpcmeg/train/trainer.py) plain data: what it reads (LoopConfig), counts
(TrainState) and returns (Outcome, TrainingDiverged), its no-op progress and fault hooks, and what it
carries from one iteration to the next: the log window's accumulators and the iteration queued on the
device whose numbers are not checked yet."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from hpcmeg.train.waits import COLLECTIVE_TIMEOUT_FACTOR, COLLECTIVE_TIMEOUT_FLOOR_S, COLLECTIVE_TIMEOUT_LONG_S


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


def no_progress(phase: str, iteration: int | None = None, waiting: bool = False) -> None:
    """The progress report of a run without a heartbeat."""


def no_fault(point: str, iteration: int | None = None) -> None:
    """No injected fault (hpcmeg/train/faults.py)."""


class TrainingDiverged(RuntimeError):
    """Loss or gradient norm became NaN/inf on an applied step."""


@dataclass(frozen=True)
class LoopConfig:
    """What the loop reads (built from the recipe by build.py; the loop never sees the recipe)."""
    train_iters: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    log_interval: int
    eval_interval: int
    eval_iters: int
    save_interval: int
    keep_last: int | None
    async_save: bool
    checkpoint_dir: str
    precision: str
    seed: int
    num_workers: int = 0
    collective_timeout_factor: float = COLLECTIVE_TIMEOUT_FACTOR
    collective_timeout_floor_s: float = COLLECTIVE_TIMEOUT_FLOOR_S
    collective_timeout_long_s: float = COLLECTIVE_TIMEOUT_LONG_S


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


@dataclass
class Outcome:
    status: str
    """'finished' (train_iters reached) or 'preempted' (saved on a stop request; resume me)."""
    iteration: int
    reason: str = ""
