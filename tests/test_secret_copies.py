"""A secret's value given again under a name that is not secret is refused before anything is written.

cluster.secret_env values travel by name only (hpcmeg/jobenv.py); every other cluster.env entry is
written into recipe.yaml and the batch scripts. The same value under a second, non-secret name would
put the secret there in clear. Through the real CLI (`validate`, `submit --dry-run`) with the local
profile, in-process (no torch import)."""
from __future__ import annotations

from pathlib import Path

from hpcmeg.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "codeparrot_tiny.yaml")
SECRET = "s3cr3t-v4lue-0042"


def _run(capsys, tmp_path, command, *sets):
    (tmp_path / "good.jsonl").write_text('{"content": "import os\\n"}\n')
    argv = [command, TINY, "--profile", "local", "--set", f"run.output_root={tmp_path / 'runs'}",
            "--set", f"data.inputs=[{tmp_path}/good.jsonl]"]
    for s in sets:
        argv += ["--set", s]
    if command == "submit":
        argv.append("--dry-run")
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


def test_a_secret_value_under_a_second_name_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HPCMEG_T_FROM_ENV", SECRET)
    cases = [  # (the secret given in cluster.env, or in the submitting environment)
        ("cluster.secret_env=[HPCMEG_T_TOKEN]", f"cluster.env={{HPCMEG_T_TOKEN: {SECRET}, MY_COPY: {SECRET}}}",
         "HPCMEG_T_TOKEN"),
        ("cluster.secret_env=[HPCMEG_T_FROM_ENV]", f"cluster.env={{MY_COPY: {SECRET}}}", "HPCMEG_T_FROM_ENV"),
    ]
    for secret, env, name in cases:
        for command in ("validate", "submit"):
            rc, out, err = _run(capsys, tmp_path, command, secret, env)
            assert rc == 2 and len(err) == 1, (command, err)
            assert f"MY_COPY holds the value of the secret {name} (cluster.secret_env)" in err[0], err
            assert "add MY_COPY to cluster.secret_env" in err[0], err
            # the refusal adds no value of its own (its prefix echoes the user's --set as typed)
            assert SECRET not in out and SECRET not in err[0].split("MY_COPY holds", 1)[1]
            assert not (tmp_path / "runs").exists()


def test_the_same_name_marked_secret_too_is_accepted(capsys, tmp_path):
    rc, out, err = _run(capsys, tmp_path, "submit", "cluster.secret_env=[HPCMEG_T_TOKEN, MY_COPY]",
                        f"cluster.env={{HPCMEG_T_TOKEN: {SECRET}, MY_COPY: {SECRET}}}")
    assert rc == 0, err
    assert SECRET not in out and "MY_COPY" in out  # passed by name (--export / inherited), never by value
