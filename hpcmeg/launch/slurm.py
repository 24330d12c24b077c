"""What a running Slurm job can learn about itself: its end time (for the trainer's wall-time guard).

Contract: ``slurm_job_end_time(env)`` -> epoch seconds from $SLURM_JOB_END_TIME, else ``scontrol show
job`` when scontrol exists (it usually does not inside containers: the host side passes the time in),
else None. ``parse_scontrol_end_time(text)`` is the pure parser. No torch import.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from datetime import datetime
from typing import Mapping


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
