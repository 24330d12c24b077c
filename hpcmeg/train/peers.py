"""A failure on any rank of `hpcmeg train` reaches every rank: the failed rank prints its own line, the
others stop with one line naming it (no traceback from a collective that lost its peer).

Why the rendezvous store and not a collective: a rank that fails during start-up may have skipped a
collective the others are already waiting in (the data barrier, the checkpoint agreement); a second
collective there would never match, and gloo and NCCL wait out the process-group timeout (30 min). The
TCPStore that torch.distributed started with (served by rank 0's process) answers every rank whatever
collective it is in, and still answers after a rank destroyed its process group.

Protocol (keys under hpcmeg/train/, one set per rendezvous: torchrun's restarts get their own prefix)
- A failing rank takes an ordinal n = add("failures", 1) and sets "failure/<n>" to
  "<rank>\\t<exit code>\\t<its lines>". Rank 0 prints its lines; another rank prints its own unless
  rank 0 records the same ones within SAME_WAIT_S (a recipe problem every rank finds is printed once,
  by rank 0, whose log is the one `hpcmeg status` reads first); during start-up rank 0's "rank0/ok"
  key, set when it ends its start-up without a failure, cuts that wait short.
- Start-up agreement (`startup_done`): every rank ends start-up by add("started", 1), the failed ones
  too (after their failure is recorded); the add that reaches the world size sets "started/all".
  A rank that built everything waits for that key (one wait per rank; a failed rank never blocks it),
  then reads the failure count: any failure raises PeerFailed before the first training step.
- A rank whose collective failed (`peer_failures`): a peer that failed records it before its process
  group goes away, so the record is polled for up to PEER_WAIT_S.
- A rank that learnt of a failure adds 1 to "read" once it has printed its line (`acknowledge`). A
  rank that failed waits (`linger`) until read + failures reach the world size, at most LINGER_S,
  before it exits: srun --kill-on-bad-exit (and the local executor) stop the other ranks as soon as
  one exits non-zero, which would cut their line off; rank 0 also serves the store meanwhile.
- Rank 0's process serves the store, so it leaves last (`close`): every other rank adds 1 to "done"
  when it stops using the store, and rank 0, when any failure was recorded, waits for the others'
  "done" (at most PEER_WAIT_S) before it exits. A rank that polled the store after rank 0 had gone
  got a broken pipe, which torch reports with a C++ stack on stderr beside the ranks' lines.
A rank that dies without reaching Python's exception handling (SIGKILL, a segfault) records nothing:
the others then report the failed collective as before.
"""
from __future__ import annotations

import datetime
import time

PREFIX = "hpcmeg/train/"
PEER_WAIT_S = 10.0  # a peer records its failure within milliseconds of raising; this is the slack
SAME_WAIT_S = 3.0  # how long a failed rank waits to see whether rank 0 found the same problem
LINGER_S = 30.0
POLL_S = 0.1


