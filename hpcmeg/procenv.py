"""What this process reads from its own environment: where it sits in the job (rank, world size,
local rank, rendezvous address) and when its Slurm job ends.

Contract: `dist_env(environ=None) -> DistEnv`, read from (first match wins)
  1. torchrun / torch.distributed.launch: RANK, WORLD_SIZE, LOCAL_RANK (+ LOCAL_WORLD_SIZE,
     MASTER_ADDR, MASTER_PORT set by the launcher);
  2. an srun job step: SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID,
     the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) as master, the port derived
     from SLURM_JOB_ID (MASTER_ADDR / MASTER_PORT in the environment win when set). Only inside a
     job *step* (SLURM_STEP_ID set): the batch script itself runs with SLURM_PROCID=0 and the job's
     task count, and would wait forever for ranks that srun never started;
  3. otherwise a single process (rank 0 of 1, 127.0.0.1, a fixed port).
The node list is expanded in pure Python (`expand_hostlist`): containers have no `scontrol`.
`slurm_job_end_time(env)` -> epoch seconds from $SLURM_JOB_END_TIME, else `scontrol show job` when
scontrol exists (it usually does not inside containers: the host side passes the time in), else None
(the trainer's wall-time guard); `parse_scontrol_end_time(text)` is its pure parser.
Bottom layer (train and launch both read it): no torch import (the submitting host may have none),
no hpcmeg imports, no side effects on os.environ.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime
from typing import Mapping

DEFAULT_PORT = 29500
# job-id ports land in [20000, 32000): below Linux's ephemeral range (32768-60999, what a bind to port 0
# gets) and above the ports daemons commonly take (slurmd 6818; the local test cluster's nodes 17001..)
PORT_BASE, PORT_SPAN = 20000, 12000


@dataclass(frozen=True)
class DistEnv:
    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Number of processes in the job (all nodes)."""
    local_rank: int
    """Rank on this node; selects the GPU (cuda:local_rank)."""
    local_world_size: int
    """Processes on this node."""
    master_addr: str
    """Host of rank 0 (the TCP store)."""
    master_port: int
    """Port of the TCP store."""
    source: str
    """'torchrun', 'slurm' or 'single': which environment this came from (for logs)."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def port_from_job_id(job_id: int | str) -> int:
    """Deterministic rendezvous port for a Slurm job: every task computes the same one, and
    jobs sharing a node (likely: neighbouring ids) get different ones."""
    return PORT_BASE + int(job_id) % PORT_SPAN


_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in spec.split(","):
        m = _TASKS_RE.match(part.strip())
        if not m:
            raise ValueError(f"cannot parse tasks-per-node spec {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _split_top(s: str) -> list[str]:
    """Split on commas outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {s!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {s!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, whole: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (zero padding of the lower bound is kept)."""
    out = []
    for item in body.split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {item!r} in hostlist {whole!r}")
            width = len(lo)
            out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        elif item.isdigit():
            out.append(item)
        else:
            raise ValueError(f"bad item {item!r} in hostlist {whole!r}")
    return out


def _expand_one(host: str, whole: str) -> list[str]:
    i = host.find("[")
    if i < 0:
        return [host]
    j = host.find("]", i)
    if j < 0:
        raise ValueError(f"unbalanced '[' in hostlist {whole!r}")
    head, body, tail = host[:i], host[i + 1:j], host[j + 1:]
    return [head + mid + rest for mid in _expand_range(body, whole) for rest in _expand_one(tail, whole)]


def expand_hostlist(nodelist: str) -> list[str]:
    """Slurm compressed host list -> host names, in order.

    'node[01-03,07],gpu-a[1-2]-ib,login' -> node01 node02 node03 node07 gpu-a1-ib gpu-a2-ib login;
    several bracket groups expand as a product ('r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2)."""
    return [h for part in _split_top(nodelist) for h in _expand_one(part, nodelist)]


def dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Rank layout of this process from the environment (see the module docstring)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return _checked(DistEnv(
            rank=_int(env, "RANK"), world_size=world, local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
            master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
            master_port=_int(env, "MASTER_PORT", DEFAULT_PORT), source="torchrun"))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if env.get("MASTER_ADDR"):
            addr = env["MASTER_ADDR"]
        elif nodelist:
            addr = expand_hostlist(nodelist)[0]
        else:
            addr = "127.0.0.1"
        if env.get("MASTER_PORT"):
            port = _int(env, "MASTER_PORT")
        elif env.get("SLURM_JOB_ID"):
            port = port_from_job_id(_int(env, "SLURM_JOB_ID"))
        else:
            port = DEFAULT_PORT
        tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        node_id = _int(env, "SLURM_NODEID", 0)
        if tpn:
            counts = tasks_per_node(tpn)
            local_world = counts[node_id] if node_id < len(counts) else counts[-1]
        else:
            local_world = _int(env, "SLURM_NTASKS_PER_NODE", world)
        return _checked(DistEnv(rank=_int(env, "SLURM_PROCID"), world_size=world,
                                local_rank=_int(env, "SLURM_LOCALID", 0), local_world_size=local_world,
                                master_addr=addr, master_port=port, source="slurm"))
    return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                   master_port=_int(env, "MASTER_PORT", DEFAULT_PORT), source="single")


def _checked(e: DistEnv) -> DistEnv:
    if e.world_size < 1 or not 0 <= e.rank < e.world_size:
        raise ValueError(f"inconsistent {e.source} environment: rank {e.rank} of world size {e.world_size}")
    if not 0 <= e.local_rank < max(e.local_world_size, 1):
        raise ValueError(f"inconsistent {e.source} environment: local rank {e.local_rank} of "
                         f"{e.local_world_size} on this node")
    return e


# ----------------------------------------------------------------------------- the job's end time


def parse_scontrol_end_time(text: str) -> float | None:
    """EndTime=YYYY-MM-DDTHH:MM:SS from `scontrol show job` (local time) -> epoch seconds; None if unknown."""
    for tok in text.split():
        if tok.startswith("EndTime="):
            val = tok[len("EndTime="):]
            try:
                return datetime.strptime(val, "%Y-%m-%dT%H:%M:%S").timestamp()
            except ValueError:
                return None  # "Unknown", "None"
    return None


def slurm_job_end_time(env: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> float | None:
    """The job's end time (epoch s): $SLURM_JOB_END_TIME, else `scontrol show job` when scontrol exists
    (it usually does not inside containers: pass the time in from the host instead), else None."""
    env = os.environ if env is None else env
    v = env.get("SLURM_JOB_END_TIME")
    if v:
        try:
            return float(v)
        except ValueError:
            pass
    job = env.get("SLURM_JOB_ID")
    exe = shutil.which("scontrol")
    if not job or exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "job", "-o", job], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_scontrol_end_time(out)
