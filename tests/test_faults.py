"""hpcmeg/train/faults.py: HPCMEG_FAULT, the test hook that makes one rank block (tests/test_stuck_slurm.py
uses it on the local Slurm cluster): what it keeps for a rank and an attempt, and what a bad value says."""
from __future__ import annotations

import threading
import time

import pytest

from helpers import TINY_RECIPE
from hpcmeg.train.faults import ENV, Fault, Faults

THREE = "rank=1,restart=0,at=init,action=block; rank=1,restart=1,at=data,iteration=8,action=block;" \
        "rank=0,at=checkpoint,action=block"


def test_a_rank_keeps_its_own_faults_of_this_attempt_and_nothing_without_the_variable():
    assert Faults.from_env(1, {}).faults == () and Faults.from_env(1, {ENV: "  "}).faults == ()
    assert Faults.from_env(1, {ENV: THREE}).faults == (Fault("init", None),)  # no SLURM_RESTART_COUNT: attempt 0
    assert Faults.from_env(1, {ENV: THREE, "SLURM_RESTART_COUNT": "1"}).faults == (Fault("data", 8),)
    assert Faults.from_env(1, {ENV: THREE, "SLURM_RESTART_COUNT": "2"}).faults == ()
    # no restart=: every attempt
    assert Faults.from_env(0, {ENV: THREE, "SLURM_RESTART_COUNT": "5"}).faults == (Fault("checkpoint", None),)
    Faults.from_env(1, {ENV: THREE, "SLURM_RESTART_COUNT": "1"})("data", 7)  # another iteration: returns


def test_a_matching_point_blocks_in_small_sleeps(capfd):
    faults = Faults.from_env(1, {ENV: "rank=1,at=data,iteration=3,action=block"})
    t = threading.Thread(target=faults, args=("data", 3), daemon=True)  # blocks for good: a daemon thread
    t.start()
    time.sleep(0.5)
    assert t.is_alive()
    assert "hpcmeg train [rank 1]: HPCMEG_FAULT: blocking at data, iteration 3 (a test's injected fault)" in \
        capfd.readouterr().err


@pytest.mark.parametrize("value, says", [
    ("rank=1,at=data", "HPCMEG_FAULT: 'rank=1,at=data' has no action; e.g. rank=1,restart=0,at=data"),
    ("rank=1,at=disk,action=block", "HPCMEG_FAULT: at='disk' in 'rank=1,at=disk,action=block'; use one of "
                                    "init, data, checkpoint"),
    ("rank=1,at=data,action=crash", "action='crash' in 'rank=1,at=data,action=crash'; use one of block"),
    ("rank=one,at=data,action=block", "rank='one' in 'rank=one,at=data,action=block' is not a non-negative integer"),
    ("rank=1,at=data,action=block,iteration=-2", "iteration='-2' in"),
    ("rank=1,at=data,action=block,when=now", "'when=now' in 'rank=1,at=data,action=block,when=now' is unknown; "
                                             "keys: rank, at, action, iteration, restart"),
    ("rank=1,rank=2,at=data,action=block", "'rank=2' in 'rank=1,rank=2,at=data,action=block' is repeated"),
    ("rank=1 at=data", "'rank=1 at=data' has no at, action"),  # a comma left out
    ("rank=1,at=init,iteration=3,action=block", "iteration applies to at=data and at=checkpoint, not init"),
    (";", "HPCMEG_FAULT is set but holds no fault"),
])
def test_a_malformed_value_is_one_line_naming_the_variable(value, says):
    with pytest.raises(ValueError) as e:
        Faults.from_env(0, {ENV: value})
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_train_with_a_malformed_value_says_so_in_one_line_and_exits_1(tmp_path, capsys):
    from hpcmeg.recipe import load_recipe
    from hpcmeg.train.entry import train

    recipe = load_recipe(TINY_RECIPE, [f"run.output_root={tmp_path}", "run.name=faulty"])
    assert train(recipe, environ={ENV: "rank=1,at=data,action=explode"}) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hpcmeg train: HPCMEG_FAULT: action='explode' in 'rank=1,at=data,action=explode'; use one of "
                   "block"], err
    assert not (tmp_path / "faulty").exists()  # refused before anything was built or written
