"""The fp16 loss scale: Megatron's dynamic loss scaler.

Owns:
  DynamicLossScaler: the scale the step multiplies the loss by under fp16 (initial 2**32, x0.5 on
    overflow after `hysteresis` overflows, x2 after `growth_interval` clean steps, floor
    `min_scale`); `update(found_inf)` after each step, which the caller skips on inf (TrainStep,
    hpcmeg/train/step.py); `state_dict()` / `load_state_dict()` for checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScaler:
    """fp16 dynamic loss scale; `update(found_inf)` after each step, which the caller skips on inf."""

    initial_scale: float = 2.0 ** 32
    """Starting scale (Megatron's --initial-loss-scale default)."""
    growth_interval: int = 1000
    """Clean steps in a row before the scale doubles (Megatron --loss-scale-window)."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is lowered (Megatron --hysteresis)."""
    min_scale: float = 1.0
    """The scale never goes below this (Megatron --min-loss-scale)."""
    backoff_factor: float = 0.5
    growth_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.initial_scale <= 0 or self.min_scale <= 0 or self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"DynamicLossScaler: bad settings {self}")
        self.scale = float(self.initial_scale)
        self._good_steps = 0
        self._hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self._good_steps, self._hysteresis_left = sd["scale"], sd["good_steps"], sd["hysteresis_left"]
