"""On the local Slurm cluster: `hpcmeg smoke`, and a failed upstream job ending its whole chain.

The cluster runs without ``DependencyParameters=kill_invalid_depend`` (slurm/local-cluster.sh), as many
sites do: a control job without ``--kill-on-invalid-dep`` proves it (it stays PENDING), so the chains
below end only because every dependent job hpcmeg submits carries the flag.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, hpcmeg_cmd
from hpcmeg.data.corpus import write_stdlib_corpus

pytestmark = pytest.mark.slurm
CHECK_LINE = re.compile(r"^\[smoke +(\d+)s\] (PASS|FAIL) ([^:]+): ")


def _cli(*args, timeout=600, env=None, cwd=None):
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([*hpcmeg_cmd(), *args], capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd)


def test_smoke_passes_on_the_local_cluster(slurm_cluster, tmp_path):
    t0 = time.time()
    r = _cli("smoke", "--profile", "local-slurm", "--output-root", str(tmp_path), cwd=tmp_path)
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-2000:]
    checks = {m.group(3): m.group(2) for m in map(CHECK_LINE.match, out.splitlines()) if m}
    from hpcmeg.launch.smoke import CHECKS

    assert checks == {c: "PASS" for c in CHECKS}, out
    assert "CPU ranks: 2 rank(s)" in out and "gloo over 2 rank(s): sum 3 (expected 3)" in out
    assert re.search(r"PASS first loss line: iteration 1/6 \| consumed samples 2 \| loss \d+\.\d+", out)
    assert "smoke test PASSED" in out and r.stderr.strip() == ""
    # never more than 15 s without a line
    stamps = [int(m.group(1)) for m in (re.match(r"^\[smoke +(\d+)s\]", ln) for ln in out.splitlines()) if m]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert stamps[0] <= 15 and max(gaps) <= 15, (gaps, out)
    # each rank ran in its own step task with the profile's cores (srun --cpus-per-task, not inherited)
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "hpcmeg-smoke" / "smoke").glob("rank*.json"))]
    assert sorted(x["rank"] for x in ranks) == [0, 1]
    assert all(x["slurm_cpus_per_task"] == "1" and x["cpus_usable"] >= 1 for x in ranks)
    print(f"smoke on the local cluster: {time.time() - t0:.0f} s")


def test_smoke_refuses_an_interpreter_the_nodes_cannot_have(slurm_cluster, tmp_path):
    prof = tmp_path / "mysite.yaml"  # the user's own profile, naming a venv that is not there
    text = (REPO / "hpcmeg" / "profiles" / "local-slurm.yaml").read_text()
    prof.write_text(text.replace("  env:", "  python: /opt/nonexistent-venv/bin/python\n  env:", 1))
    t0 = time.time()
    r = _cli("smoke", "--profile", str(prof), "--output-root", str(tmp_path / "out"), timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("hpcmeg: cluster.python '/opt/nonexistent-venv/bin/python': does not exist")
    # nothing submitted: a submission writes the run directory first
    assert not (tmp_path / "out").exists() and time.time() - t0 < 30


def test_smoke_reports_a_failing_stage_in_one_line(slurm_cluster, tmp_path):
    """The ranks' interpreter (container.python, with the local cluster's no-op pyxis) does not exist on the
    node: the supervisor check passes, the preprocess step fails, and smoke says so and stops."""
    img = tmp_path / "img.sqsh"
    img.write_text("not an image: the local cluster's pyxis plugin only accepts the options\n")
    r = _cli("smoke", "--profile", "local-slurm", "--output-root", str(tmp_path / "out"),
             "--set", "container.runtime=pyxis", "--set", f"container.image={img}",
             "--set", "container.python=/opt/nonexistent/python3", timeout=300)
    assert r.returncode == 1, r.stdout[-3000:]
    lines = r.stdout.splitlines()
    assert any(ln.split("] ", 1)[1].startswith("PASS interpreter and hpcmeg on the node") for ln in lines)
    (fail,) = [ln for ln in lines if "] FAIL " in ln]
    assert "FAIL preprocess: the preprocess job ended FAILED" in fail
    assert any("not reached: " in ln for ln in lines) and "smoke test FAILED" in lines[-1]
    st = json.loads(_cli("status", str(tmp_path / "out" / "hpcmeg-smoke"), "--json").stdout)
    assert all(s["state"] in ("FAILED", "CANCELLED") for s in st["stages"].values()), st


# ----------------------------------------------------------------------------- failed upstream jobs


def _states(jobs: list[str]) -> dict[str, str]:
    """sacct's state per job; an array job's tasks (ID_N) count for ID (the worst of them)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(jobs)],
                         capture_output=True, text=True).stdout
    st: dict[str, str] = {}
    for jid, state in (ln.split("|", 1) for ln in out.splitlines() if "|" in ln):
        base, state = jid.split("_")[0], state.split()[0]
        if st.get(base) in (None, "COMPLETED") or state in ("PENDING", "RUNNING", "COMPLETING"):
            st[base] = state
    return st


def _reason(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True).stdout.strip()


def _wait_ended(jobs: list[str], timeout=120) -> dict[str, str]:
    end = time.time() + timeout
    while time.time() < end:
        queued = subprocess.run(["squeue", "-h", "-o", "%A", "-j", ",".join(jobs)], capture_output=True,
                                text=True).stdout.split()
        st = _states(jobs)
        if not queued and all(st.get(j, "PENDING") not in ("PENDING", "RUNNING", "COMPLETING") for j in jobs):
            return st
        time.sleep(0.5)
    raise AssertionError(f"still queued after {timeout} s: {[(j, _reason(j)) for j in jobs]}")


