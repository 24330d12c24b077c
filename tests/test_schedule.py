"""Megatron's LR schedule counted in samples (hpcmeg/megatron/lr_schedule.py)."""
from __future__ import annotations

import math

import pytest
import torch

from hpcmeg.recipe import load_recipe
from hpcmeg.megatron.lr_schedule import LRSchedule, schedule_from_recipe

MEGATRON_KEYS = {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
                 "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"}


def sched(style="cosine", warmup=100, decay=1000, max_lr=1e-3, min_lr=1e-4):
    return LRSchedule(max_lr=max_lr, min_lr=min_lr, warmup_steps=warmup, decay_steps=decay, decay_style=style)


def test_warmup_is_linear_from_zero_and_first_iteration_uses_init_lr():
    s = sched()
    assert s.lr(0) == 0.0  # Megatron: iteration 1 of a warmup run trains at lr_warmup_init
    assert s.lr(25) == pytest.approx(0.25e-3)
    assert s.lr(100) == pytest.approx(1e-3)


@pytest.mark.parametrize("style,mid", [("cosine", 0.5 * (1e-3 + 1e-4)), ("linear", 0.5 * (1e-3 + 1e-4)),
                                       ("constant", 1e-3)])
def test_decay_styles(style, mid):
    s = sched(style)
    assert s.lr(550) == pytest.approx(mid)  # halfway through the decay span
    end = 1e-3 if style == "constant" else 1e-4
    assert s.lr(1000) == pytest.approx(end)
    assert s.lr(10_000) == pytest.approx(end)  # past the decay: min_lr (constant stays at max)


def test_cosine_matches_formula_at_quarter():
    s = sched("cosine")
    r = (325 - 100) / 900
    assert s.lr(325) == pytest.approx(1e-4 + 0.5 * (math.cos(math.pi * r) + 1) * 9e-4)
    assert s.lr(325) > sched("linear").lr(325)  # cosine stays higher early on


def test_from_recipe_counts_in_samples():
    r = load_recipe("recipes/codeparrot_tiny.yaml")  # 200 iters x 8 samples, warmup 20 iters
    s = schedule_from_recipe(r.train, r.train.global_batch_size, 200 * 8)
    assert (s.warmup_steps, s.decay_steps) == (160, 1600)
    r2 = load_recipe("recipes/codeparrot_tiny.yaml", ["train.lr_warmup_fraction=0.25", "train.lr_decay_iters=100"])
    s2 = schedule_from_recipe(r2.train, 8, 1600)
    assert (s2.warmup_steps, s2.decay_steps) == (200, 800)


def test_state_dict_has_megatron_keys_and_resumes():
    s = sched()
    for _ in range(7):
        s.step(16)
    sd = s.state_dict()
    assert set(sd) == MEGATRON_KEYS and sd["num_steps"] == 112
    s2 = sched()
    s2.load_state_dict(sd)
    assert s2.lr() == s.lr() and s2.num_steps == 112
    with pytest.raises(ValueError, match="max_lr"):
        sched(max_lr=2e-3).load_state_dict(sd)


def test_apply_keeps_no_decay_group_at_zero():
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}])
    s = LRSchedule(max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="linear",
                   start_wd=0.1, end_wd=0.1)
    s.step(5)
    assert s.apply(opt) == pytest.approx(0.5)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.5)] * 2
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="longer than the warmup"):
        sched(warmup=100, decay=50)
    with pytest.raises(ValueError, match="decay_style"):
        sched("exponential")
