"""tests/heartbeat.py: a pytest run under it names a long-running test on the terminal (past output
capture) once FIRST seconds have passed and again every EVERY seconds, says nothing for a quick test,
names each of the tests that run at once under pytest-xdist, refuses a bad HPCMEG_TEST_HEARTBEAT in one
line; the suite's conftest registers it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import heartbeat

TESTS = Path(__file__).resolve().parent

# The slow test does not sleep a fixed time: it waits (up to 120 s) until the heartbeat has named it
# twice in the run's output file, so the check holds on a loaded machine too.
_CHILD_TESTS = r'''
import os, time

def test_quick():
    pass

def test_slow():
    print("captured output of the slow test")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(os.environ["HB_LOG"]) as f:
            if f.read().count("still running: test_child.py::test_slow") >= 2:
                return
        time.sleep(0.1)
    raise AssertionError("no two heartbeat lines for test_slow in 120 s")
'''

# Under pytest-xdist (the README's `-n 2 --dist loadgroup`): two slow tests in two groups run at once, one
# per worker; each waits until the controller's heartbeat has named it twice (its own id, no "@group").
_CHILD_TESTS_XDIST = r'''
import os, time
import pytest

def _named_twice(name):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(os.environ["HB_LOG"]) as f:
            if f.read().count(f"still running: test_child.py::{name} (") >= 2:
                return
        time.sleep(0.1)
    raise AssertionError(f"no two heartbeat lines for {name} in 120 s")

@pytest.mark.xdist_group("a")
def test_slow_a():
    _named_twice("test_slow_a")

@pytest.mark.xdist_group("b")
def test_slow_b():
    _named_twice("test_slow_b")
'''


def _pytest(tmp_path, value: str, log: Path, tests: str = _CHILD_TESTS, args: tuple = ()):
    (tmp_path / "test_child.py").write_text(tests)
    env = dict(os.environ, HPCMEG_TEST_HEARTBEAT=value, HB_LOG=str(log), PYTHONPATH=str(TESTS))
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "heartbeat",
                               *args, "test_child.py"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=300).returncode


def test_long_test_named_past_capture_quick_one_not(tmp_path):
    log = tmp_path / "out.txt"
    rc = _pytest(tmp_path, "3,1", log)
    text = log.read_text()
    assert rc == 0, text
    lines = [ln for ln in text.splitlines() if ln.startswith("[heartbeat] still running:")]
    assert len(lines) >= 2 and all("test_child.py::test_slow (" in ln and "; suite " in ln for ln in lines), text
    assert "test_quick" not in text  # under FIRST seconds: no line
    assert "captured output of the slow test" not in text  # the test's own output was captured meanwhile


def test_under_xdist_each_running_test_is_named(tmp_path):
    log = tmp_path / "out.txt"
    rc = _pytest(tmp_path, "3,1", log, _CHILD_TESTS_XDIST, ("-n", "2", "--dist", "loadgroup"))
    text = log.read_text()
    assert rc == 0, text
    lines = [ln for ln in text.splitlines() if ln.startswith("[heartbeat] still running:")]
    for name in ("test_slow_a", "test_slow_b"):
        assert sum(f"test_child.py::{name} (" in ln for ln in lines) >= 2, text
    assert "@" not in "".join(lines), text


def test_bad_value_is_one_line(tmp_path):
    log = tmp_path / "out.txt"
    rc = _pytest(tmp_path, "30s", log)
    text = log.read_text()
    assert rc == 4 and "HPCMEG_TEST_HEARTBEAT='30s': expected FIRST[,EVERY] seconds" in text, text
    assert "Traceback" not in text


def test_parse():
    assert heartbeat.parse(None) == heartbeat.DEFAULT == (30.0, 60.0)
    assert heartbeat.parse("5") == (5.0, 60.0) and heartbeat.parse("5,2") == (5.0, 2.0)
    assert heartbeat.parse("0") is None


def test_suite_runs_with_it(pytestconfig):
    on = heartbeat.parse(os.environ.get(heartbeat.ENV)) is not None
    worker = hasattr(pytestconfig, "workerinput")  # under pytest-xdist the controller runs it, not a worker
    assert pytestconfig.pluginmanager.has_plugin("hpcmeg-heartbeat") == (on and not worker)


def test_label_drops_the_xdist_group():
    assert heartbeat._label("tests/test_x.py::test_y@slurm") == "tests/test_x.py::test_y"
    assert heartbeat._label("tests/test_x.py::test_y[a@b]@test_x") == "tests/test_x.py::test_y[a@b]"
    assert heartbeat._label("tests/test_x.py::test_y[a@b]") == "tests/test_x.py::test_y[a@b]"
    assert heartbeat._label("tests/test_x.py::test_y") == "tests/test_x.py::test_y"