def test_a_failed_upstream_job_cancels_the_rest_of_the_chain(slurm_cluster, tmp_path):
    # control: without --kill-on-invalid-dep this cluster leaves a child of a failed job pending forever
    sb = ["sbatch", "--parsable", "-o", "/dev/null", "--time=5"]
    parent = subprocess.run([*sb, "--wrap", "exit 3"], capture_output=True, text=True, check=True).stdout.strip()
    child = subprocess.run([*sb, f"--dependency=afterok:{parent}", "--wrap", "true"], capture_output=True,
                           text=True, check=True).stdout.strip()
    try:
        _wait_ended([parent])
        deadline = time.time() + 15
        while "DependencyNeverSatisfied" not in _reason(child) and time.time() < deadline:
            time.sleep(0.5)
        assert "DependencyNeverSatisfied" in _reason(child), (
            f"job {child}: {_reason(child)!r}; this test needs a cluster without "
            f"DependencyParameters=kill_invalid_depend (run slurm/local-cluster.sh start from this checkout)")
    finally:
        subprocess.run(["scancel", child])

    # hpcmeg submit: 2 shards -> merge -> train -> convert; every shard task fails at its first step (the
    # run's version record names another hpcmeg), so nothing downstream can ever run
    from hpcmeg.launch import submit as SUB
    from hpcmeg.launch.provenance import RECORD_NAME
    from hpcmeg.recipe import load_recipe

    corpus = tmp_path / "all.jsonl"
    write_stdlib_corpus(str(corpus), key="content", include_tests=False, max_files=8)
    lines = corpus.read_bytes().splitlines(keepends=True)
    for k in range(2):
        (tmp_path / f"s{k}.jsonl").write_bytes(b"".join(lines[k::2]))
    sets = [f"run.output_root={tmp_path / 'runs'}", f"data.inputs=[{tmp_path}/s*.jsonl]", "train.train_iters=4",
            "train.lr_warmup_iters=1"]
    prep = SUB.prepare(load_recipe(REPO / "recipes" / "codeparrot_tiny.yaml", sets, "local-slurm"))
    SUB.write_run_files(prep)
    rec = prep.run.root / RECORD_NAME
    rec.write_text(json.dumps({**json.loads(rec.read_text()), "source": "000000000000"}))
    ids = SUB.submit_plan(prep)
    assert list(ids) == ["preprocess", "merge", "train", "convert"]
    st = _wait_ended(list(ids.values()))
    assert st[ids["preprocess"]] == "FAILED", st
    assert all(st[ids[s]] == "CANCELLED" for s in ("merge", "train", "convert")), st
    status = json.loads(_cli("status", str(prep.run.root), "--json").stdout)
    assert {s: v["state"] for s, v in status["stages"].items()} == {
        "preprocess": "FAILED", "merge": "CANCELLED", "train": "CANCELLED", "convert": "CANCELLED"}
    from hpcmeg.launch.rundir import read_markers

    why = read_markers(prep.run)["preprocess.0"]["failed"]["reason"]
    assert "version check: the run was written by hpcmeg" in why and "(source 000000000000)" in why

    # slurm/preprocess.sh: a shard that cannot be read fails its task; the merge job is cancelled
    (tmp_path / "sh").mkdir()
    (tmp_path / "sh" / "a.jsonl").write_bytes(lines[0])
    (tmp_path / "sh" / "b.jsonl").write_text("{not json\n")
    env = dict(os.environ, INPUT_GLOB=str(tmp_path / "sh" / "*.jsonl"), OUTPUT_PREFIX=str(tmp_path / "pp" / "cp"),
               JSON_KEYS="content", SHARD_TIME="00:05:00", MERGE_TIME="00:05:00",
               HPCMEG=f"{sys.executable} -m hpcmeg.cli", PYTHONPATH=str(REPO))
    r = subprocess.run(["bash", str(REPO / "slurm" / "preprocess.sh")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.search(r"CPUS_PER_TASK=\d+ \(sized from sinfo: nodes of the default partition have \d+ CPUs", r.stderr)
    jid = dict(kv.split("=") for kv in r.stdout.split())
    st = _wait_ended([jid["ARRAY_JOB_ID"], jid["MERGE_JOB_ID"]])
    assert st[jid["MERGE_JOB_ID"]] == "CANCELLED", st


def test_preprocess_sh_refuses_a_request_no_node_can_satisfy(slurm_cluster, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "x = 1"}\n')
    env = dict(os.environ, INPUT_GLOB=str(tmp_path / "*.jsonl"), OUTPUT_PREFIX=str(tmp_path / "out" / "cp"),
               JSON_KEYS="content", CPUS_PER_TASK="512")
    r = subprocess.run(["bash", str(REPO / "slurm" / "preprocess.sh")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "Slurm would not run the shard tasks (CPUS_PER_TASK=512" in r.stderr, r.stderr
    assert "nothing was submitted" in r.stderr and r.stdout == "" and "ARRAY_JOB_ID" not in r.stderr


def test_submit_asks_slurm_before_writing_anything(slurm_cluster, tmp_path):
    """What only Slurm knows (a partition, GPUs the nodes lack) is refused in one line, nothing written."""
    for sets, words in ((["cluster.partition=nosuch"], "Slurm would refuse the preprocess, train and convert jobs "
                                                        "(invalid partition specified: nosuch"),
                        (["cluster.gpus_per_node=2"], "Slurm would refuse the train job (Invalid generic resource")):
        corpus = tmp_path / "c.jsonl"
        corpus.write_text('{"content": "print(1)"}\n')
        args = ["submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm",
                "--set", f"run.output_root={tmp_path / 'runs'}", "--set", f"data.inputs=[{corpus}]"]
        r = _cli(*args, *[x for s in sets for x in ("--set", s)], timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
        assert not (tmp_path / "runs").exists()
