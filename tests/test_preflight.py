"""What `hpcmeg submit` refuses before writing anything (hpcmeg.launch.preflight), and the version record.

Unit cases for the pure checks (node-local paths, node addresses, resource shapes), then the CLI:
each refusal is exit 2, exactly one line on stderr naming the key, and no run directory.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, hpcmeg_cmd
from hpcmeg.launch import preflight as P
from hpcmeg.launch import provenance as V
from hpcmeg.recipe import load_recipe

TINY = REPO / "recipes" / "codeparrot_tiny.yaml"
MOUNTS = [("/", "ext4"), ("/dev/shm", "tmpfs"), ("/lustre", "lustre"), ("/home", "autofs"), ("/home", "nfs4"),
          ("/scratch/local", "xfs")]


def test_node_local_paths_are_recognised():
    env = {"TMPDIR": "/var/spool/job123"}
    reason = lambda p: P.node_local_reason(p, environ=env, table=MOUNTS)  # noqa: E731
    assert "under /tmp" in reason("/tmp/venv/bin/python")
    assert "under /var/tmp" in reason("/var/tmp/x/python")
    assert "$TMPDIR" in reason("/var/spool/job123/venv/bin/python")
    assert "/dev/shm" in reason("/dev/shm/v/bin/python")
    assert "local xfs disk" in reason("/scratch/local/me/venv/bin/python")
    assert "local ext4 disk" in reason("/opt/venv/bin/python")
    assert reason("/lustre/me/venv/bin/python") is None
    assert reason("/home/me/venv/bin/python") is None  # the nfs4 mount shadows the autofs one
    assert P.fs_type("/home/me", MOUNTS) == "nfs4" and P.fs_type("/lustre2/x", MOUNTS) == "ext4"


def test_node_addresses():
    assert P.addresses_are_local(["127.0.0.1", "localhost"], {"vm"})
    assert P.addresses_are_local(["vm", "10.0.0.5"], {"vm", "10.0.0.5"})
    assert not P.addresses_are_local(["127.0.0.1", "node02"], {"vm"})
    assert not P.addresses_are_local([], {"vm"})


def _slurm_recipe(**cluster):
    sets = [f"cluster.{k}={json.dumps(v)}" for k, v in cluster.items()]
    return load_recipe(TINY, sets, "local-slurm")


def _fake_python(tmp_path: Path, body: str) -> str:
    p = tmp_path / "venv" / "bin" / "python"
    p.parent.mkdir(parents=True)
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_compute_node_interpreter_checks(tmp_path):
    r = _slurm_recipe(python="/opt/nonexistent/venv/bin/python")
    (msg,) = P.check_python(r, r.cluster.python, nodes_local=True)
    assert msg.startswith("cluster.python '/opt/nonexistent/venv/bin/python': does not exist")
    (msg,) = P.check_python(r, "venv/bin/python", nodes_local=True)
    assert "must be an absolute path" in msg
    assert P.check_python(r, "python3", nodes_local=False) == []  # found on the node's PATH after cluster.setup
    # /tmp exists on every host, but it is a different /tmp on each: refused when the nodes are other hosts
    in_tmp = f"/tmp/hpcmeg-test-{os.getpid()}-{time.time_ns()}/venv/bin/python"
    (msg,) = P.check_python(r, in_tmp, nodes_local=False)
    assert "compute nodes cannot run it" in msg and "under /tmp" in msg and "cluster.python_check=false" in msg
    assert "does not exist" in P.check_python(r, in_tmp, nodes_local=True)[0]
    skip = _slurm_recipe(python_check=False)
    assert "does not exist" in P.check_python(skip, in_tmp, nodes_local=False)[0]
    # an interpreter with another hpcmeg (or none) is refused: every job would stop at its version check
    other = _fake_python(tmp_path, """echo '{"version": "0.0.9", "source": "0123456789ab", "path": "/x/hpcmeg"}'""")
    (msg,) = P.check_python(r, other, nodes_local=True)
    assert "runs hpcmeg 0.0.9 (source 0123456789ab)" in msg and "cluster.version_check=false" in msg
    assert P.check_python(_slurm_recipe(version_check=False), other, nodes_local=True) == []
    broken = _fake_python(tmp_path / "b", "echo \"ModuleNotFoundError: No module named 'hpcmeg'\" >&2; exit 1")
    (msg,) = P.check_python(r, broken, nodes_local=True)
    assert "cannot import hpcmeg and submitit (ModuleNotFoundError: No module named 'hpcmeg')" in msg
    assert P.check_python(r, sys.executable, nodes_local=True) == []


def test_run_directory_on_a_node_local_path_is_refused_for_remote_nodes():
    r = _slurm_recipe()
    assert "run.output_root" in P.check_output_root(r, "/dev/shm/runs/x", nodes_local=False)[0]
    assert P.check_output_root(r, "/dev/shm/runs/x", nodes_local=True) == []


def test_preprocess_workers_never_exceed_the_cores():
    r = load_recipe(REPO / "recipes" / "codeparrot_small.yaml", ["cluster.preprocess_cpus=4"])
    (msg,) = P.check_shapes(r, ("preprocess", "train"))
    assert msg.startswith("data.workers: 8 tokenizer workers would share the 4 core(s)")
    assert P.check_shapes(r, ("train",)) == []  # no preprocess job, nothing to share
    r2 = load_recipe(REPO / "recipes" / "codeparrot_small.yaml")
    assert P.check_shapes(r2, ("preprocess",)) == []  # null: the job gets one core per worker
    from hpcmeg.launch import scripts as S

    assert S.cpu_stage_cpus(r2) == r2.data.workers == 8


def test_profile_must_fit_the_executor():
    r = load_recipe(TINY, ["container.runtime=pyxis", "container.image=img.sqsh"], "local")
    problems, _ = P.check_fit(r, dry_run=True)  # a property of the recipe: refused even on a dry run
    assert len(problems) == 1 and problems[0].startswith("container.runtime: pyxis starts containers through")


def _cli(*args, env=None, cwd=None):
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([*hpcmeg_cmd(), *args], capture_output=True, text=True, env=e, cwd=cwd, timeout=120)


@pytest.mark.parametrize("profile,sets,key", [
    ("local", ["container.runtime=pyxis", "container.image=img.sqsh"], "container.runtime"),
    ("local", ["container.runtime=apptainer", "container.image=/x/img.sif"], "container.runtime"),
    ("local-slurm", ["cluster.python=/opt/nonexistent/bin/python"], "cluster.python"),
    ("local-slurm", ["cluster.preprocess_cpus=1", "data.workers=2"], "data.workers"),
    ("example-apptainer", [], "container.image"),
    ("local", ["cluster.env={'BAD NAME': 1}"], "cluster.env"),
    ("local-slurm", ["container.runtime=pyxis", "container.image=img", "container.binds=['/a,b']"], "container.binds"),
])
def test_submit_refuses_in_one_line_and_writes_nothing(tmp_path, profile, sets, key):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"content": "print(1)"}\n')
    out = tmp_path / "runs"
    args = ["submit", str(TINY), "--profile", profile, "--set", f"run.output_root={out}",
            "--set", f"data.inputs=[{corpus}]"]
    for s in sets:
        args += ["--set", s]
    r = _cli(*args, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    # blamed on where the key was set: its --set item, else the profile's line
    item = next((s for s in sets if s.startswith(f"{key}=")), None)
    start = f"hpcmeg: --set {item}" if item else f"hpcmeg: {REPO / 'hpcmeg' / 'profiles' / profile}.yaml:"
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), (r.returncode, r.stderr)
    assert item or f": {key}:" in lines[0], lines
    assert "Traceback" not in r.stderr and not out.exists()


def test_slurm_profile_without_slurm_commands_is_refused(tmp_path):
    env = {"PATH": str(Path(sys.executable).parent)}  # no sbatch here (a laptop)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"content": "print(1)"}\n')
    r = _cli("submit", str(TINY), "--profile", "local-slurm", "--set", f"run.output_root={tmp_path / 'runs'}",
             "--set", f"data.inputs=[{corpus}]", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "sbatch is not on PATH" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- the version record


def test_version_record_and_the_check(tmp_path):
    rec = V.write_record(tmp_path)
    assert json.loads(rec.read_text()) == V.fingerprint()
    assert V.mismatch(rec, "the apptainer image /x.sif") is None
    rec.write_text(json.dumps({**V.fingerprint(), "source": "000000000000"}))
    msg = V.mismatch(rec, "the apptainer image /x.sif")
    assert "written by hpcmeg" in msg and "(source 000000000000)" in msg and "the apptainer image /x.sif runs" in msg
    assert "rebuild the image" in msg and "cluster.version_check=false" in msg and "\n" not in msg
    assert "pip install -e" in V.mismatch(rec, "the supervisor's interpreter /v/bin/python on node1")
    assert "is missing" in V.mismatch(tmp_path / "nope.json", "x")
    # inside a job step the CLI checks before it does anything: one line, exit 1
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"content": "print(1)"}\n')
    args = ["validate", str(TINY), "--set", f"data.inputs=[{corpus}]"]
    r = _cli(*args, env={V.ENV_FILE: str(rec), V.ENV_SIDE: "the pyxis image /x.sqsh"})
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "the pyxis image /x.sqsh runs" in r.stderr
    rec.write_text(json.dumps(V.fingerprint()))
    ok = _cli(*args, env={V.ENV_FILE: str(rec)})
    assert ok.returncode == 0, ok.stderr


def test_an_installed_copy_has_the_checkout_s_source_hash(tmp_path):
    """What containers/hpcmeg.def does (pip install --no-deps of the checkout) gives the same fingerprint,
    so an image built from the submitting checkout passes the check, and an edit is told apart."""
    import shutil

    src = tmp_path / "src"  # what the def file's %files copies into the image, then pip installs
    shutil.copytree(REPO / "hpcmeg", src / "hpcmeg", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(tmp_path / "site"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    installed = tmp_path / "site" / "hpcmeg"
    assert V.source_hash(installed) == V.source_hash(REPO / "hpcmeg")
    (installed / "procenv.py").write_text((installed / "procenv.py").read_text() + "\n# edited\n")
    assert V.source_hash(installed) != V.source_hash(REPO / "hpcmeg")


def test_supervisor_stops_a_stage_run_by_another_hpcmeg(tmp_path):
    from hpcmeg.launch import supervisor
    from hpcmeg.launch.rundir import RunDir, read_markers

    run = RunDir(tmp_path / "run").create()
    (run.root / V.RECORD_NAME).write_text(json.dumps({"version": "0.0.1", "source": "abc", "path": "/old"}))
    task = {"stage": "preprocess", "run_dir": str(run.root), "args": [], "task": 1, "version_check": True}
    with pytest.raises(supervisor.StageFailed, match=r"written by hpcmeg 0\.0\.1 \(source abc\) but the supervisor.s"):
        supervisor.check_version(task)
    assert "version check" in read_markers(run)["preprocess.1"]["failed"]["reason"]
    supervisor.check_version({**task, "version_check": False})  # the escape hatch


def test_a_bind_inside_another_is_not_repeated():
    from hpcmeg.launch.container import normalized_binds

    assert normalized_binds(["/lustre"], ["/lustre/runs/x"]) == ["/lustre:/lustre"]
    assert normalized_binds(["/lustre2"], ["/lustre/runs/x"]) == ["/lustre/runs/x:/lustre/runs/x", "/lustre2:/lustre2"]
    assert normalized_binds(["/lustre:/data"], ["/lustre/runs/x"]) == ["/lustre/runs/x:/lustre/runs/x", "/lustre:/data"]
