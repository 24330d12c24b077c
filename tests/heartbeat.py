"""The test suite's heartbeat: a pytest plugin that shows which test is running when one runs long.

With `-q` pytest prints one dot per finished test, and some of hpcmeg's tests (Slurm chains, multi-rank
training) run for minutes on 2 cores: the terminal then shows nothing for that long. This plugin
prints, on the terminal pytest started with, a line such as

    [heartbeat] still running: tests/test_demo_slurm.py::test_demo_then_rerun_says_nothing_to_do (1 min 30 s; suite 6 min 2 s)

once a test (its setup, call and teardown; session fixtures included) has run FIRST seconds, and then
every EVERY seconds until it ends; also while collecting. HPCMEG_TEST_HEARTBEAT=FIRST[,EVERY] sets
them (default 30,60; 0 turns the heartbeat off). tests/conftest.py registers it for the suite;
`-p heartbeat` (with tests/ on PYTHONPATH) loads it into any pytest run.

Where it writes: a duplicate of the file descriptor pytest's terminal writes to, taken when pytest
configures (output capture is suspended then), so a line reaches the terminal (or CI's log) even
while the test's own output is being captured. A daemon thread does the waiting; the hooks only
replace one tuple (atomic under the GIL) and only the thread keeps what it printed, so no lock is needed.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

ENV = "HPCMEG_TEST_HEARTBEAT"
DEFAULT = (30.0, 60.0)


def parse(value: str | None) -> tuple[float, float] | None:
    """HPCMEG_TEST_HEARTBEAT's value -> (first, every) seconds, None for off; a bad value is a UsageError."""
    if value is None or value.strip() == "":
        return DEFAULT
    parts = value.split(",")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        nums = []
    if not 1 <= len(nums) <= 2 or any(n < 0 or n != n for n in nums):
        raise pytest.UsageError(f"{ENV}={value!r}: expected FIRST[,EVERY] seconds, e.g. 30,60 (0 turns it off)")
    if nums[0] == 0:
        return None
    every = nums[1] if len(nums) == 2 and nums[1] > 0 else DEFAULT[1]
    return nums[0], every


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


class Heartbeat:
    """The plugin object: what runs now (label, since when) and the thread that reports it."""

    def __init__(self, fd: int, first: float, every: float):
        self.fd = fd
        self.first = first
        self.every = every
        self.suite_start = time.monotonic()
        self.current: tuple[str, float] | None = None  # (label, started): set by the hooks, read by the thread
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pytest-heartbeat", daemon=True)

    def _run(self):
        tick = max(0.05, min(self.first, self.every, 5.0) / 4)
        printed_for, printed_at = None, 0.0  # the thread's own: which `current` it last reported, when
        while not self.stop.wait(tick):
            cur = self.current
            if cur is None:
                continue
            label, started = cur
            now = time.monotonic()
            if printed_for is cur:  # reported already: again every EVERY seconds
                due = printed_at + self.every
            else:
                due = started + self.first
            if now < due:
                continue
            # the first line for a test ends pytest's line of dots; the next ones follow it
            lead = "" if printed_for is cur else "\n"
            printed_for, printed_at = cur, now
            line = (f"{lead}[heartbeat] still running: {label} ({_duration(now - started)}; "
                    f"suite {_duration(now - self.suite_start)})\n")
            try:
                os.write(self.fd, line.encode())
            except OSError:  # the terminal went away: nothing to tell
                return

    def _begin(self, label: str):
        self.current = (label, time.monotonic())

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session):
        self._begin("collecting the tests")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        self.current = None

    def pytest_runtest_logstart(self, nodeid, location):
        self._begin(nodeid)

    def pytest_runtest_logfinish(self, nodeid, location):
        self.current = None

    def pytest_unconfigure(self, config):
        self.current = None
        self.stop.set()
        self.thread.join(timeout=5)
        os.close(self.fd)


def register(config: pytest.Config) -> None:
    """Start the heartbeat for this pytest run, unless HPCMEG_TEST_HEARTBEAT=0 (or it is registered already)."""
    timing = parse(os.environ.get(ENV))
    if timing is None or config.pluginmanager.has_plugin("hpcmeg-heartbeat"):
        return
    try:
        fd = os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is no file (an embedding runner): no heartbeat
        return
    hb = Heartbeat(fd, *timing)
    config.pluginmanager.register(hb, "hpcmeg-heartbeat")
    hb.thread.start()


pytest_configure = register  # `pytest -p heartbeat` loads this module as a plugin
