"""`hpcmeg preprocess` never hangs, obeys SIGTERM, and leaves no worker process behind (issue 14 §1).

Every case runs the real CLI as a subprocess under a timeout; a hang fails the test instead of
stalling it. Worker processes are found through /proc (children of the preprocess process) and
checked by pid + start time after the parent exited or was killed.
"""

import gzip
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from hpcmeg.data.corpus import write_stdlib_corpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO)
CLI = [sys.executable, "-m", "hpcmeg.cli"]
linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def _preprocess(*args, timeout=60):
    return subprocess.run([*CLI, "preprocess", *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def _one_line(proc, code, *needles):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _children(pid):
    """{child pid: start time} of `pid` (start time tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
    except OSError:
        return {}
    out = {}
    for k in kids:
        st = _stat(k)
        if st is not None:
            out[k] = st[1]
    return out


def _stat(pid):
    """(state, start time) from /proc/pid/stat, or None if the pid does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


def _alive(procs: dict) -> list:
    """pids of `procs` ({pid: start time}) still running (a zombie has exited: it only awaits reaping)."""
    out = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[1] == start and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def _wait_gone(procs: dict, seconds: float) -> list:
    deadline = time.time() + seconds
    while _alive(procs) and time.time() < deadline:
        time.sleep(0.05)
    return _alive(procs)


@pytest.fixture
def reaper():
    """Things a failing test could leave running: Popen objects and {pid: start time} dicts; killed at teardown."""
    held: list = []
    yield held
    for item in held:
        if isinstance(item, subprocess.Popen):
            if item.poll() is None:
                item.kill()
                item.wait()
        else:
            for pid in _alive(item):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """The issue's reproduction corpus: 12 stdlib files."""
    path = str(tmp_path_factory.mktemp("small") / "c.jsonl")
    write_stdlib_corpus(path, key="content", max_files=12)
    return open(path, "rb").read()


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """The stdlib corpus four times over (~125 MB): on a quiet 2-core machine one copy is tokenized in a
    few seconds, so a SIGTERM sent a moment after tokenizing began could land after the run finished."""
    d = tmp_path_factory.mktemp("big")
    one, path = str(d / "one.jsonl"), str(d / "big.jsonl")
    write_stdlib_corpus(one, key="content", include_tests=False)
    with open(one, "rb") as src, open(path, "wb") as dst:
        data = src.read()
        for _ in range(4):
            dst.write(data)
    os.remove(one)
    return path


def test_truncated_gzip_never_hangs(tmp_path, small_corpus):
    # the exact case (hung 4 of 6 runs): truncated inside the first document, so it is found
    # by the up-front read of the first line; and one truncated two thirds in, found while batches are
    # in flight in the workers (small --batch-bytes), the path where the parent hung in join()
    whole = gzip.compress(small_corpus * 4)
    early, late = tmp_path / "t.jsonl.gz", tmp_path / "late.jsonl.gz"
    early.write_bytes(whole[:3000])
    late.write_bytes(whole[:len(whole) * 2 // 3])
    inputs = sorted(os.listdir(tmp_path))
    for i in range(8):
        for src, extra in ((early, []), (late, ["--batch-bytes", "20000"])):
            p = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "t"), "--json-keys", "content",
                            "--append-eod", "--workers", str(1 + i % 2), *extra)
            line = _one_line(p, 1, str(src), "truncated gzip", "gzip -t")
            assert "line" in line
            assert sorted(os.listdir(tmp_path)) == inputs  # nothing half-written, no temp files


def test_garbage_gzip_and_malformed_json_never_hang(tmp_path, small_corpus):
    rng = random.Random(14)
    good = gzip.compress(small_corpus * 2)
    flipped = bytearray(good)
    for k in range(len(good) // 2, len(good) // 2 + 64):  # corrupt the deflate stream mid-file
        flipped[k] ^= 0xFF
    lines = small_corpus.splitlines(keepends=True) * 3
    cases = {
        "magic.jsonl.gz": (b"\x1f\x8b" + bytes(rng.randrange(256) for _ in range(5000)), "corrupt gzip"),
        "flipped.jsonl.gz": (bytes(flipped), "corrupt gzip"),
        "trailing.jsonl.gz": (good + b"\x00garbage after the gzip member" * 10, "corrupt gzip"),
        "malformed.jsonl": (b"".join(lines[:30]) + b'{"content": "no end\n' + b"".join(lines[30:]),
                            "malformed.jsonl:31: malformed JSON"),
    }
    for name, (data, _) in cases.items():
        (tmp_path / name).write_bytes(data)
    inputs = sorted(os.listdir(tmp_path))
    for i in range(3):
        for name, (_, needle) in cases.items():
            p = _preprocess("--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "o"),
                            "--json-keys", "content", "--workers", str(1 + i % 2), "--batch-bytes", "20000")
            _one_line(p, 1, needle)
            assert sorted(os.listdir(tmp_path)) == inputs


@linux_only
def test_sigterm_stops_cleanly_at_any_point(tmp_path, big_corpus, reaper):
    """SIGTERM before the handler exists, while workers start, and mid-run (to the process only, and to
    the whole process group as Slurm and Ctrl-C do): the run ends promptly, writes nothing, leaves no
    temporary file and no worker."""
    out = tmp_path / "out"
    rng = random.Random(143)
    plans = [("early", 0.0), ("workers", 0.0), ("running", 0.0), ("running", 0.4), ("group", 0.2), ("running", 1.0)]
    for when, extra_delay in plans:
        proc = subprocess.Popen([*CLI, "preprocess", "--input", big_corpus, "--output-prefix", str(out),
                                 "--json-keys", "content", "--workers", "2", "--quiet"], env=ENV,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        workers: dict = {}
        reaper += [proc, workers]
        deadline = time.time() + 60
        while when != "early" and time.time() < deadline and proc.poll() is None:
            workers.update(_children(proc.pid))
            if len(workers) >= 2 and (when == "workers" or any(".tmp" in f for f in os.listdir(tmp_path))):
                break
            time.sleep(0.002)
        assert proc.poll() is None, f"{when}: finished before it could be stopped"
        time.sleep(extra_delay + rng.random() * 0.05)
        workers.update(_children(proc.pid))
        if when == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{when}: preprocess ignored SIGTERM for 30 s")
        # before its handler is installed the default action ends it (-15); afterwards it cleans up and exits 143
        assert proc.returncode in (143, -signal.SIGTERM), (when, proc.returncode, err)
        if proc.returncode == 143:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "stopped by SIGTERM" in lines[0], err
        assert os.listdir(tmp_path) == [], (when, os.listdir(tmp_path))
        assert _wait_gone(workers, 5) == [], f"{when}: worker(s) left running"
        if when != "early":
            assert workers, f"{when}: no worker was seen"


@linux_only
def test_no_worker_outlives_a_killed_parent(tmp_path, big_corpus, reaper):
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "preprocess", "--input", big_corpus, "--output-prefix", str(out),
                             "--json-keys", "content", "--workers", "2", "--quiet"], env=ENV)
    workers: dict = {}
    reaper += [proc, workers]
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and (
            len(workers) < 2 or not any(".tmp" in f for f in os.listdir(tmp_path))):
        workers.update(_children(proc.pid))
        time.sleep(0.005)
    assert proc.poll() is None and len(workers) == 2
    proc.kill()
    proc.wait()
    assert _wait_gone(workers, 5) == []  # PR_SET_PDEATHSIG / EOF on their sockets
    names = os.listdir(tmp_path)
    assert all(".tmp" in n for n in names), names  # SIGKILL cannot clean up, but leaves no loadable pair


@linux_only
def test_a_dead_worker_is_one_line_and_no_hang(tmp_path, big_corpus, reaper):
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "preprocess", "--input", big_corpus, "--output-prefix", str(out),
                             "--json-keys", "content", "--workers", "2", "--quiet"], env=ENV,
                            stderr=subprocess.PIPE, text=True)
    workers: dict = {}
    reaper += [proc, workers]
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and (
            len(workers) < 2 or not any(".tmp" in f for f in os.listdir(tmp_path))):
        workers.update(_children(proc.pid))
        time.sleep(0.005)
    assert proc.poll() is None and len(workers) == 2
    os.kill(min(workers), signal.SIGKILL)  # what the OOM killer does
    _, err = proc.communicate(timeout=30)
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err
    assert "killed by signal 9" in lines[0] and "--workers" in lines[0] and big_corpus in lines[0]
    assert os.listdir(tmp_path) == []
    assert _wait_gone(workers, 5) == []


