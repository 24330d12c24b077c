"""Megatron's learning-rate / weight-decay schedule, counted in samples (spec: megatron-interop.md §7.2).

Pure and torch-free (the optimizer is duck-typed: anything with `param_groups`), so the recipe's
validation builds the same schedule the trainer runs and refuses what it would refuse.

Contract
- `LRSchedule` holds every quantity in *samples*: warmup_steps, decay_steps, num_steps (samples
  of successful steps so far). The trainer calls `apply(optimizer)` before each step to write the
  current lr and weight decay into the param groups, and `step(global_batch_size)` after each
  optimizer step that was applied (Megatron does not advance the schedule on a skipped fp16 step).
- lr(num_steps):
    warmup (warmup_steps > 0 and num_steps <= warmup_steps): init + (max - init) * num_steps / warmup
    constant: max
    num_steps > decay_steps: min
    else r = (num_steps - warmup) / (decay - warmup); linear: coeff = 1 - r; cosine: 0.5 (cos(pi r) + 1)
    lr = min + coeff * (max - min)
  As in Megatron, the first iteration of a warmup run uses num_steps = 0, i.e. lr = init_lr (0.0).
- `state_dict()` uses Megatron's opt_param_scheduler keys (max_lr, lr_warmup_steps, num_steps,
  lr_decay_style, lr_decay_steps, min_lr, start_wd, end_wd, wd_incr_style, wd_incr_steps).
  `load_state_dict` restores num_steps and refuses a checkpoint whose schedule differs from the
  recipe's (Megatron's default check; change the recipe back, or start a new run).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass
class LRSchedule:
    max_lr: float
    """Peak learning rate (recipe train.lr)."""
    min_lr: float
    """Learning rate after decay_steps samples."""
    warmup_steps: int
    """Linear warmup length in samples."""
    decay_steps: int
    """End of the decay, in samples from the start of training (warmup included)."""
    decay_style: str = "cosine"
    """constant, linear or cosine."""
    init_lr: float = 0.0
    """LR at sample 0 of the warmup (Megatron --lr-warmup-init)."""
    start_wd: float = 0.0
    """Weight decay at sample 0."""
    end_wd: float = 0.0
    """Weight decay at wd_incr_steps samples (equal to start_wd: constant decay)."""
    wd_incr_style: str = "constant"
    """constant, linear or cosine ramp of the weight decay."""
    wd_incr_steps: int = 0
    """Samples over which the weight decay ramps from start_wd to end_wd."""
    num_steps: int = 0
    """Samples consumed so far (advanced by step())."""

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"LRSchedule.decay_style={self.decay_style!r}: use one of {DECAY_STYLES}")
        if self.wd_incr_style not in WD_STYLES:
            raise ValueError(f"LRSchedule.wd_incr_style={self.wd_incr_style!r}: use one of {WD_STYLES}")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"LRSchedule: need 0 <= min_lr ({self.min_lr}) <= max_lr ({self.max_lr})")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError(f"LRSchedule: negative warmup/decay ({self.warmup_steps}, {self.decay_steps})")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"LRSchedule: constant weight decay needs start_wd == end_wd "
                             f"({self.start_wd} != {self.end_wd})")
        if self.decay_style != "constant" and self.decay_steps <= self.warmup_steps:
            # Megatron asserts the same: a decay that ends before warmup does is a recipe error
            raise ValueError(f"LRSchedule: decay span ({self.decay_steps} samples) must be longer than "
                             f"the warmup ({self.warmup_steps} samples)")

    # ------------------------------------------------------------------ values

    def lr(self, num_steps: int | None = None) -> float:
        n = self.num_steps if num_steps is None else num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        r = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        coeff = 1.0 - r if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def wd(self, num_steps: int | None = None) -> float:
        n = self.num_steps if num_steps is None else num_steps
        if self.wd_incr_style == "constant" or self.wd_incr_steps <= 0 or n > self.wd_incr_steps:
            return self.end_wd
        r = n / self.wd_incr_steps
        coeff = r if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def apply(self, optimizer) -> float:
        """Write lr and weight decay into the optimizer's groups; returns the lr.

        Each group gets Megatron's `wd_mult` on first sight: 1 if it was built with weight decay,
        0 for the no-decay group (biases, norms), so those stay at 0 whatever the schedule says."""
        lr, wd = self.lr(), self.wd()
        for g in optimizer.param_groups:
            mult = g.setdefault("wd_mult", 1.0 if g.get("weight_decay", 0.0) != 0.0 else 0.0)
            g["lr"] = lr
            g["weight_decay"] = wd * mult
        return lr

    def step(self, increment: int) -> None:
        """Advance by `increment` samples (the global batch size)."""
        self.num_steps += int(increment)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.warmup_steps, "num_steps": self.num_steps,
                "lr_decay_style": self.decay_style, "lr_decay_steps": self.decay_steps, "min_lr": self.min_lr,
                "start_wd": self.start_wd, "end_wd": self.end_wd, "wd_incr_style": self.wd_incr_style,
                "wd_incr_steps": self.wd_incr_steps}

    def load_state_dict(self, sd: dict, check: bool = True) -> None:
        """Restore num_steps; with check, every other key must equal this schedule's (the recipe's)."""
        if check:
            mine = self.state_dict()
            diff = [f"{k}: checkpoint {sd[k]!r} vs recipe {mine[k]!r}" for k in mine
                    if k != "num_steps" and k in sd and not _same(sd[k], mine[k])]
            if diff:
                raise ValueError("the checkpoint's LR schedule differs from the recipe's (" + "; ".join(diff)
                                 + "); restore the recipe values or start a new run directory")
        self.num_steps = int(sd["num_steps"])


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def schedule_from_recipe(train, global_batch_size: int, train_samples: int) -> LRSchedule:
    """Build the schedule from a recipe's TrainConfig (Megatron's get_optimizer_param_scheduler).

    decay span: lr_decay_iters x GBS, else the whole run (train_samples); warmup:
    lr_warmup_fraction x decay span when set, else lr_warmup_iters x GBS."""
    decay = train.lr_decay_iters * global_batch_size if train.lr_decay_iters else train_samples
    if train.lr_warmup_fraction is not None:
        warmup = int(train.lr_warmup_fraction * decay)
    else:
        warmup = train.lr_warmup_iters * global_batch_size
    return LRSchedule(max_lr=train.lr, min_lr=train.min_lr, warmup_steps=warmup, decay_steps=decay,
                      decay_style=train.lr_decay_style, start_wd=train.weight_decay, end_wd=train.weight_decay,
                      wd_incr_style="constant", wd_incr_steps=train_samples)
