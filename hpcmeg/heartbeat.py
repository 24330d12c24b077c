"""The rank heartbeat: each training rank says, in a small file the supervisor reads, where it is.

Owns the heartbeat file format, its writer (`Heartbeat`, used by every rank of `hpcmeg train`) and
its reader (`read_beats`, used by the supervisor on the batch node). hpcmeg/train and hpcmeg/launch
both import this file, so it imports nothing from hpcmeg and no torch (stdlib only).

Contract
- The supervisor sets HPCMEG_HEARTBEAT_DIR (ENV_DIR) in the job step's environment, and optionally
  HPCMEG_HEARTBEAT_S (ENV_INTERVAL, seconds between beats, default 5.0). `Heartbeat.from_env(rank)`
  returns a Heartbeat for that directory, or None when ENV_DIR is unset (nothing is written).
- One file per rank, `rank{rank:05d}.json` in that directory: one JSON object padded with spaces to
  RECORD_BYTES (the last byte a newline), with the fields
      rank, node ($SLURMD_NODENAME, else the host name), pid,
      iteration        the iteration in progress (completed + 1 while training; during init the
                       iteration the run starts from),
      first_iteration  the iteration this process started from (what init reported),
      phase            one of PHASES,
      waiting          true while this rank waits for the other ranks in a barrier or collective
                       outside the training step (the start-up's rendezvous and agreement, a save's
                       barriers, the evaluation's all-reduce): a rank still working in the same phase
                       is the one they wait for (a record without it reads as false),
      since            epoch seconds when this phase (at this iteration, waiting or not) was entered,
      beat             epoch seconds when this record was written,
      step_s           this rank's median wall time of its last STEP_WINDOW completed iterations, or null,
      crc              CRC-32 of the record's JSON without this field (read_beats checks and drops it).
  A fresh `beat` with an old `since` is a rank that is alive but stuck in that phase (the writer is
  a thread: it beats while the main thread waits in a collective or a read); a stale `beat` is a
  rank that stopped (SIGSTOP, a dead node) or exited (phase "done" on a clean exit).
- PHASES in order: "init" comes before the first iteration; inside an iteration "data" (its
  batches), "forward-backward", "optimizer", "sync" (waiting for the device and the ranks'
  agreement) follow each other; "eval" and "checkpoint" come after an iteration; "done" at the end.
  A rank whose (iteration, phase, waiting) is behind the others' (working where they wait) is the
  one they wait for.
- `Heartbeat(directory, rank, interval_s, node)`: start() creates the directory, writes the first
  record (phase init) and starts the daemon writer thread; at(phase, iteration=None, waiting=False) and
  iteration_done(seconds) are the main thread's reports (a few attribute stores, no I/O, no lock);
  close() writes phase done and stops the thread. `read_beats(directory)` -> every rank's record
  that parses, sorted by rank.

Why in place: a record is rewritten with os.pwrite at offset 0 of a file descriptor kept open, never
"temp file, rename". On a parallel filesystem (Lustre, GPFS) a create and a rename are metadata
server operations; thousands of ranks doing two every few seconds load the one server every job on
the cluster shares, while an in-place write of one block goes to the data servers only. The price is
that a reader may see a record half written (POSIX does not make a write and a concurrent read
atomic across clients): the new record's start over the old one's end. Records of one rank differ
in a few digits and usually have the same length, so such a mix often still parses as JSON; the
crc tells it apart. `read_beats` skips a record that does not parse or check, and the next beat
fixes it.
The fixed size makes every write cover the whole previous record, so no truncation is needed.

Why the main thread's reports need no lock: the thread reads one tuple that at() replaces whole (one
attribute store, atomic under the GIL), so it never sees a phase with another phase's `since`.
"""
from __future__ import annotations

import json
import os
import re
import socket
import statistics
import sys
import threading
import time
import zlib
from typing import Mapping

PHASES = ("init", "data", "forward-backward", "optimizer", "sync", "eval", "checkpoint", "done")
ENV_DIR = "HPCMEG_HEARTBEAT_DIR"
ENV_INTERVAL = "HPCMEG_HEARTBEAT_S"
DEFAULT_INTERVAL_S = 5.0
RECORD_BYTES = 512
STEP_WINDOW = 5  # step_s is the median of this many iterations: one slow step (a save's I/O) does not move it
_NODE_CHARS = 200  # a node name longer than this is cut, so a record always fits RECORD_BYTES
_FILE_RE = re.compile(r"^rank(\d+)\.json$")


def beat_path(directory: str | os.PathLike, rank: int) -> str:
    """The heartbeat file of `rank` in `directory`."""
    return os.path.join(os.fspath(directory), f"rank{rank:05d}.json")


def _json(record: dict) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode()


def encode(record: dict) -> bytes:
    """One record as written: compact JSON with its crc, padded with spaces to RECORD_BYTES, the last
    byte a newline."""
    data = _json({**record, "crc": zlib.crc32(_json(record))})
    if len(data) > RECORD_BYTES - 1:
        raise ValueError(f"heartbeat record of {len(data)} bytes does not fit {RECORD_BYTES}: {data[:80]!r}...")
    return data + b" " * (RECORD_BYTES - 1 - len(data)) + b"\n"


