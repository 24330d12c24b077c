"""Slurm job states as hpcmeg reads them: which ones are final, and which of those are failures.

Contract: ``FINAL`` is the set of Slurm job states after which a job never changes again;
``BAD = FINAL - {"COMPLETED"}`` are the final states that mean the stage did not finish its work.
Shared by status (the table and its exit code), causes (which stages to explain) and watch (when to
stop following a chain). Plain data, no imports.
"""
from __future__ import annotations

FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                   "DEADLINE", "SPECIAL_EXIT", "REVOKED"})
BAD = FINAL - {"COMPLETED"}
