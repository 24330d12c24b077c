"""An ordered process pool for the data tools that can neither hang nor leave a process behind.

`OrderedPool(work, n, stop)` runs `work(task)` in n worker processes; `pool.map(tasks)` yields the
results IN TASK ORDER with a bounded number of tasks read ahead, so memory does not grow with the input.

Why not multiprocessing.Pool or Queue (what hpcmeg used before, and why it hung):
- A Queue's pipe is shared by every process, and every process (the parent too) holds both of its
  ends, so a reader never sees EOF: a worker blocked in get() waits forever once the parent is gone
  (an orphan), and a parent blocked reading a half-written result from a killed worker waits forever.
- A Queue's feeder thread is joined when a process exits; if the other side stopped reading, exit
  blocks (the parent sat in join() after terminate()).
Here each worker has its OWN socket pair. The parent closes the worker's end after starting it and
each worker closes the parent-side ends it inherited, so the only holders of a pair are the parent
and that one worker: when either dies the other's recv gets EOF (or its send EPIPE) at once.

Protocol: at most IN_FLIGHT (2) tasks per worker, so a worker finds its next task waiting when it
finishes one (it never idles while the parent reads input or writes output). Every send happens in
a sender thread (one per worker in the parent, one in each worker) and every recv in a main thread
that only waits for its peer's sender, so no side ever blocks on a send while the other blocks on a
send: no deadlock, whatever the message sizes (tasks and results of a few hundred kB to MBs, socket buffers ~200 kB).

Stop and failure: the parent polls `stop` at least every POLL_S; on any exception (a StopSignal's
Interrupted, a read error in the task iterator, a worker failure) every worker gets SIGTERM (its
default action, set by faults.worker_process_setup), then SIGKILL if it is still alive after
JOIN_S, each join bounded. Workers also die with the parent (PR_SET_PDEATHSIG) and leave when their
socket reports EOF, so a SIGKILLed parent leaves no worker behind either.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import Callable, Iterable, Iterator

from hpcmeg.data.faults import StopSignal, ToolError, check_stop, signals_blocked, worker_process_setup

POLL_S = 0.5  # longest time between two polls of the stop flag while waiting for workers
JOIN_S = 3.0  # how long a stopped worker (or a sender thread) may take to finish before SIGKILL / giving up
IN_FLIGHT = 2  # tasks sent to one worker and not yet answered: one computing, one waiting


class WorkerError(ToolError):
    """A worker raised or died; the message says on which task."""


class _Sender:
    """Sends the items put() to `conn` from a daemon thread, in order; stops at close() or on a broken
    connection (the peer died: the receiving side sees that as EOF and reports it)."""

    _STOP = object()

    def __init__(self, conn, name: str):
        self.conn, self._q = conn, queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not self._STOP:
            try:
                self.conn.send(item)
            except (OSError, ValueError):  # broken pipe / reset; ValueError: pickling failed (a bug)
                return

    def put(self, item) -> None:
        self._q.put(item)

    def close(self, timeout: float) -> bool:
        """Stop after the queued items; True when the thread ended (only then may conn be closed)."""
        self._q.put(self._STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _worker_main(conn, inherited, parent_pid: int, work) -> None:
    worker_process_setup(parent_pid)
    for c in inherited:  # other workers' and our own parent-side ends (fork copies them all)
        c.close()
    results = _Sender(conn, "hpcmeg-result-sender")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break  # the parent closed our socket (done) or died
        try:
            results.put(("ok", work(task)))
        except Exception as e:  # reported by the parent as one line naming the task
            results.put(("error", (f"{type(e).__name__}: {e}".splitlines() or [""])[0]))
            break
    results.close(JOIN_S)  # let a last error message out; the parent reads it or is gone


class OrderedPool:
    """`with OrderedPool(work, n, stop) as pool: for r in pool.map(tasks, describe): ...` (module docstring).

    work: picklable callable (with the fork start method it is inherited, never pickled).
    describe(task) -> str names a task in error messages ("file.jsonl from line 1201")."""

    def __init__(self, work: Callable, workers: int, stop: StopSignal | None = None, *, name: str = "worker",
                 start_method: str | None = None):
        if workers < 1:
            raise ValueError(f"OrderedPool needs at least one worker, got {workers}")
        self.work, self.n, self.stop, self.name = work, workers, stop, name
        # fork where it exists: workers inherit a loaded tokenizer instead of each loading one
        start_method = start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.forking = start_method == "fork"
        self._ctx = mp.get_context(start_method)
        self._procs: list = []
        self._conns: list = []
        self._senders: list = []

    # -- lifetime ------------------------------------------------------------------------------------
    def __enter__(self) -> "OrderedPool":
        try:
            self._start()
        except BaseException:
            self._stop_all(kill=True)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop_all(kill=exc_type is not None)

    def _start(self) -> None:
        parent_pid = os.getpid()
        for _ in range(self.n):
            mine, theirs = self._ctx.Pipe(duplex=True)
            self._conns.append(mine)
            inherited = list(self._conns) if self.forking else []  # spawn inherits no descriptors
            p = self._ctx.Process(target=_worker_main, args=(theirs, inherited, parent_pid, self.work),
                                  daemon=True, name=f"hpcmeg-{self.name}")
            with signals_blocked():  # see faults.signals_blocked: the child unblocks after its setup
                p.start()
            theirs.close()
            self._procs.append(p)
        # threads only after the last fork: a thread's locks must not be copied into a child mid-use
        self._senders = [_Sender(c, f"hpcmeg-task-sender-{i}") for i, c in enumerate(self._conns)]

    def _stop_all(self, kill: bool) -> None:
        """kill=False (all results are in): EOF tells each worker to return. kill=True: SIGTERM (their
        default action), SIGKILL after JOIN_S. Joins are bounded; a socket is closed only once its
        sender thread has ended (closing an fd under a thread's blocked send could hand the number
        to another file)."""
        if kill:
            for p in self._procs:
                if p.is_alive():
                    p.terminate()
        ended = [s.close(JOIN_S) for s in self._senders]  # a dead peer breaks a blocked send at once
        for c, done in zip(self._conns, ended or [True] * len(self._conns)):
            if done:
                c.close()
        for p in self._procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
                p.join(JOIN_S)  # a process stuck in the kernel (D state) is not waited for beyond this

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- work ----------------------------------------------------------------------------------------
    def map(self, tasks: Iterable, describe: Callable[[object], str] = str, max_in_flight: int | None = None
            ) -> Iterator:
        """Yield work(task) for each task, in order. At most `max_in_flight` (default 2n+2, at least
        IN_FLIGHT*n) tasks are read but not yet yielded: results wait for a slow earlier task there."""
        cap = max(IN_FLIGHT * self.n, max_in_flight or 2 * self.n + 2)
        tasks = iter(tasks)
        sent: dict = {i: collections.deque() for i in range(self.n)}  # worker -> [(seq, description)] in order
        by_conn = {c: i for i, c in enumerate(self._conns)}
        done: dict = {}  # seq -> result, waiting for earlier ones
        read = next_out = 0
        exhausted = False
        while True:
            check_stop(self.stop)
            # hand out tasks: always to the least loaded worker, at most IN_FLIGHT each
            while not exhausted and read - next_out < cap:
                i = min(sent, key=lambda k: len(sent[k]))
                if len(sent[i]) >= IN_FLIGHT:
                    break
                t = next(tasks, _END)
                if t is _END:
                    exhausted = True
                    break
                sent[i].append((read, describe(t)))
                self._senders[i].put(t)
                read += 1
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
                check_stop(self.stop)
            busy = [self._conns[i] for i in sent if sent[i]]
            if not busy:
                if exhausted:
                    return
                continue
            for conn in wait(busy, timeout=POLL_S):
                i = by_conn[conn]
                seq, what = sent[i][0]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    raise self._died(self._procs[i], what) from None
                if kind == "error":
                    raise WorkerError(f"a {self.name} process failed on {what}: {value}; this is a bug in "
                                      "hpcmeg if the input looks fine, please report it with that line")
                sent[i].popleft()  # a worker answers its tasks in the order it got them
                done[seq] = value

    def _died(self, proc, what: str) -> WorkerError:
        """The error for a worker that vanished; Interrupted instead when a stop signal explains it
        (Slurm signals every process of the step: a worker may die before the parent's flag is seen)."""
        proc.join(JOIN_S)
        code = proc.exitcode
        check_stop(self.stop)
        if code is not None and -code in (signal.SIGTERM, signal.SIGINT):
            time.sleep(0.2)  # the same signal is usually on its way to the parent
            check_stop(self.stop)
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited ({code})"
        return WorkerError(f"a {self.name} process {how} while working on {what}; out of memory? "
                           "try fewer --workers, then run again")


_END = object()