class PeerFailed(Exception):
    """Another rank failed: `failures` = [(rank, exit code, its lines)], in the order they were recorded."""

    def __init__(self, failures: list[tuple[int, int, list[str]]]):
        self.failures = failures
        ranks = sorted({r for r, _, _ in failures})
        super().__init__(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed")

    @property
    def code(self) -> int:
        return self.failures[0][1]


class PeerReport:
    """This rank's handle on the shared failure record (module docstring)."""

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        self.store, self.rank, self.world = store, rank, world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.counted = False  # this rank has ended its start-up (add("started", 1) done)
        self.failed_here = False

    @classmethod
    def of(cls, ctx, timeout_s: float = 1800.0) -> "PeerReport | None":
        """The report over ctx's process group (None for a single process). Called right after the group
        starts, so the store stays reachable from this process after ctx.destroy()."""
        if not ctx.distributed:
            return None
        import torch.distributed as dist

        # the default group's store: the rendezvous TCPStore (a PrefixStore over it); torch has no
        # public accessor, and this one has been stable since torch 1.x
        return cls(dist.distributed_c10d._get_default_store(), ctx.rank, ctx.world_size, timeout_s)

    def _add(self, key: str, n: int) -> int:
        return int(self.store.add(PREFIX + key, n))

    def _entry(self, n: int, wait_s: float) -> tuple[int, int, list[str]] | None:
        key = f"{PREFIX}failure/{n}"
        try:
            self.store.wait([key], datetime.timedelta(seconds=wait_s))
            rank, code, text = self.store.get(key).decode("utf-8", "replace").split("\t", 2)
            return int(rank), int(code), text.split("\n")
        except Exception:  # noqa: BLE001 - a record that cannot be read is left out, not a second failure
            return None

    def _count_started(self) -> None:
        if not self.counted:
            self.counted = True
            if self._add("started", 1) == self.world:
                self.store.set(PREFIX + "started/all", "1")

    def fail(self, code: int, lines: list[str]) -> bool:
        """Record this rank's failure; True when this rank should print its lines (rank 0 always;
        another rank unless rank 0 records the same lines). Never raises: the store may be gone."""
        self.failed_here = True
        after_startup = self.counted  # then rank0/ok says nothing about rank 0 now
        try:
            n = self._add("failures", 1)
            self.store.set(f"{PREFIX}failure/{n}", f"{self.rank}\t{code}\t" + "\n".join(lines))
            self._count_started()
            if self.rank == 0:
                return True
            end, seen = time.monotonic() + SAME_WAIT_S, 0
            while after_startup or not self.store.check([PREFIX + "rank0/ok"]):
                total = self._add("failures", 0)
                for k in range(seen + 1, total + 1):
                    e = self._entry(k, 1.0)
                    if e is not None and e[0] == 0:
                        return e[2] != lines
                seen = total
                if time.monotonic() >= end:
                    break
                time.sleep(POLL_S)
            return True
        except Exception:  # noqa: BLE001 - reporting must not hide the failure being reported
            return True

    def failures(self) -> list[tuple[int, int, list[str]]]:
        n = self._add("failures", 0)
        return [e for e in (self._entry(k, 5.0) for k in range(1, n + 1)) if e is not None]

    def startup_done(self) -> None:
        """End of start-up on a rank that built everything: raises PeerFailed if any rank failed."""
        if self.rank == 0:
            self.store.set(PREFIX + "rank0/ok", "1")
        self._count_started()
        self.store.wait([PREFIX + "started/all"], self.timeout)
        found = self.failures()
        if found:
            raise PeerFailed(found)

    def peer_failures(self, wait_s: float = PEER_WAIT_S) -> PeerFailed | None:
        """After a collective failed here: PeerFailed naming the rank(s) that recorded a failure within
        wait_s, else None (the failure is this rank's own to report)."""
        try:
            self._count_started()
            end = time.monotonic() + wait_s
            while True:
                found = self.failures()
                if found:
                    return PeerFailed(found)
                if time.monotonic() >= end:
                    return None
                time.sleep(POLL_S)
        except Exception:  # noqa: BLE001 - the store went away with rank 0: nothing to learn
            return None

    def acknowledge(self) -> None:
        """This rank has printed its line about another rank's failure."""
        try:
            self._add("read", 1)
        except Exception:  # noqa: BLE001 - the failed rank's linger times out instead
            pass

    def linger(self) -> None:
        """After this rank's own failure: wait until every other rank has printed its line or recorded
        a failure of its own (at most LINGER_S)."""
        if not self.failed_here:
            return
        end = time.monotonic() + LINGER_S
        try:
            while self._add("read", 0) + self._add("failures", 0) < self.world and time.monotonic() < end:
                time.sleep(POLL_S)
        except Exception:  # noqa: BLE001 - best effort
            pass


    def close(self) -> None:
        """This rank is done with the store (see the module docstring); on rank 0, after a recorded
        failure, wait for the others to be done too (at most PEER_WAIT_S)."""
        try:
            if self.rank != 0:
                self._add("done", 1)
                return
            if self._add("failures", 0) == 0:
                return
            end = time.monotonic() + PEER_WAIT_S
            while self._add("done", 0) < self.world - 1 and time.monotonic() < end:
                time.sleep(POLL_S)
        except Exception:  # noqa: BLE001 - best effort: the store may be gone already
            pass


__all__ = ["PeerFailed", "PeerReport"]
