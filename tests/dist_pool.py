"""A pool of gloo processes that lives for the whole test session: started once per world size, run
many cases in it (the idea of torch's MultiProcContinousTest).

Spawning and joining a 2-process gloo group costs ~3-5 s on 2 cores (interpreter start, torch
import, rendezvous); a parallelism test file with 30 cases would spend minutes on it. Here each
world size is started once per session, and a case is one function run on every rank. The ranks
fork from tests/preloaded.py's server, so not even that first start imports torch again.

Contract
- ``DistPool(world).run(fn, *args, timeout=...) -> [result of rank 0, rank 1, ...]``: ``fn`` must be
  a module-level function (pickled by reference; test modules are importable in the workers because
  multiprocessing passes the parent's sys.path) called as ``fn(rank, world, *args)`` on every rank, with the
  default process group already initialised (gloo, ``torch.set_num_threads(1)``). Its return value
  must be picklable (tensors are fine).
- A rank that raises: ``run`` raises AssertionError with every failing rank's traceback. A case that
  does not finish in ``timeout`` seconds (a deadlock): the pool is killed and AssertionError raised;
  the next ``run`` spawns a fresh pool. After any failure the pool is re-spawned, because the other
  ranks may be stuck in a collective the failed rank never joined.
- ``dist_pool(world)`` (the fixture in conftest.py) hands out one pool per world size per session.
"""
from __future__ import annotations

import queue as queue_mod
import socket
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    while True:
        item = tasks.get()
        if item is None:
            break
        case_id, fn, args = item
        try:
            out = (case_id, rank, True, fn(rank, world, *args))
        except BaseException:  # noqa: BLE001 - reported to the parent as text
            out = (case_id, rank, False, traceback.format_exc())
        results.put(out)
    # no destroy_process_group(): it can wait on peers that are already gone; the process just exits


class DistPool:
    def __init__(self, world: int):
        self.world = world
        self._procs: list = []
        self._case = 0

    def _start(self) -> None:
        from preloaded import context

        ctx = context()  # forked from a server that has imported torch (OMP_NUM_THREADS=1 there)
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._procs = [ctx.Process(target=_worker, args=(r, self.world, port, self._tasks[r], self._results),
                                   daemon=True) for r in range(self.world)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 180.0) -> list:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._case += 1
        for q in self._tasks:
            q.put((self._case, fn, args))
        got: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            left = deadline - time.monotonic()
            try:
                case_id, rank, ok, value = self._results.get(timeout=max(left, 0.01))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self.close()
                raise AssertionError(f"{fn.__name__} on {self.world} ranks: no result after {timeout:.0f} s from "
                                     f"ranks {sorted(set(range(self.world)) - set(got))} (dead: {dead}): a deadlock?")
            if case_id == self._case:
                got[rank] = (ok, value)
                if not ok:  # the other ranks may wait forever in a collective this one left
                    deadline = min(deadline, time.monotonic() + 5.0)
            if not any(p.is_alive() for p in self._procs) and len(got) < self.world:
                break
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed or len(got) < self.world:
            self.close()
            text = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(failed.items()))
            missing = sorted(set(range(self.world)) - set(got))
            raise AssertionError(f"{fn.__name__} failed on {self.world} ranks"
                                 + (f" (no result from ranks {missing})" if missing else "") + f"\n{text}")
        return [got[r][1] for r in range(self.world)]

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except Exception:  # noqa: BLE001 - a closed queue of a dead pool
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
