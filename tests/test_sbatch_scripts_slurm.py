"""slurm/preprocess.sh, train.sh and convert.sh as a user drives them: which hpcmeg they run, where their files go.

Without the venv activated (no venv on PATH, VIRTUAL_ENV unset) the scripts run the hpcmeg of the
checkout they live in; where none can be found they refuse in one line before any rank or shard runs;
from a submit directory that is not the output's, nothing lands in the submit directory (the launch
job's and the batch shells' own logs included). The lookup order itself (slurm/common.sh find_hpcmeg) is
checked without Slurm, on a copy of the scripts in a directory laid out as a checkout.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO
from cli_helpers import TINY, corpus_shards, hpcmeg, sets

VENV_HPCMEG = REPO / ".venv" / "bin" / "hpcmeg"


def _user_env(**extra) -> dict:
    """The environment of a shell where the venv is not activated: no directory holding an `hpcmeg` on
    PATH, no VIRTUAL_ENV, no PYTHONPATH."""
    path = [d for d in os.environ["PATH"].split(os.pathsep)
            if d and not os.path.exists(os.path.join(d, "hpcmeg")) and Path(d).resolve() != VENV_HPCMEG.parent]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "HPCMEG", "HPCMEG_ROOT")}
    env.update(PATH=os.pathsep.join(path), **extra)
    assert shutil.which("hpcmeg", path=env["PATH"]) is None
    return env


def _copy_scripts(root: Path) -> Path:
    """The three scripts and common.sh in <root>/slurm, as in a checkout without a venv."""
    (root / "slurm").mkdir(parents=True)
    for name in ("preprocess.sh", "train.sh", "convert.sh", "common.sh"):
        shutil.copy2(REPO / "slurm" / name, root / "slurm" / name)
    return root / "slurm"


def _wait(job: str, tasks: int = 1, timeout: float = 240) -> str:
    """The job's final state(s), space-separated (one per array task), once accounting has all `tasks`
    rows: an array task that has just left the queue can still be missing from sacct for a moment."""
    end = time.time() + timeout
    while time.time() < end:
        if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            rows = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True,
                                  text=True).stdout.split()
            if len(rows) >= tasks and all(x not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING") for x in rows):
                return " ".join(rows)
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not end in {timeout} s")


def _sbatch(args: list[str], env: dict, cwd: Path) -> str:
    r = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _jobs_from(submit: Path, known: list[str], timeout: float = 60) -> list[str]:
    """Every job (queued or finished) whose working directory is `submit`, read once accounting lists the
    `known` ones (a job that has just ended can take a moment to show in a time-window query)."""
    end = time.time() + timeout
    while True:
        rows = subprocess.run(["sacct", "-n", "-X", "-P", "-S", "now-1hours", "-o", "JobID,WorkDir"],
                              capture_output=True, text=True).stdout.splitlines()
        queued = subprocess.run(["squeue", "-h", "-o", "%i|%Z"], capture_output=True, text=True).stdout.splitlines()
        got = sorted({r.split("|")[0].split("_")[0] for r in rows + queued if r.endswith("|" + str(submit))})
        if set(known) <= set(got) or time.time() > end:
            return got
        time.sleep(0.5)


# ----------------------------------------------------------------------------- on the cluster

@pytest.mark.slurm
@pytest.mark.slow  # 40-90 s on 2 busy cores: a preprocess chain, 4 training iterations, one conversion
def test_scripts_run_the_checkouts_hpcmeg_and_write_only_under_the_output(slurm_cluster, tmp_path):
    if not VENV_HPCMEG.exists():
        pytest.skip(f"no {VENV_HPCMEG}: bash slurm/setup-dev.sh makes the checkout's venv these scripts find")
    submit = tmp_path / "submit"  # where the user types sbatch: not the output's directory
    submit.mkdir()
    corpus_shards(tmp_path, n=2, files=40)
    env = _user_env(INPUT_GLOB=str(tmp_path / "shard*.jsonl"), OUTPUT_PREFIX=str(tmp_path / "data" / "cp"),
                    JSON_KEYS="content", CPUS_PER_TASK="1", SHARD_TIME="00:10:00", MERGE_TIME="00:10:00")
    script = os.path.relpath(REPO / "slurm" / "preprocess.sh", submit)  # as typed: relative to the submit dir
    launch = _sbatch([script], env, submit)
    assert _wait(launch) == "COMPLETED", list(submit.iterdir()) + list((tmp_path / "data").iterdir())
    log = (tmp_path / "data" / f"preprocess-launch-{launch}.out").read_text()
    assert f"hpcmeg: {VENV_HPCMEG} (from the checkout's .venv)" in log, log
    ids = dict(kv.split("=") for kv in log.splitlines()[-1].split())
    assert _wait(ids["ARRAY_JOB_ID"], tasks=2) == "COMPLETED COMPLETED"
    assert _wait(ids["MERGE_JOB_ID"]) == "COMPLETED", sorted(os.listdir(tmp_path / "data"))
    data = tmp_path / "data" / "cp_content_document"
    assert Path(f"{data}.bin").stat().st_size > 0 and Path(f"{data}.idx").exists()

    over = TINY + ["run.output_root=" + str(tmp_path / "runs"), f"data.data_path=[{data}]", "train.train_iters=4",
                   "checkpoint.save_interval=4"]
    hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm", *sets(over),
           "--dry-run", cwd=tmp_path)  # writes <run>/recipe.yaml with absolute paths
    run = tmp_path / "runs" / "codeparrot-tiny"
    sb = ["--cpus-per-task=1", "--time=10", "--partition=debug"]
    # VERSION_CHECK=0: an edit of the package's source between the dry run and the jobs must not fail
    # this test (the version check has its own tests)
    env["VERSION_CHECK"] = "0"
    train = _sbatch([*sb, "--ntasks-per-node=2", f"--export=ALL,RECIPE={run / 'recipe.yaml'}",
                     os.path.relpath(REPO / "slurm" / "train.sh", submit)], env, submit)
    conv = _sbatch([*sb, f"--dependency=afterok:{train}", "--kill-on-invalid-dep=yes",
                    f"--export=ALL,CKPT_DIR={run / 'checkpoints'},OUT_DIR={run / 'hf'}",
                    os.path.relpath(REPO / "slurm" / "convert.sh", submit)], env, submit)
    train_log, conv_log = run / "logs" / "train" / f"train.{train}.out", run / "logs" / "convert" / f"convert.{conv}.out"
    assert _wait(train) == "COMPLETED", (sorted(os.listdir(submit)), train_log.exists() and train_log.read_text())
    assert _wait(conv) == "COMPLETED", (sorted(os.listdir(submit)), conv_log.exists() and conv_log.read_text())
    for text in (train_log.read_text(), conv_log.read_text()):
        assert f"hpcmeg: {VENV_HPCMEG} (from the checkout's .venv)" in text, text
    assert "finished" in train_log.read_text() and (run / "logs" / "train" / f"train.{train}.r0.1.log").exists()
    assert (run / "hf" / "iter_0000004" / "config.json").exists()
    assert os.listdir(submit) == []  # no Slurm log, no shard list, nothing


@pytest.mark.slurm
def test_no_hpcmeg_is_one_line_and_nothing_runs(slurm_cluster, tmp_path):
    """Scripts in a directory with no .venv, no hpcmeg on PATH, and no python that imports hpcmeg from it."""
    scripts = _copy_scripts(tmp_path / "checkout")
    submit = tmp_path / "submit"
    submit.mkdir()
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    env = _user_env(INPUT_GLOB=str(tmp_path / "in.jsonl"), OUTPUT_PREFIX=str(tmp_path / "out" / "cp"),
                    CPUS_PER_TASK="1")

    # launched from the login node: refused before anything is submitted or written
    r = subprocess.run(["bash", str(scripts / "preprocess.sh")], env=env, cwd=submit, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    (line,) = r.stderr.splitlines()
    assert "no hpcmeg found" in line and "HPCMEG=/path/to/venv/bin/hpcmeg" in line and "HPCMEG_ROOT=" in line, line
    assert not (tmp_path / "out").exists()

    # a HPCMEG that names nothing: the same, naming it
    r = subprocess.run(["bash", str(scripts / "preprocess.sh")], env={**env, "HPCMEG": str(tmp_path / "nope")},
                       cwd=submit, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and f"HPCMEG='{tmp_path / 'nope'}'" in r.stderr

    # with sbatch: the launch job and the train job end at once, their one line in Slurm's log, and
    # nothing else is queued (no shard array, no merge job, no training step)
    (tmp_path / "recipe.yaml").write_text("{}\n")
    launch = _sbatch([str(scripts / "preprocess.sh")], env, submit)
    train = _sbatch(["--ntasks-per-node=1", "--cpus-per-task=1", "--time=5", f"--export=ALL,RECIPE={tmp_path / 'recipe.yaml'}",
                     str(scripts / "train.sh")], env, submit)
    assert _wait(launch, timeout=120) == "FAILED" and _wait(train, timeout=120) == "FAILED"
    assert sorted(os.listdir(submit)) == [f"hpcmeg-preprocess-{launch}.out", f"hpcmeg-train-{train}.out"]
    for job, name in ((launch, "preprocess"), (train, "train")):
        (line,) = (submit / f"hpcmeg-{name}-{job}.out").read_text().splitlines()
        assert "no hpcmeg found" in line and f"not {tmp_path / 'checkout'}/.venv/bin/hpcmeg" in line, line
    steps = subprocess.run(["sacct", "-n", "-P", "-j", train, "-o", "JobID"], capture_output=True,
                           text=True).stdout.split()
    assert f"{train}.0" not in steps, steps  # no rank was started
    assert _jobs_from(submit, [launch, train]) == sorted([launch, train])
    assert not (tmp_path / "out").exists() and not (tmp_path / "logs").exists()


# ----------------------------------------------------------------------------- the lookup order, no Slurm

def _find(root: Path, env: dict, hpcmeg_var: str = "") -> subprocess.CompletedProcess:
    """slurm/common.sh's find_hpcmeg as the scripts call it (CONTAINER_RUNTIME=none, their die)."""
    prog = ('die() { echo "DIE $*"; exit 2; }; CONTAINER_RUNTIME=none; HPCMEG=$1; . "$0"; find_hpcmeg; '
            'printf "%s|%s|%s\\n" "$HPCMEG" "$hpcmeg_from" "${PYTHONPATH:-}"')
    return subprocess.run(["bash", "-c", prog, str(root / "slurm" / "common.sh"), hpcmeg_var], env=env,
                          cwd=root.parent, capture_output=True, text=True, timeout=60)


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_lookup_order_venv_then_path_then_python_then_one_line(tmp_path):
    root = tmp_path / "checkout"
    _copy_scripts(root)
    elsewhere = _executable(tmp_path / "otherenv" / "bin" / "hpcmeg")  # another install, on PATH
    env = _user_env()
    with_path = dict(env, PATH=f"{elsewhere.parent}{os.pathsep}{env['PATH']}")
    # python3 on PATH (without the checkout's own python): the checkout importable only through PYTHONPATH
    python3 = shutil.which("python3", path=env["PATH"])
    assert python3, "a python3 outside the venv is needed on PATH"

    # nothing: one line naming the three places and both ways out
    r = _find(root, env)
    assert r.returncode == 2 and len(r.stdout.splitlines()) == 1 and r.stdout.startswith("DIE no hpcmeg found"), r
    # the real package copied into the checkout: python3 -m hpcmeg.cli, PYTHONPATH gets the checkout
    shutil.copytree(REPO / "hpcmeg", root / "hpcmeg", ignore=shutil.ignore_patterns("__pycache__"))
    r = _find(root, env)
    assert r.stdout.strip() == f"{python3} -m hpcmeg.cli|{python3} importing {root}|{root}", r
    # hpcmeg on PATH comes before that
    r = _find(root, with_path)
    assert r.stdout.strip() == f"{elsewhere}|PATH|", r
    # the checkout's own .venv comes first
    venv = _executable(root / ".venv" / "bin" / "hpcmeg")
    r = _find(root, with_path)
    assert r.stdout.strip() == f"{venv}|the checkout's .venv|", r
    # HPCMEG as given wins, and must name a command
    r = _find(root, with_path, f"{elsewhere} --flag")
    assert r.stdout.strip() == f"{elsewhere} --flag|HPCMEG|", r
    r = _find(root, with_path, str(tmp_path / "nope"))
    assert r.returncode == 2 and r.stdout.startswith(f"DIE HPCMEG='{tmp_path / 'nope'}'") and str(venv) in r.stdout, r
