"""The hpcmeg command: help texts, recipe errors as exit 2 with one line each, dry-run validation."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import hpcmeg_cmd

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["submit", "preprocess", "train", "convert", "status", "logs", "cancel", "doctor",
               "prepare-cache", "reshard", "import-hf", "plot", "validate"]


def run(*args, cwd=REPO, **kw):
    return subprocess.run([*hpcmeg_cmd(), *args], capture_output=True, text=True, cwd=cwd, timeout=120, **kw)


def test_top_level_help_lists_subcommands():
    r = run("--help")
    assert r.returncode == 0
    for sub in ["submit", "preprocess", "train", "convert", "status", "logs", "cancel", "doctor"]:
        assert sub in r.stdout


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_subcommand_help(sub):
    r = run(sub, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout.lower()
    assert len(r.stdout.splitlines()) >= 3


def test_misspelled_section_exits_2_with_one_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text((REPO / "recipes/codeparrot_tiny.yaml").read_text().replace("\ntrain:", "\ntrian:"))
    (tmp_path / "runs" / "corpus").mkdir(parents=True)  # the recipe's input exists: the typo is the one problem
    (tmp_path / "runs" / "corpus" / "stdlib.jsonl").write_text('{"content": "print(1)"}\n')
    r = run("validate", str(p), cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "trian" in lines[0] and "did you mean 'train'" in lines[0]
    assert "Traceback" not in r.stderr


def test_bad_batch_exits_2(tmp_path):
    r = run("validate", "recipes/codeparrot_small.yaml", "--set", "train.global_batch_size=190")
    assert r.returncode == 2
    assert "190" in r.stderr and "micro_batch_size=12" in r.stderr and "8" in r.stderr
    assert "Traceback" not in r.stderr


def test_validate_prints_derived(tmp_path, slurm_cluster):
    # slurm_cluster: the recipe's /lustre output root and this venv pass the node-local checks only
    # because the local cluster's nodes are this host
    data = tmp_path / "shard.jsonl"
    data.write_text('{"content": "print(1)"}\n')
    image = tmp_path / "hpcmeg.sif"  # submit's checks (which validate runs) refuse an image that is not there
    image.write_text("stand-in\n")
    r = run("validate", "recipes/codeparrot_small.yaml", "--set", f"data.inputs=[{data}]",
            "--set", f"container.image={image}")
    assert r.returncode == 0, r.stderr
    assert "grad_accum_steps: 2" in r.stdout and "padded_vocab_size: 50304" in r.stdout


def test_submit_dry_run_codeparrot_small(tmp_path):
    # the data lives on a cluster's filesystem, not here: the dry run still renders every script
    r = run("submit", "recipes/codeparrot_small.yaml", "--dry-run", "--set", f"run.output_root={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "grad_accum_steps: 2" in r.stdout and "padded_vocab_size: 50304" in r.stdout
    run_dir = tmp_path / "codeparrot-small"
    assert (run_dir / "recipe.yaml").exists()
    scripts = list((run_dir / "scripts").glob("*"))
    assert any("train" in p.name for p in scripts)
    train = next(p for p in scripts if p.name.startswith("train") and p.suffix == ".sbatch").read_text()
    assert "--requeue" in train and "--signal=TERM@" in train


def test_passthrough_tools_start_without_blas_threads_or_recipe(monkeypatch):
    """`hpcmeg preprocess` & co.: OpenBLAS asked for no threads before numpy is imported (a user's
    own setting wins), and a normal return never imports hpcmeg.recipe (cli._recipe_error)."""
    import os
    import sys

    from hpcmeg import cli

    monkeypatch.setitem(cli.PASSTHROUGH, "probe", ("builtins", "len", "a test tool"))
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert cli.main(["probe", "x", "y"]) == 2  # len(["x", "y"]): the tool's return value is the exit code
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    cli.main(["probe"])
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"
    code = ("import sys; from hpcmeg import cli; cli.PASSTHROUGH['probe'] = ('builtins', 'len', ''); "
            "cli.main(['probe']); print('hpcmeg.recipe' in sys.modules, 'numpy' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.stdout.split() == ["False", "False"], r.stderr
