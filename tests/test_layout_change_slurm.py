"""Changing the tensor/pipeline layout of a run that already has a checkpoint, on the local Slurm cluster.

A real train job (TP1, 2 data-parallel CPU ranks) leaves a checkpoint; `submit` and `validate` with
``--set parallel.tensor=2`` then exit non-zero with one line naming both layouts, a fresh run.name
and the exact `hpcmeg reshard` command, and the run directory is byte for byte and mtime for mtime
what it was. The suggested command, run as printed, makes the checkpoint a TP2 train job resumes
from (a real Slurm job); a data-parallel-only change is accepted; a changed virtual pipeline and a
`checkpoint.load` at another layout are refused the same way. What `hpcmeg demo` says before
re-running an unfinished run (hpcmeg.demo.earlier_attempt) is checked on the same run directory.
"""
from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO
from cli_helpers import TINY, hpcmeg, sets

pytestmark = pytest.mark.slurm

RECIPE = str(REPO / "recipes" / "codeparrot_tiny.yaml")


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root: directories by name, files by (size, mtime_ns, sha256)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            out[rel] = ("dir",)
        else:
            st = p.stat()
            out[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def refusal(*args: str) -> str:
    """Run hpcmeg expecting a refusal; its one stderr line."""
    r = hpcmeg(*args, check=False)
    assert r.returncode != 0, r.stdout[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


@pytest.mark.slow  # 60-120 s on 2 busy cores: two real train jobs and two reshards
def test_layout_change_is_refused_untouched_and_the_suggested_reshard_resumes(slurm_cluster, tmp_path, tiny_dataset,
                                                                              monkeypatch):
    over = TINY + ["model.num_layers=4", f"run.output_root={tmp_path / 'runs'}", f"data.data_path=[{tiny_dataset}]",
                   "train.train_iters=4", "checkpoint.save_interval=0"]
    slurm = ["--profile", "local-slurm"]
    hpcmeg("submit", RECIPE, *slurm, *sets(over), "--stages", "train", "--wait", cwd=tmp_path, timeout=400)
    run = tmp_path / "runs" / "codeparrot-tiny"
    ckpt = run / "checkpoints"
    assert (ckpt / "iter_0000004" / "mp_rank_00").is_dir() and not (ckpt / "iter_0000004" / "mp_rank_01").exists()
    before = snapshot(run)

    # submit and validate: one line, both layouts, the two ways out; nothing in the run directory changes
    copy = f"{ckpt}-tp2-pp1"
    for command in ("submit", "validate"):
        line = refusal(command, RECIPE, *slurm, *sets(over + ["parallel.tensor=2"]))
        assert (f"checkpoint.dir {ckpt} holds iteration 4 at tensor=1 pipeline=1; this recipe asks tensor=2 "
                f"pipeline=1" in line), line
        assert "another run.name (--set run.name=codeparrot-tiny-tp2-pp1)" in line, line
        assert (f"hpcmeg reshard {ckpt} {copy} --tp 2 --pp 1, then submit again with "
                f"--set checkpoint.dir={copy}" in line), line
        assert snapshot(run) == before, command

    # what a re-run over this unfinished run (train done, never converted) says before it submits
    from hpcmeg.demo import earlier_attempt
    from hpcmeg.launch.submit import prepare
    from hpcmeg.recipe import load_recipe

    monkeypatch.chdir(tmp_path)  # relative recipe paths resolve as they did for the submissions
    said = earlier_attempt(prepare(load_recipe(RECIPE, over, "local-slurm"), ("train", "convert")))
    assert said == f"{run} holds an unfinished earlier attempt: train is done (checkpoint at iteration 4/4; the " \
                   f"job only confirms it), convert runs", said
    said = earlier_attempt(prepare(load_recipe(RECIPE, over + ["train.train_iters=8"], "local-slurm")))
    assert "the recipe's train section(s) differ from its recipe.yaml" in said, said
    assert "train resumes from its checkpoint at iteration 4/8" in said, said

    # only the data-parallel size changes (1 rank instead of 2): the checkpoint resumes as it is
    hpcmeg("validate", RECIPE, *slurm, *sets(over + ["cluster.cpu_tasks_per_node=1"]))

    # the printed command, run as printed, then the printed --set: a TP2 train job resumes from the copy
    cmd, again = re.search(r"(hpcmeg reshard .*?), then submit again with --set (\S+)$", line).groups()
    hpcmeg(*shlex.split(cmd)[1:])
    assert snapshot(run).items() >= before.items()  # the old checkpoint is kept as it was
    ready = refusal("validate", RECIPE, *slurm, *sets(over + ["parallel.tensor=2"]))
    assert f"{copy} already holds it resharded to tensor=2 pipeline=1: submit again with --set {again}" in ready
    hpcmeg("submit", RECIPE, *slurm, *sets(over + ["parallel.tensor=2", again]), "--stages", "train", "--wait",
           cwd=tmp_path, timeout=400)
    starts = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"start"' in x]
    last = starts[-1]
    assert last["start"] == f"resumed from {copy} at iteration 4", last["start"]
    assert (last["tensor_parallel_size"], last["data_parallel_size"]) == (2, 1)

    # a changed virtual pipeline is a layout change too: refused with --vpp in the command
    pp2 = f"{ckpt}-tp1-pp2"
    hpcmeg("reshard", str(ckpt), pp2, "--tp", "1", "--pp", "2")
    vpp = over + ["parallel.pipeline=2", "parallel.virtual_pipeline=2", f"checkpoint.dir={pp2}"]
    line = refusal("validate", RECIPE, *slurm, *sets(vpp))
    assert (f"checkpoint.dir {pp2} holds iteration 4 at tensor=1 pipeline=2 virtual_pipeline=1; this recipe asks "
            f"tensor=1 pipeline=2 virtual_pipeline=2" in line), line
    assert f"hpcmeg reshard {pp2} {pp2}-tp1-pp2-vpp2 --tp 1 --pp 2 --vpp 2" in line
    assert "another checkpoint.dir" in line  # the recipe sets it: another run.name would find the same one

    # a run without a checkpoint starting from checkpoint.load's weights: the same check, on that directory
    load = over + ["parallel.tensor=2", f"checkpoint.dir={tmp_path / 'empty'}", f"checkpoint.load={ckpt}"]
    line = refusal("validate", RECIPE, *slurm, *sets(load))
    assert f"checkpoint.load {ckpt} holds iteration 4 at tensor=1 pipeline=1" in line, line
    assert f"submit again with --set checkpoint.load={copy}" in line, line
