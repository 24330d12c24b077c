"""slurm/preprocess.sh on the local Slurm cluster: array over shards + afterok merge == one local run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from hpcmeg.data.corpus import write_stdlib_corpus
from hpcmeg.data.preprocess import preprocess_files

pytestmark = pytest.mark.slurm


def _wait(job_id: str, timeout: float = 300) -> str:
    end = time.time() + timeout
    while time.time() < end:
        if not subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
            s = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                               capture_output=True, text=True).stdout.split()
            if s and all(x not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING") for x in s):
                return s[0]
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s")


def test_sharded_array_job_equals_single_run(slurm_cluster, tmp_path):
    corpus = tmp_path / "all.jsonl"
    write_stdlib_corpus(str(corpus), key="content", include_tests=False, max_files=90)
    lines = corpus.read_bytes().splitlines(keepends=True)
    (tmp_path / "shards").mkdir()
    for k in range(3):  # three shards, dealt in sorted-name order
        (tmp_path / "shards" / f"s{k}.jsonl").write_bytes(b"".join(lines[k * 30:(k + 1) * 30]))
    out = tmp_path / "out" / "cp"
    env = dict(os.environ, INPUT_GLOB=str(tmp_path / "shards" / "*.jsonl"), OUTPUT_PREFIX=str(out),
               JSON_KEYS="content", CPUS_PER_TASK="1", SHARD_TIME="00:10:00", MERGE_TIME="00:10:00",
               HPCMEG=f"{sys.executable} -m hpcmeg.cli", PYTHONPATH=str(REPO))
    r = subprocess.run(["bash", str(REPO / "slurm" / "preprocess.sh")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ids = dict(kv.split("=") for kv in r.stdout.split())
    assert _wait(ids["ARRAY_JOB_ID"]) == "COMPLETED"
    assert _wait(ids["MERGE_JOB_ID"]) == "COMPLETED", (tmp_path / "out").iterdir()
    preprocess_files(str(corpus), str(tmp_path / "single"), json_keys=["content"], append_eod=True, workers=1,
                     quiet=True)
    for ext in (".bin", ".idx"):
        assert (out.parent / f"cp_content_document{ext}").read_bytes() == \
            (tmp_path / f"single_content_document{ext}").read_bytes()
    assert not list((tmp_path / "out").glob("cp_shard*"))  # shard datasets removed after the merge


def test_scancel_stops_a_running_preprocess_cleanly(slurm_cluster, tmp_path):
    """What preemption or `hpcmeg cancel` does to a preprocess task: Slurm SIGTERMs every process of the
    step (parent and workers), then SIGKILLs after KillWait. The run must stop on the SIGTERM itself:
    exit 143, no dataset, no temporary file (a SIGKILL would leave the .bin temporary), no process."""
    corpus = tmp_path / "big.jsonl"  # the stdlib four times over: still tokenizing when the signal lands
    write_stdlib_corpus(str(tmp_path / "one.jsonl"), key="content", include_tests=False)
    corpus.write_bytes((tmp_path / "one.jsonl").read_bytes() * 4)
    out = tmp_path / "out" / "cp"
    cmd = (f"srun --ntasks=1 --cpus-per-task=1 {sys.executable} -m hpcmeg.cli preprocess --input {corpus} "
           f"--output-prefix {out} --json-keys content --workers 2 --quiet; echo exit=$? > {tmp_path}/rc")
    r = subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / "job.log"), "--wrap", cmd], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    deadline = time.time() + 120
    while time.time() < deadline and not (out.parent.is_dir() and any(".tmp" in f for f in os.listdir(out.parent))):
        time.sleep(0.1)  # tokenizing has begun: the .bin temporary exists
    assert out.parent.is_dir() and os.listdir(out.parent), (tmp_path / "job.log").read_text()
    time.sleep(0.5)
    subprocess.run(["scancel", "--signal=TERM", job], check=True)  # the step gets it, as on preemption
    assert _wait(job, 60) in ("COMPLETED", "FAILED", "CANCELLED")
    deadline = time.time() + 10
    while not (tmp_path / "rc").exists() and time.time() < deadline:
        time.sleep(0.1)
    log = (tmp_path / "job.log").read_text()
    assert (tmp_path / "rc").read_text().strip() == "exit=143", log
    assert "stopped by SIGTERM" in log and "Traceback" not in log, log
    assert not out.parent.exists() or os.listdir(out.parent) == [], os.listdir(out.parent)
    left = subprocess.run(["pgrep", "-f", f"--output-prefix {out}"], capture_output=True, text=True).stdout.split()
    assert left == [], left
