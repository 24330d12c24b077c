"""`validate` runs submit's checks (hpcmeg.launch.submit.prepare): unmatched inputs, json_keys against
each input's first document (plain and gzip), unreadable data, '%' in the run directory, pass-through
and secret variables; `submit --dry-run` where run.output_root cannot be created; CPU ranks are never
called GPUs. In-process through hpcmeg.cli.main (no torch import, no subprocess per case)."""
from __future__ import annotations

import gzip
import os
import stat
from pathlib import Path

import pytest

from hpcmeg.cli import main
from hpcmeg.launch import checks

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "codeparrot_tiny.yaml")
SMALL = str(REPO / "recipes" / "codeparrot_small.yaml")


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "good.jsonl").write_text('\n{"content": "import os\\n", "path": "a.py"}\n{"content": "x = 1"}\n')
    (d / "text.jsonl").write_text('{"text": "hello", "meta": 1}\n')
    (d / "num.jsonl").write_text('{"content": 5}\n')
    (d / "bad.jsonl").write_text("not json at all\n")
    with gzip.open(d / "text.jsonl.gz", "wb") as f:
        f.write(b'{"text": "hello"}\n' * 50)
    (d / "good.jsonl.gz").write_bytes(gzip.compress(b'{"content": "y = 2"}\n' * 50))
    (d / "trunc.jsonl.gz").write_bytes(gzip.compress(b'{"content": "y = 2"}\n' * 5000)[:12])
    return d


def _validate(capsys, tmp_path, *sets, profile=None):
    argv = ["validate", TINY, "--set", f"run.output_root={tmp_path / 'runs'}"]
    for s in sets:
        argv += ["--set", s]
    if profile:
        argv += ["--profile", profile]
    return _run(capsys, *argv)


# local-slurm needs the cluster (marker slurm: `-m "not slurm"` leaves it out, and xdist runs it in the
# cluster's group, tests/conftest.py)
@pytest.mark.parametrize("profile", ["local", pytest.param("local-slurm", marks=pytest.mark.slurm)])
def test_validate_is_submits_check(capsys, tmp_path, data, profile, request):
    if profile == "local-slurm":  # the node-local path checks pass because the nodes are this host
        request.getfixturevalue("slurm_cluster")
    # good inputs (a leading blank line, plain and gzip): exit 0, nothing written anywhere
    rc, out, err = _validate(capsys, tmp_path, f"data.inputs=[{data}/good.jsonl,{data}/good.jsonl.gz]", profile=profile)
    assert rc == 0, err
    assert "# derived" in out and not (tmp_path / "runs").exists()
    cases = [
        # (inputs, json_keys, exit code, what the one line must say)
        (f"[{data}/good.jsonl,{data}/nothing-*.jsonl]", None, 2,
         ["data.inputs[1]", "nothing-*.jsonl", "matches no file"]),
        (f"[{data}/missing.jsonl]", None, 2, ["data.inputs[0]", "missing.jsonl"]),
        (f"[{data}/text.jsonl]", None, 2, ["data.json_keys", "text.jsonl:1", "'content'", "keys present: text, meta"]),
        (f"[{data}/good.jsonl,{data}/text.jsonl.gz]", None, 2, ["data.json_keys", "text.jsonl.gz:1", "'content'"]),
        (f"[{data}/good.jsonl]", "[text]", 2, ["data.json_keys", "good.jsonl:2", "'text'"]),
        (f"[{data}/num.jsonl]", None, 2, ["data.json_keys", "holds int"]),
        (f"[{data}/bad.jsonl]", None, 1, ["bad.jsonl:1", "malformed JSON"]),
        (f"[{data}/trunc.jsonl.gz]", None, 1, ["trunc.jsonl.gz", "cannot read"]),
    ]
    for inputs, keys, code, words in cases:
        sets = [f"data.inputs={inputs}"] + ([f"data.json_keys={keys}"] if keys else [])
        rc, out, err = _validate(capsys, tmp_path, *sets, profile=profile)
        assert rc == code and len(err) == 1, (inputs, keys, rc, err)
        assert all(w in err[0] for w in words), (words, err)
        assert "Traceback" not in err[0]
    # submit makes the same refusals, before anything is written
    rc, _, err = _run(capsys, "submit", TINY, "--set", f"run.output_root={tmp_path / 'runs'}",
                      "--set", f"data.inputs=[{data}/text.jsonl]", *(["--profile", profile] if profile else []))
    assert rc == 2 and len(err) == 1 and "data.json_keys" in err[0]
    assert not (tmp_path / "runs").exists()


def test_percent_in_run_dir_is_refused(capsys, tmp_path, data):
    inputs = f"data.inputs=[{data}/good.jsonl]"
    for sets, key in [(["run.name=demo%j"], "run.name"), (["run.name=a%%b"], "run.name")]:
        rc, _, err = _validate(capsys, tmp_path, inputs, *sets, profile="local-slurm")
        assert rc == 2 and len(err) == 1 and key in err[0] and "'%'" in err[0], err
    root = tmp_path / "out%j"
    rc, _, err = _run(capsys, "validate", TINY, "--set", f"run.output_root={root}", "--set", inputs)
    assert rc == 2 and len(err) == 1 and "run.output_root" in err[0], err
    rc, _, err = _run(capsys, "submit", TINY, "--dry-run", "--profile", "local-slurm", "--set", "run.name=x%jy",
                      "--set", f"run.output_root={tmp_path / 'r'}", "--set", inputs)
    assert rc == 2 and len(err) == 1 and not (tmp_path / "r").exists()


