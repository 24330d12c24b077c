"""An ordered process pool for the data tools that can neither hang nor leave a process behind.

`OrderedPool(work, n, stop)` runs `work(task)` in n worker processes; `pool.map(tasks)` yields the
results IN TASK ORDER with a bounded number of tasks in flight, so memory does not grow with the input.

Why not multiprocessing.Pool or Queue (what hpcmeg used before, and why it hung):
- A Queue's pipe is shared by every process, and every process (the parent too) holds both of its
  ends, so a reader never sees EOF: a worker blocked in get() waits forever once the parent is gone
  (an orphan), and a parent blocked reading a half-written result from a killed worker waits forever.
- A Queue's feeder thread is joined when a process exits; if the other side stopped reading, exit
  blocks (the parent sat in join() after terminate()).
Here each worker has its OWN socket pair. The parent closes the worker's end after starting it and
each worker closes the parent-side ends it inherited, so the only holders of a pair are the parent
and that one worker: when either dies the other's recv gets EOF (or its send EPIPE) at once.

Protocol: one task in flight per worker. The parent sends a task only to an idle worker, which is
then blocked in recv, so the parent's send cannot block on a busy worker, and a worker's result
send is read by the parent's wait() loop: no send-send deadlock. The parent reads input ahead while
workers run; a worker is idle only for the pipe round trip (~1 ms per ~1 MB task of ~1 s compute).

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
import signal
import time
from multiprocessing.connection import wait
from typing import Callable, Iterable, Iterator

from hpcmeg.data.faults import StopSignal, ToolError, check_stop, signals_blocked, worker_process_setup

POLL_S = 0.5  # longest time between two polls of the stop flag while waiting for workers
JOIN_S = 3.0  # how long a stopped worker may take to exit before SIGKILL


class WorkerError(ToolError):
    """A worker raised or died; the message says on which task."""


def _worker_main(conn, inherited, parent_pid: int, work) -> None:
    worker_process_setup(parent_pid)
    for c in inherited:  # other workers' and our own parent-side ends (fork copies them all)
        c.close()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed our socket (done) or died
        try:
            result = ("ok", work(task))
        except Exception as e:  # reported by the parent as one line naming the task
            result = ("error", f"{type(e).__name__}: {e}".splitlines()[0])
        try:
            conn.send(result)
        except OSError:
            return  # the parent is gone
        if result[0] == "error":
            return


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

    # -- lifetime ------------------------------------------------------------------------------------
    def __enter__(self) -> "OrderedPool":
        try:
            self._start()
        except BaseException:
            self._kill_all()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._shutdown()
        else:
            self._kill_all()

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

    def _shutdown(self) -> None:
        for c in self._conns:  # EOF tells each idle worker to return
            c.close()
        for p in self._procs:
            p.join(JOIN_S)
        self._kill_all()

    def _kill_all(self) -> None:
        for c in self._conns:
            c.close()
        for p in self._procs:
            if p.is_alive():
                p.terminate()
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
        """Yield work(task) for each task, in order. At most `max_in_flight` (default 2n+2) tasks are
        read but not yet yielded: results wait for a slow earlier task in a bounded buffer."""
        cap = max(self.n, max_in_flight or 2 * self.n + 2)
        tasks = iter(tasks)
        ahead: collections.deque = collections.deque()  # (seq, task) read, not yet sent
        busy: dict = {}  # conn -> (seq, description, proc)
        done: dict = {}  # seq -> result, waiting for earlier ones
        idle = list(zip(self._conns, self._procs))
        read = next_out = 0
        exhausted = False
        while True:
            check_stop(self.stop)
            while not exhausted and read - next_out < cap and len(ahead) <= len(idle):
                t = next(tasks, _END)
                if t is _END:
                    exhausted = True
                else:
                    ahead.append((read, t))
                    read += 1
            while ahead and idle:
                seq, t = ahead.popleft()
                conn, proc = idle.pop()
                busy[conn] = (seq, describe(t), proc)
                try:
                    conn.send(t)
                except OSError:
                    raise self._died(proc, busy[conn][1]) from None
            while next_out in done:
                yield done.pop(next_out)
                next_out += 1
                check_stop(self.stop)
            if exhausted and not busy and not ahead:
                return
            if not busy:
                continue
            for conn in wait(list(busy), timeout=POLL_S):
                seq, what, proc = busy.pop(conn)
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    raise self._died(proc, what) from None
                if kind == "error":
                    raise WorkerError(f"a {self.name} process failed on {what}: {value}; this is a bug in "
                                      "hpcmeg if the input looks fine, please report it with that line")
                done[seq] = value
                idle.append((conn, proc))

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
