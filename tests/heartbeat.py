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

Under pytest-xdist (`-n 2`, the README's command) it runs in the controller only, which is told of
every test's start and end by the workers (a worker's stdout is /dev/null): several tests run at
once there, each gets its own lines.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

ENV = "HPCMEG_TEST_HEARTBEAT"
COLLECTING = "collecting the tests"
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


def _label(nodeid: str) -> str:
    """The test's id as pytest takes it on the command line: without the "@GROUP" that pytest-xdist's
    --dist loadgroup appends (after the parameters' "]", if any)."""
    head, at, group = nodeid.rpartition("@")
    return head if at and "]" not in group and "::" not in group else nodeid


class Heartbeat:
    """The plugin object: what runs now (labels, since when) and the thread that reports it."""

    def __init__(self, fd: int, first: float, every: float):
        self.fd = fd
        self.first = first
        self.every = every
        self.suite_start = time.monotonic()
        # ((label, started), ...) in start order: replaced whole by the hooks, read by the thread
        self.running: tuple[tuple[str, float], ...] = ()
        self.ended = 0  # tests ended so far (set by the hooks): pytest printed a dot for each since
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pytest-heartbeat", daemon=True)

    def _run(self):
        tick = max(0.05, min(self.first, self.every, 5.0) / 4)
        printed: dict[tuple[str, float], float] = {}  # the thread's own: entry of `running` -> last line's time
        ended_at_last_line = None  # self.ended when the thread last wrote: no dot since if unchanged
        while not self.stop.wait(tick):
            running = self.running
            printed = {e: t for e, t in printed.items() if e in running}
            now = time.monotonic()
            for entry in running:
                label, started = entry
                due = printed[entry] + self.every if entry in printed else started + self.first
                if now < due:
                    continue
                # our line starts on a fresh one: after a dot pytest printed, end its line of dots first
                lead = "" if self.ended == ended_at_last_line else "\n"
                ended_at_last_line = self.ended
                printed[entry] = now
                line = (f"{lead}[heartbeat] still running: {label} ({_duration(now - started)}; "
                        f"suite {_duration(now - self.suite_start)})\n")
                try:
                    os.write(self.fd, line.encode())
                except OSError:  # the terminal went away: nothing to tell
                    return

    def _begin(self, label: str):
        self.running = (*self.running, (label, time.monotonic()))

    def _drop(self, label: str):
        self.running = tuple(e for e in self.running if e[0] != label)

    def _end(self, label: str):
        self._drop(label)
        self.ended += 1

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session):
        self._begin(COLLECTING)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        self._drop(COLLECTING)

    def pytest_runtest_logstart(self, nodeid, location):
        self._drop(COLLECTING)  # xdist's controller collects nothing itself: its workers' first test ends it
        self._begin(_label(nodeid))

    def pytest_runtest_logfinish(self, nodeid, location):
        self._end(_label(nodeid))

    def pytest_unconfigure(self, config):
        self.running = ()
        self.stop.set()
        self.thread.join(timeout=5)
        os.close(self.fd)


def register(config: pytest.Config) -> None:
    """Start the heartbeat for this pytest run, unless HPCMEG_TEST_HEARTBEAT=0 (or it is registered already)."""
    timing = parse(os.environ.get(ENV))
    if timing is None or config.pluginmanager.has_plugin("hpcmeg-heartbeat") or hasattr(config, "workerinput"):
        return  # off, registered already, or a pytest-xdist worker (the controller reports its tests)
    try:
        fd = os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is no file (an embedding runner): no heartbeat
        return
    hb = Heartbeat(fd, *timing)
    config.pluginmanager.register(hb, "hpcmeg-heartbeat")
    hb.thread.start()


pytest_configure = register  # `pytest -p heartbeat` loads this module as a plugin
