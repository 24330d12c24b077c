"""Golden files of every script `hpcmeg submit` writes, and the quoting (injection) contract.

The sbatch text comes from submitit's own generator fed with our parameters (what `submit` really
submits); step scripts are ours. Regenerate after an intended change with
    HPCMEG_UPDATE_GOLDEN=1 python -m pytest -q tests/test_scripts_golden.py
and review the diff. shellcheck (slurm/setup-dev.sh installs it) must pass on all of them, on the
scripts of every packaged profile x recipe, and on the hand-driven slurm/*.sh.
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


def render(overrides, profile, files=INPUTS, recipe=REPO / "recipes" / "codeparrot_small.yaml", probe=False):
    r = absolutize(load_recipe(recipe, overrides, profile))
    d = derive(r)
    plan = S.build_plan(r, d, files, HOST_PY, probe=probe)
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
    # every job that waits for another is cancelled when that one fails (no kill_invalid_depend needed)
    for name, text in texts.items():
        if name.endswith(".sbatch"):
            assert ("#SBATCH --dependency=" in text) == ("#SBATCH --kill-on-invalid-dep=yes\n" in text), name
    assert "--dependency" not in texts["preprocess.sbatch"] and "--dependency=afterok:1000" in texts["merge.sbatch"]
    # the supervisor runs the compute-node interpreter; the step's command checks its hpcmeg version
    assert f"{HOST_PY} -u -m submitit.core._submit" in train
    assert f"export HPCMEG_VERSION_FILE={plan.run_dir}/hpcmeg_version.json" in step
    assert "unset PYTHONPATH PYTHONHOME VIRTUAL_ENV" in step  # the host venv never leaks into the image
    assert "--nv" not in texts["convert_step.sh"]  # CPU steps do not need the driver libraries
    assert plan.job("preprocess").array == 3 and "#SBATCH --array=0-2%3\n" in texts["preprocess.sbatch"]
    pyxis, _ = render(["cluster.nodes=2"], "example-pyxis")
    assert "--container-image=/lustre/containers/hpcmeg.sqsh" in pyxis["train_step.sh"]
    assert "--container-mounts=" in pyxis["train_step.sh"] and "apptainer" not in pyxis["train_step.sh"]
    assert "#SBATCH --nodes=2\n" in pyxis["train.sbatch"]


PROFILES = sorted(p.stem for p in (REPO / "hpcmeg" / "profiles").glob("*.yaml"))
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def _every_packaged_script():
    """{(profile, recipe, script name): text} of every Slurm profile x recipe (3 input shards)."""
    out = {}
    for prof in PROFILES:
        for rec in RECIPES:
            r = load_recipe(rec, [], prof)
            if r.cluster.executor != "slurm":
                continue
            texts, _ = render([], prof, recipe=rec)
            out.update({(prof, rec.stem, k): v for k, v in texts.items()})
    return out


def test_every_generated_and_plain_script_passes_shellcheck(tmp_path):
    assert shutil.which("shellcheck"), "shellcheck is not installed: bash slurm/setup-dev.sh installs it (apt)"
    files = sorted(GOLDEN.glob("*.sh")) + sorted((REPO / "slurm").glob("*.sh")) + [REPO / "containers" / "build.sh"]
    scripts = _every_packaged_script()
    texts, _ = render(["cluster.cpu_partition=cpu", "cluster.python=/shared/venv/bin/python"], "local-slurm",
                      probe=True)  # the smoke test's train step too
    scripts.update({("probe", "small", k): v for k, v in texts.items()})
    assert len(scripts) >= 3 * 3 * 8 - 8
    for (prof, rec, name), text in scripts.items():
        p = tmp_path / f"{prof}__{rec}__{name}.sh"
        p.write_text(text)
        files.append(p)
    r = subprocess.run(["shellcheck", "-s", "bash", *map(str, files)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


def _recording_srun(tmp_path: Path) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "srun"  # records its argv, NUL-separated, one file per call (a stand-in: no Slurm here)
    fake.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$SRUN_LOG/$$.$RANDOM"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "srun-calls").mkdir(exist_ok=True)
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SRUN_LOG=str(tmp_path / "srun-calls"),
                SLURM_JOB_ID="7")


def _srun_calls(tmp_path: Path) -> list[list[str]]:
    calls = []
    for p in sorted((tmp_path / "srun-calls").iterdir()):
        calls.append(p.read_bytes().decode().split("\0")[:-1])
        p.unlink()
    return calls


def test_every_srun_passes_cpus_per_task(tmp_path):
    """Slurm 22.05+ does not hand the job's --cpus-per-task to a step: every srun must say it (else a rank
    or a tokenizer pool gets one core where CPU binding is on)."""
    env = _recording_srun(tmp_path)
    for (prof, rec, name), text in _every_packaged_script().items():
        if not name.endswith("_step.sh"):
            continue
        r = load_recipe(REPO / "recipes" / f"{rec}.yaml", [], prof)
        want = r.cluster.cpus_per_task if name == "train_step.sh" else S.cpu_stage_cpus(r)
        args = {"preprocess_step.sh": ["/o/p", "/i/a.jsonl"], "convert_step.sh": ["10", "/out/iter"]}.get(name, [])
        res = subprocess.run(["bash", "-c", text, name, *args], env=env, capture_output=True, text=True)
        assert res.returncode == 0, (prof, rec, name, res.stderr)
        calls = _srun_calls(tmp_path)
        assert calls and all(f"--cpus-per-task={want}" in c for c in calls), (prof, rec, name, calls)
    # the hand-driven scripts take it from the job (SLURM_CPUS_PER_TASK)
    env = dict(env, SLURM_CPUS_PER_TASK="3", HPCMEG="true")
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000010").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("10")
    (run / "recipe.yaml").write_text("{}\n")
    (tmp_path / "p.shards.txt").write_text("/i/a.jsonl\n")
    cases = {"train.sh": {"RECIPE": str(run / "recipe.yaml")},
             "convert.sh": {"CKPT_DIR": str(run / "checkpoints"), "OUT_DIR": str(run / "hf")},
             "preprocess.sh": {"MODE": "shard", "SLURM_ARRAY_TASK_ID": "0", "OUTPUT_PREFIX": str(tmp_path / "p"),
                               "CONTAINER_RUNTIME": "pyxis", "IMAGE": "/img.sqsh"}}
    for script, extra in cases.items():
        res = subprocess.run(["bash", str(REPO / "slurm" / script)], env={**env, **extra}, capture_output=True,
                             text=True, cwd=tmp_path)
        assert res.returncode == 0, (script, res.stdout, res.stderr)
        calls = _srun_calls(tmp_path)
        assert len(calls) == 1 and "--cpus-per-task=3" in calls[0], (script, calls)


def test_cpu_stages_go_to_the_cpu_partition():
    texts, plan = render(["cluster.cpu_partition=cpu"], None)
    for stage in ("preprocess", "merge", "convert"):
        assert "#SBATCH --partition=cpu\n" in texts[f"{stage}.sbatch"] and "--gpus" not in texts[f"{stage}.sbatch"]
    assert "#SBATCH --partition=gpu\n" in texts["train.sbatch"]
    # without cpu_partition (the example profile sets one) every job goes to cluster.partition
    default, _ = render(["cluster.cpu_partition=null"], None)
    assert all("#SBATCH --partition=gpu\n" in t for n, t in default.items() if n.endswith(".sbatch"))
    feat, _ = render(["cluster.cpu_partition=cpu", "cluster.constraint=a100"], None)
    assert "#SBATCH --constraint=a100\n" in feat["train.sbatch"] and "--constraint" not in feat["convert.sbatch"]


def test_smoke_train_step_probes_the_same_ranks_first():
    texts, _ = render([], None, probe=True)
    step = texts["train_step.sh"]
    probe, train = step.index("smoke-probe"), step.index("hpcmeg.cli train")
    assert probe < train and "|| exit $?" in step[probe:train] and step.count("--ntasks-per-node=8") == 2


# ----------------------------------------------------------------------------- injection

NASTY = "x$(touch CANARY)`touch CANARY2`; touch CANARY3 'q\" $HOME"
NASTY_NL = NASTY + "\nline2 $(touch CANARY4)"


def _nasty_recipe(tmp_path):
    root = tmp_path / "out $(touch CANARY5);'"
    overrides = [f"run.name={json.dumps(NASTY)}", f"run.output_root={json.dumps(str(root))}",
                 f"cluster.env={{INJ: {json.dumps(NASTY_NL)}}}", f"container.binds=[{json.dumps('/data $(x)')}]",
                 f"data.vocab_file={json.dumps(str(tmp_path / 'v;`x`.json'))}",
                 f"cluster.partition={json.dumps('debug;rm')}", f"cluster.cpu_partition={json.dumps('debug;rm')}"]
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
