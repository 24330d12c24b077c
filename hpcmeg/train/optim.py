"""AdamW construction (param groups, fused implementation choice) and the fp16 loss scaler.

Owns:
  param_groups(model, weight_decay) -> two groups: decayed (matrices and embeddings) and not
    decayed (biases and LayerNorm weights: every tensor with ndim < 2), as Megatron does.
  build_optimizer(model, lr, weight_decay, betas, eps) -> (optimizer, impl name). Choice:
    apex.optimizers.FusedAdam(adam_w_mode=True) when apex imports and params are on CUDA (the
    NGC container), else torch.optim.AdamW(fused=True) on CUDA, AdamW(foreach=True) on CPU.
  DynamicLossScaler: Megatron-style dynamic loss scale for fp16 (initial 2**32, x0.5 on overflow
    after `hysteresis` overflows, x2 after `growth_interval` clean steps, floor `min_scale`).
The LR schedule is not here: the trainer writes param_group["lr"] before each step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable params: weight decay for ndim >= 2 (matrices, embeddings), none otherwise."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() de-duplicates the tied embedding
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    impl: str = "auto") -> tuple[torch.optim.Optimizer, str]:
    """AdamW over `param_groups(model)`; impl 'auto' | 'apex' | 'fused' | 'foreach'."""
    groups = param_groups(model, weight_decay)
    on_cuda = next(model.parameters()).is_cuda
    if impl == "auto":
        impl = "foreach"
        if on_cuda:
            impl = "fused"
            try:
                import apex.optimizers  # noqa: F401  (NGC containers ship apex)
                impl = "apex"
            except ImportError:
                pass
    if impl == "apex":
        from apex.optimizers import FusedAdam
        return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True), "apex.FusedAdam"
    if impl == "fused":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True), "torch.AdamW(fused)"
    if impl == "foreach":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True), "torch.AdamW(foreach)"
    raise ValueError(f"build_optimizer: impl={impl!r}; use auto, apex, fused or foreach")


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