def test_in_process_pool_yields_in_order_and_stops(tmp_path):
    """OrderedPool directly: order kept with uneven task times, a StopSignal flag ends map() with
    Interrupted and the workers are gone afterwards."""
    from hpcmeg.data.faults import Interrupted, StopSignal
    from hpcmeg.data.workers import OrderedPool

    tasks = [(i, 0.02 * ((i * 7) % 3)) for i in range(40)]
    for method in ("fork", "spawn"):  # spawn: where fork does not exist (the work object is pickled)
        with OrderedPool(_slow_square, 3, name="test worker", start_method=method) as pool:
            assert [r for r in pool.map(tasks, max_in_flight=5)] == [i * i for i, _ in tasks]
            pids = pool.pids()
        assert all(_stat(p) is None or _stat(p)[0] in "ZX" for p in pids)
    stop = StopSignal()
    got = []
    with pytest.raises(Interrupted) as e:
        with OrderedPool(_slow_square, 2, stop, name="test worker") as pool:
            for r in pool.map(tasks):
                got.append(r)
                if len(got) == 5:
                    stop.received = signal.SIGTERM  # what the handler does
    assert got == [i * i for i, _ in tasks[:5]] and e.value.exit_code == 143
    assert all(_stat(p) is None or _stat(p)[0] in "ZX" for p in pool.pids())


def _slow_square(task):
    i, delay = task
    time.sleep(delay)
    return i * i


def test_pool_reports_a_failing_task_by_name():
    from hpcmeg.data.workers import OrderedPool, WorkerError

    with pytest.raises(WorkerError, match=r"failed on task x=0: ZeroDivisionError: division by zero"):
        with OrderedPool(_inverse, 2) as pool:
            list(pool.map([5, 4, 3, 0, 2, 1], describe=lambda t: f"task x={t}"))
    assert all(_stat(p) is None or _stat(p)[0] in "ZX" for p in pool.pids())


def _inverse(x):
    return 1 / x
