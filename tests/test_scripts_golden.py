"""Golden files of every script `hpcmeg submit` writes, and the quoting (injection) contract.

The sbatch text comes from submitit's own generator fed with our parameters (what `submit` really
submits); step scripts are ours. Regenerate after an intended change with
    HPCMEG_UPDATE_GOLDEN=1 python -m pytest -q tests/test_scripts_golden.py
and review the diff. shellcheck (when installed) must pass on all of them.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from hpcmeg.launch import scripts as S
from hpcmeg.launch.submit import absolutize
from hpcmeg.recipe import RecipeError, derive, load_recipe

GOLDEN = Path(__file__).parent / "golden"
HOST_PY = "/opt/hpcmeg/venv/bin/python"  # a fixed host interpreter so the files do not depend on this machine
INPUTS = [f"/lustre/datasets/codeparrot-clean-train/file-{i:012d}.jsonl.gz" for i in (1, 2, 3)]
UPDATE = os.environ.get("HPCMEG_UPDATE_GOLDEN") == "1"

CASES = {
    # name: (overrides, profile, scripts to compare)
    "small_1x8_apptainer": ([], None, ["preprocess.sbatch", "preprocess_step.sh", "merge.sbatch", "merge_step.sh",
                                       "train.sbatch", "train_step.sh", "convert.sbatch", "convert_step.sh"]),
    "small_2x8_apptainer": (["cluster.nodes=2"], None, ["train.sbatch", "train_step.sh"]),
    "small_2x8_pyxis": (["cluster.nodes=2"], "example-pyxis", ["train.sbatch", "train_step.sh", "preprocess_step.sh",
                                                              "convert_step.sh"]),
}


def render(overrides, profile, files=INPUTS, recipe=REPO / "recipes" / "codeparrot_small.yaml"):
    r = absolutize(load_recipe(recipe, overrides, profile))
    d = derive(r)
    plan = S.build_plan(r, d, files, HOST_PY)
    out = {}
    for job in plan.jobs:
        prev = [j.stage for j in plan.jobs]
        i = prev.index(job.stage)
        dep = f"afterok:{1000 + i - 1}" if i else None  # stand-in ids: the text around them is what matters
        out[f"{job.stage}.sbatch"] = S.render_sbatch(job, f"{d.run_dir}/submitit/{job.stage}", HOST_PY, dep)
        out[f"{job.stage}_step.sh"] = job.step_script
    return out, plan


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_scripts(case):
    overrides, profile, names = CASES[case]
    texts, _ = render(overrides, profile)
    for name in names:
        path = GOLDEN / f"{case}__{name.replace('.', '_')}.sh"
        if UPDATE:
            GOLDEN.mkdir(exist_ok=True)
            path.write_text(texts[name])
        assert path.exists(), f"{path} missing: run with HPCMEG_UPDATE_GOLDEN=1 once and review it"
        assert texts[name] == path.read_text(), f"{name} of case {case} differs from {path}"


def test_golden_content_is_what_the_design_says():
    texts, plan = render([], None)
    train = texts["train.sbatch"]
    for flag in ("--requeue", "--signal=TERM@300", "--open-mode=append", "--ntasks-per-node=8", "--gpus-per-node=8",
                 "--nodes=1", "--exclusive", "--mem=0", "--dependency=afterok:1001"):
        assert f"#SBATCH {flag}\n" in train, flag
    assert "USR2" not in train and "wckey" not in train  # submitit's defaults overridden / dropped
    assert "-m submitit.core._submit" in train and "srun" not in train  # supervisor in the batch shell
    step = texts["train_step.sh"]
    assert "exec srun --nodes=1 --ntasks-per-node=8" in step and "--kill-on-bad-exit=1" in step
    assert "apptainer exec --nv --bind" in step and "/lustre/containers/hpcmeg.sif" in step
    assert "python3 -u -m hpcmeg.cli train /lustre/scratch/hpcmeg/runs/codeparrot-small/recipe.yaml" in step
    conv = texts["convert.sbatch"]
    assert "#SBATCH --kill-on-invalid-dep=yes\n" in conv and "#SBATCH --dependency=afterok:1002\n" in conv
    assert "--nv" not in texts["convert_step.sh"]  # CPU steps do not need the driver libraries
    assert plan.job("preprocess").array == 3 and "#SBATCH --array=0-2%3\n" in texts["preprocess.sbatch"]
    pyxis, _ = render(["cluster.nodes=2"], "example-pyxis")
    assert "--container-image=/lustre/containers/hpcmeg.sqsh" in pyxis["train_step.sh"]
    assert "--container-mounts=" in pyxis["train_step.sh"] and "apptainer" not in pyxis["train_step.sh"]
    assert "#SBATCH --nodes=2\n" in pyxis["train.sbatch"]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_golden_and_plain_sbatch_scripts_pass_shellcheck():
    files = sorted(GOLDEN.glob("*.sh")) + [REPO / "slurm" / "train.sh", REPO / "slurm" / "convert.sh"]
    assert len(files) > 2
    r = subprocess.run(["shellcheck", "-s", "bash", *map(str, files)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


# ----------------------------------------------------------------------------- injection

NASTY = "x$(touch CANARY)`touch CANARY2`; touch CANARY3 'q\" $HOME"
NASTY_NL = NASTY + "\nline2 $(touch CANARY4)"


def _nasty_recipe(tmp_path):
    root = tmp_path / "out $(touch CANARY5);'"
    overrides = [f"run.name={json.dumps(NASTY)}", f"run.output_root={json.dumps(str(root))}",
                 f"cluster.env={{INJ: {json.dumps(NASTY_NL)}}}", f"container.binds=[{json.dumps('/data $(x)')}]",
                 f"data.vocab_file={json.dumps(str(tmp_path / 'v;`x`.json'))}",
                 f"cluster.partition={json.dumps('debug;rm')}"]
    (tmp_path / "v;`x`.json").write_text(json.dumps({str(i): i for i in range(300)}))
    return overrides, root


def test_metacharacters_stay_literal_in_every_script(tmp_path):
    overrides, root = _nasty_recipe(tmp_path)
    files = [str(tmp_path / "in $(touch CANARY6) `x`.jsonl"), str(tmp_path / "b;c.jsonl")]
    texts, plan = render(overrides + ["container.runtime=apptainer", "container.image=/img $(x).sif"], None, files)
    # 1. bash parses every script; the #SBATCH lines survived as single lines
    for name, text in texts.items():
        r = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert r.returncode == 0, (name, r.stderr)
        assert "\n#SBATCH --partition='debug;rm'\n" in text or "step" in name
    # 2. run the setup part of the sbatch script: the env value arrives byte for byte, nothing executes
    setup = texts["train.sbatch"].split("# setup\n")[1].split("# command\n")[0]
    r = subprocess.run(["bash", "-c", setup + '\nprintf %s "$INJ"'], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == NASTY_NL
    # 3. run the step scripts with a stand-in srun that records its argv: every value is one literal word
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "srun"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="7")
    for name in ("preprocess_step.sh", "train_step.sh", "convert_step.sh"):
        args = {"preprocess_step.sh": ["/o $(x)/p", *files], "train_step.sh": [],
                "convert_step.sh": ["10", "/out `x`/iter"]}[name]
        r = subprocess.run(["bash", "-c", texts[name], name, *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True)
        assert r.returncode == 0, (name, r.stderr)
        argv = json.loads(r.stdout)
        assert "/img $(x).sif" in argv and "--bind" in argv and "/data $(x):/data $(x)" in argv
        if name == "train_step.sh":
            assert argv[-1] == str(root / NASTY / "recipe.yaml")
            assert any(a.startswith("--output=" + str(root / NASTY / "logs" / "train" / "train.7.r0.")) for a in argv)
        if name == "preprocess_step.sh":
            assert argv[-3:] == ["--input", *files] and str(tmp_path / "v;`x`.json") in argv
            assert argv[argv.index("--output-prefix") + 1] == "/o $(x)/p"
        if name == "convert_step.sh":
            assert argv[-5:] == ["/out `x`/iter", "--iteration", "10", "--dtype", "fp32"]
    assert not list(tmp_path.rglob("CANARY*")) and not list(Path.cwd().glob("CANARY*"))


def test_values_that_cannot_be_written_safely_are_refused(tmp_path):
    for bad, key in ([f"run.name={json.dumps('a' + chr(10) + 'b')}"], "run.name"), \
                    ([f"cluster.account={json.dumps('acct' + chr(10) + 'touch x')}"], "cluster.account"), \
                    (["cluster.env={'BAD NAME': 1}"], "cluster.env"), \
                    (["run.output_root=/tmp/back\\\\slash"], "run.output_root"), \
                    (["container.runtime=pyxis", "container.image=img", "container.binds=['/a,b']"], "container.binds"):
        with pytest.raises((ValueError, RecipeError), match=key.replace(".", r"\.")):
            render(bad, None)


def test_percent_in_run_dir_is_escaped_for_slurm_patterns():
    texts, _ = render(["run.name=run%j"], None)
    assert "logs/train/train.%j.batch.log" in texts["train.sbatch"]
    assert "/runs/run%%j/logs/train/train.%j.batch.log" in texts["train.sbatch"]
    assert "run%%j/logs/train/train." in texts["train_step.sh"]
    assert "/runs/run%j/recipe.yaml" in texts["train_step.sh"]  # not a pattern: unchanged


def test_job_names_are_plain():
    assert S.job_name("my run $(x);\n", "train") == "hpcmeg-train-my_run___x___"


def test_convert_array_size_and_shard_groups():
    r = load_recipe(REPO / "recipes" / "codeparrot_tiny.yaml", ["convert.iterations=all", "train.train_iters=250",
                                                                  "checkpoint.save_interval=100",
                                                                  "checkpoint.keep_last=null"])
    assert S.convert_task_count(r, 250) == 3  # 100, 200 and the final 250
    r2 = load_recipe(REPO / "recipes" / "codeparrot_tiny.yaml", ["convert.iterations=all"])
    assert S.convert_task_count(r2, 200) == 2  # 100, 200 (keep_last 3 does not bind)
    assert S.convert_task_count(load_recipe(REPO / "recipes" / "codeparrot_tiny.yaml", ["convert.iterations='10,30'"]),
                                200) == 2
    assert S.shard_groups(list("abcde"), 2) == [["a", "b", "c"], ["d", "e"]]
    assert S.shard_groups(list("abc"), 0) == [["a"], ["b"], ["c"]]
    assert S.shard_groups(list("ab"), 5) == [["a"], ["b"]]


def test_paths_the_container_cannot_see_are_reported():
    from hpcmeg.launch.submit import unbound_paths

    r = absolutize(load_recipe(REPO / "recipes" / "codeparrot_small.yaml", ["data.vocab_file=/home/me/vocab.json"]))
    warn = unbound_paths(r, derive(r, orig_vocab_size=50257), INPUTS + ["/scratch/x.jsonl"])
    assert len(warn) == 1 and "data.vocab_file '/home/me/vocab.json'" in warn[0]  # /lustre/... is bound
    r2 = absolutize(load_recipe(REPO / "recipes" / "codeparrot_tiny.yaml", ["data.vocab_file=/home/me/vocab.json"]))
    assert unbound_paths(r2, derive(r2, orig_vocab_size=50257), []) == []  # no container: nothing to bind