def test_env_passthrough_and_secret_names(capsys, tmp_path, data, monkeypatch, slurm_cluster):
    # slurm_cluster: with the local cluster's nodes on this host, tmp_path counts as shared
    inputs = f"data.inputs=[{data}/good.jsonl]"
    monkeypatch.delenv("HPCMEG_T_UNSET", raising=False)
    monkeypatch.setenv("HPCMEG_T_SET", "v")
    bad = [
        # blamed on the --set that gave the list
        ("cluster.env_passthrough=[HPCMEG_T_UNSET]",
         "--set cluster.env_passthrough=[HPCMEG_T_UNSET]: HPCMEG_T_UNSET is not set"),
        ("cluster.secret_env=[HPCMEG_T_UNSET]", "--set cluster.secret_env=[HPCMEG_T_UNSET]: HPCMEG_T_UNSET is not set"),
        ("cluster.env_passthrough=[1BAD]", "not a valid environment variable name"),
    ]
    for s, words in bad:
        rc, _, err = _validate(capsys, tmp_path, inputs, s, profile="local-slurm")
        assert rc == 2 and len(err) == 1 and words in err[0], err
    rc, _, err = _validate(capsys, tmp_path, inputs, "cluster.env_passthrough=[HPCMEG_T_SET]",
                           "cluster.env={HPCMEG_T_SET: x}", profile="local-slurm")
    assert rc == 2 and "also set in cluster.env" in err[0]
    # set: fine; a secret given a value in cluster.env needs nothing in the environment
    rc, _, err = _validate(capsys, tmp_path, inputs, "cluster.env_passthrough=[HPCMEG_T_SET]",
                           "cluster.secret_env=[HPCMEG_T_UNSET]", "cluster.env={HPCMEG_T_UNSET: s3cr3t-v4lue}",
                           profile="local-slurm")
    assert rc == 0, err
    # a credential-looking name in cluster.env, not marked: a warning (exit 0), the fix named
    rc, out, err = _validate(capsys, tmp_path, inputs, "cluster.env={WANDB_API_KEY: abc}", profile="local-slurm")
    assert rc == 0 and len(err) == 1 and "warning" in err[0] and "cluster.secret_env" in err[0]


def test_dry_run_where_output_root_cannot_be_created(capsys, tmp_path, data):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a regular file where a directory would go: mkdir fails even as root
    root = blocker / "runs"
    for profile in ("local-slurm", "local"):
        rc, out, err = _run(capsys, "submit", SMALL, "--dry-run", "--profile", profile,
                            "--set", f"run.output_root={root}")
        assert rc == 0, err
        assert "nothing was written" in err[-1] and str(root / "codeparrot-small") in err[-1]
        assert len([e for e in err if "nothing was written" in e]) == 1 and "Traceback" not in "\n".join(err)
        assert "# ---- resolved recipe" in out and "files written" not in out
        if profile == "local-slurm":
            assert "#SBATCH" in out and "srun" in out
    assert blocker.read_text() == "x" and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    # where it can be created, the files are written and listed (and steps follow the umask)
    old = os.umask(0o027)
    try:
        rc, out, err = _run(capsys, "submit", SMALL, "--dry-run", "--profile", "local-slurm",
                            "--set", f"run.output_root={tmp_path / 'ok'}")
    finally:
        os.umask(old)
    assert rc == 0 and "files written" in out
    step = tmp_path / "ok" / "codeparrot-small" / "scripts" / "train_step.sh"
    assert stat.S_IMODE(step.stat().st_mode) == 0o750
    assert stat.S_IMODE((step.parent / "train.sbatch").stat().st_mode) == 0o640


def test_cpu_ranks_are_not_gpus(capsys, tmp_path, data):
    rc, out, err = _run(capsys, "submit", TINY, "--dry-run", "--profile", "local-slurm",
                        "--set", f"run.output_root={tmp_path}", "--set", f"data.inputs=[{data}/good.jsonl]")
    assert rc == 0 and "GPU" not in out.replace("gpus_per_node", ""), [ln for ln in out.splitlines() if "GPU" in ln]
    rc, _, err = _validate(capsys, tmp_path, f"data.inputs=[{data}/good.jsonl]", "train.global_batch_size=10")
    assert rc == 2 and "CPU ranks" in err[0] and "GPU" not in err[0]


def test_first_line_reader_is_cheap_and_bounded(tmp_path):
    p = tmp_path / "big.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"text": "a"}\n')
        f.write(b"garbage that is never read\n" * 100000)
    assert checks.first_document_problems([str(p)], ["text"]) == ([], [])
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n" * 10)
    assert checks.first_document_problems([str(blank)], ["text"]) == ([], [])


def test_train_without_its_dataset_is_refused(capsys, tmp_path):
    rc, _, err = _run(capsys, "validate", TINY, "--stages", "train", "--set", f"run.output_root={tmp_path}",
                      "--set", f"data.data_path=[{tmp_path}/none/prefix]")
    assert rc == 2 and len(err) == 1, err
    assert f"--set data.data_path=[{tmp_path}/none/prefix]: no tokenized dataset" in err[0], err
    rc, _, err = _run(capsys, "validate", TINY, "--stages", "train,convert", "--set", f"run.output_root={tmp_path}")
    assert rc == 2 and len(err) == 1 and "--stages preprocess first" in err[0], err
    rc, _, err = _run(capsys, "submit", TINY, "--stages", "train", "--dry-run", "--profile", "local-slurm",
                      "--set", f"run.output_root={tmp_path}")
    assert rc == 0 and any("warning (dry run)" in e and "no dataset" in e for e in err), err
