"""`hpcmeg smoke` stopped after it submitted (Ctrl-C, SIGTERM) cancels its jobs; a timeout <= 0 is refused.

On the local Slurm cluster: the real command, a real signal once it has said what it submitted, and
the jobs' states from Slurm afterwards (through `hpcmeg status`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import REPO, hpcmeg_cmd

FINAL = {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO))


def test_a_timeout_that_is_not_positive_is_refused_in_one_line(tmp_path):
    for value in ("-5", "0", "nan"):
        r = subprocess.run([*hpcmeg_cmd(), "smoke", "--profile", "local-slurm", "--output-root", str(tmp_path),
                            "--timeout", value], capture_output=True, text=True, env=_env(), timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("hpcmeg smoke: error: argument --timeout: ") and "positive" in r.stderr, r.stderr
        assert r.stdout == "" and list(tmp_path.iterdir()) == []  # nothing checked, written or submitted


@pytest.mark.slurm
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_smoke_stopped_after_submitting_cancels_its_jobs(slurm_cluster, tmp_path, sig):
    p = subprocess.Popen([*hpcmeg_cmd(), "smoke", "--profile", "local-slurm", "--output-root", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    lines = []
    for line in p.stdout:  # "[smoke  3s] submitted preprocess 12, train 13, convert 14 (...)"
        lines.append(line)
        if "] submitted " in line:
            break
    assert lines and "] submitted " in lines[-1], "".join(lines) + p.stderr.read()
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, (p.returncode, out, err)
    assert f"stopped by {signal.Signals(sig).name}: cancelled the smoke jobs" in out, out
    run = tmp_path / "hpcmeg-smoke"
    deadline = time.time() + 60
    while True:  # every job of the chain ends CANCELLED (or had already ended), none still queued
        st = json.loads(subprocess.run([*hpcmeg_cmd(), "status", str(run), "--json"], capture_output=True,
                                       text=True, env=_env(), timeout=60).stdout)
        states = {k: v["state"] for k, v in st["stages"].items()}
        if all(s in FINAL for s in states.values()) or time.time() > deadline:
            break
        time.sleep(1)
    assert set(states) >= {"preprocess", "train", "convert"} and all(s in FINAL for s in states.values()), states
    assert "CANCELLED" in states.values(), states