def interval_from_env(environ: Mapping[str, str]) -> float:
    """HPCMEG_HEARTBEAT_S as seconds (> 0); unset or empty: DEFAULT_INTERVAL_S."""
    raw = environ.get(ENV_INTERVAL, "")
    if raw.strip() == "":
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV_INTERVAL}={raw!r} is not a positive number of seconds; unset it for "
                         f"{DEFAULT_INTERVAL_S:g} s")
    return value


class Heartbeat:
    """This rank's heartbeat writer (module docstring). Main thread: start, at, iteration_done, close."""

    def __init__(self, directory: str | os.PathLike, rank: int, interval_s: float = DEFAULT_INTERVAL_S,
                 node: str | None = None):
        if not interval_s > 0:
            raise ValueError(f"Heartbeat: interval_s={interval_s!r}; give a positive number of seconds")
        self.directory, self.rank, self.interval_s = os.fspath(directory), int(rank), float(interval_s)
        self.node = (node or socket.gethostname())[:_NODE_CHARS]
        self.path = beat_path(self.directory, self.rank)
        # (phase, iteration, since, first_iteration, waiting): replaced whole by at(), read whole by the thread
        self._where = ("init", 0, time.time(), 0, False)
        self._steps: tuple[float, ...] = ()  # the last STEP_WINDOW iteration times, replaced whole
        self._fd: int | None = None
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_failed = False

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] = os.environ) -> "Heartbeat | None":
        """A Heartbeat (not started) for $HPCMEG_HEARTBEAT_DIR, or None when it is unset or empty."""
        directory = environ.get(ENV_DIR, "")
        if not directory:
            return None
        return cls(directory, rank, interval_from_env(environ),
                   node=environ.get("SLURMD_NODENAME") or socket.gethostname())

    # ------------------------------------------------------------------------- main thread

    def start(self) -> "Heartbeat":
        """Create the directory and the file, write the first record (phase init), start the writer."""
        if self._fd is not None:
            raise RuntimeError("Heartbeat already started")
        os.makedirs(self.directory, exist_ok=True)
        # O_TRUNC once at start: a longer file left by an older writer must not keep a tail
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._pid = os.getpid()  # a process forked after construction writes its own
        self._write()
        self._thread = threading.Thread(target=self._beat, name=f"hpcmeg-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def at(self, phase: str, iteration: int | None = None, waiting: bool = False) -> None:
        """This rank entered `phase` at `iteration` (None: the current one), waiting for the other
        ranks or working. `since` moves only when the phase, the iteration or `waiting` changes. In
        init the iteration given is where the run starts from: first_iteration follows it, and a new
        iteration alone keeps `since`."""
        where, waiting = self._where, bool(waiting)
        it = where[1] if iteration is None else iteration
        if phase == where[0] and it == where[1] and waiting == where[4]:
            return
        if phase not in PHASES:
            raise ValueError(f"heartbeat phase {phase!r}; use one of {', '.join(PHASES)}")
        since = where[2] if phase == where[0] == "init" and waiting == where[4] else time.time()
        self._where = (phase, it, since, it if phase == "init" else where[3], waiting)

    def iteration_done(self, seconds: float) -> None:
        """One completed iteration's wall time (for step_s)."""
        self._steps = (*self._steps[1 - STEP_WINDOW:], float(seconds))

    def close(self) -> None:
        """Write phase done, stop the writer, close the file. Safe to call twice, or unstarted."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None
        if self._fd is not None:
            self.at("done")
            self._write()
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Heartbeat":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------- writer

    def record(self) -> dict:
        """The record as the next beat will write it."""
        phase, iteration, since, first, waiting = self._where
        steps = self._steps
        return {"rank": self.rank, "node": self.node, "pid": self._pid, "iteration": iteration,
                "first_iteration": first, "phase": phase, "waiting": waiting, "since": round(since, 3),
                "beat": round(time.time(), 3),
                "step_s": round(statistics.median(steps), 6) if steps else None}

    def _write(self) -> None:
        try:
            os.pwrite(self._fd, encode(self.record()), 0)
        except OSError as e:
            # the next beat tries again; said once (a full or vanished filesystem would repeat it forever)
            if not self._write_failed:
                self._write_failed = True
                print(f"hpcmeg heartbeat [rank {self.rank}]: cannot write {self.path}: {e}; the supervisor "
                      f"cannot see this rank until it can", file=sys.stderr)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()


def read_beats(directory: str | os.PathLike) -> list[dict]:
    """Every rank's record in `directory` that parses (`waiting` always present), sorted by rank. A
    record caught half written (in-place writes: see the module docstring) is skipped for this read;
    no directory: []."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        if not _FILE_RE.match(name):
            continue
        try:
            with open(os.path.join(directory, name), "rb") as f:
                rec = json.loads(f.read(RECORD_BYTES).decode())
        except (OSError, ValueError):  # gone meanwhile, or torn (UnicodeDecodeError is a ValueError)
            continue
        if not isinstance(rec, dict):
            continue
        crc = rec.pop("crc", None)
        # json keeps the key order and Python's floats round-trip, so the writer's bytes come back
        if crc == zlib.crc32(_json(rec)) and isinstance(rec.get("rank"), int) and rec.get("phase") in PHASES:
            rec["waiting"] = rec.get("waiting") is True  # a record of a writer without the field: false
            out.append(rec)
    return sorted(out, key=lambda r: r["rank"])
