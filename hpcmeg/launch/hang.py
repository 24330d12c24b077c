"""The supervisor's answer to a hung training step, in Slurm commands: the ranks' stacks dumped, the
step cancelled, and the job requeued with the suspect node excluded.

Contract
- `watch_step(proc, beat_dir, world_size, policy, poll_s) -> Hang | None`: waits for the step process
  `proc` (the step script running ``srun``), reading the heartbeats every poll; returns the Hang (the
  step still running) or None once the step has ended by itself.
- `dump_and_cancel(job_id, proc, wait_s)`: SIGUSR1 to every rank (hpcmeg train registers faulthandler
  on it: all threads' Python stacks go into the rank's log; a stopped rank dumps only once Slurm's
  cancel continues it), then the step cancelled (``scancel JOB.STEP``: SIGCONT + SIGTERM, SIGKILL after
  KillWait), then waits for `proc`.
- `usable_exclusion(job_id, suspects, excluded) -> (nodes, note)`: the job's exclusion list with the
  suspects added, only if the job's partition keeps at least the job's node count of nodes that are
  up and not excluded; otherwise the current list and a note why not (a job is never excluded out
  of its partition).
- `requeue_excluding(job_id, nodes)`: ``scontrol requeue`` then ``scontrol update ExcNodeList=``. Slurm
  changes ExcNodeList only on a pending job, and a requeued job is pending at once (its batch shell
  gets SIGTERM and, KillWait later, SIGKILL; the supervisor ignores SIGTERM meanwhile), so the update
  follows the requeue, retried for up to 10 s.
Slurm commands run with timeouts; a failed one raises RuntimeError with its message.
"""
from __future__ import annotations

import signal
import subprocess
import time
from typing import Optional

from hpcmeg.heartbeat import read_beats
from hpcmeg.launch.health import Hang, HangPolicy, diagnose

_DOWN = ("down", "drain", "fail", "maint", "boot", "unk", "futr", "inval", "npc", "reserved", "plnd", "pow")


def _slurm(cmd: list[str], timeout: float = 30.0) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{' '.join(cmd)}: {e}") from None
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {r.returncode}): {(r.stderr or r.stdout).strip()}")
    return r.stdout


def watch_step(proc: subprocess.Popen, beat_dir: str, world_size: int, policy: HangPolicy,
               poll_s: float = 2.0) -> Optional[Hang]:
    started = time.time()
    while True:
        try:
            proc.wait(timeout=poll_s)
            return None
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:  # a SIGINT must not orphan the step
            proc.send_signal(signal.SIGINT)
            continue
        hang = diagnose(read_beats(beat_dir), world_size, time.time(), started, policy)
        if hang is not None:
            return hang


def step_ids(job_id: str) -> list[str]:
    """The job's srun steps ('123.0', ...; not its batch or extern step)."""
    out = _slurm(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i"])
    return [s.strip() for s in out.split() if s.strip().partition(".")[2].isdigit()]


def dump_and_cancel(job_id: str, proc: subprocess.Popen, wait_s: float = 3.0, kill_wait_s: float = 120.0) -> None:
    try:
        # steps only: scancel signals the batch shell (this process) only with --batch / --full
        _slurm(["scancel", "--signal=USR1", str(job_id)])
        time.sleep(wait_s)  # faulthandler writes at once; the rank logs are appended by srun
    except RuntimeError as e:
        print(f"[hpcmeg supervisor] could not ask the ranks for their stacks: {e}", flush=True)
    for step in step_ids(job_id):
        try:
            _slurm(["scancel", step])
        except RuntimeError as e:
            print(f"[hpcmeg supervisor] {e}", flush=True)
    try:
        proc.wait(timeout=kill_wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _job_fields(job_id: str) -> dict[str, str]:
    out = _slurm(["scontrol", "show", "job", "-o", str(job_id)])
    fields = {}
    for tok in out.split():
        k, eq, v = tok.partition("=")
        if eq:
            fields.setdefault(k, v)
    return fields


def expand_nodes(expr: str) -> list[str]:
    if not expr or expr == "(null)":
        return []
    return _slurm(["scontrol", "show", "hostnames", expr]).split()


def usable_exclusion(job_id: str, suspects: list[str], excluded: list[str]) -> tuple[list[str], str]:
    job = _job_fields(job_id)
    need = int(job.get("NumNodes", "1").split("-")[0] or 1)
    required = set(expand_nodes(job.get("ReqNodeList", "")))
    current = sorted(set(excluded) | set(expand_nodes(job.get("ExcNodeList", ""))))
    new = [n for n in suspects if n not in current]
    if not new:
        return current, "the suspect node(s) are excluded already"
    if required & set(new):
        return current, f"not excluding {', '.join(new)}: the job asks for it by name (--nodelist)"
    up = set()
    for part in job.get("Partition", "").split(","):
        out = _slurm(["sinfo", "-h", "-N", "-p", part, "-o", "%N %t"])
        for line in out.splitlines():
            node, _, state = line.partition(" ")
            if not any(state.strip().lower().startswith(d) for d in _DOWN):
                up.add(node.strip())
    left = up - set(current) - set(new)
    if len(left) < need:
        return current, (f"not excluding {', '.join(new)}: the partition would keep {len(left)} usable node(s) for "
                         f"a job of {need}")
    return sorted(set(current) | set(new)), f"excluding {', '.join(new)}"


def requeue_excluding(job_id: str, nodes: list[str], retry_s: float = 10.0) -> None:
    _slurm(["scontrol", "requeue", str(job_id)])
    if not nodes:
        return
    deadline, err = time.time() + retry_s, None
    while time.time() < deadline:
        try:
            _slurm(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"], timeout=10)
            return
        except RuntimeError as e:  # not pending yet, or the command was hit by the requeue's SIGTERM
            err = e
            time.sleep(0.2)
    raise RuntimeError(f"requeued, but the node exclusion did not take: {err}")
