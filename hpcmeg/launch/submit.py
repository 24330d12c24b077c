"""`hpcmeg submit RECIPE`: recipe -> run directory -> preprocess / train / convert jobs (Slurm or local).

Contract: ``cli_submit(args) -> exit code`` (args: recipe, overrides, profile, dry_run, stages, wait),
``prepare(recipe, stages) -> Prepared`` (resolved recipe with absolute paths, derived values, expanded
inputs, whether the dataset can be reused, the plan) and ``submit_plan(prep) -> {stage: job id}``.

Order of work: validate -> make every path absolute (jobs and containers do not share the login
shell's cwd) -> expand data.inputs -> reuse the dataset when its manifest matches (inputs' paths,
sizes, mtimes and the tokenizer) -> write recipe.yaml, scripts/*.sbatch and scripts/*_step.sh ->
(--dry-run: print them and stop) -> refuse if this run still has jobs in the queue -> submit each
stage through submitit with ``afterok`` on the previous one, recording jobs.json after every
submission (a failure mid-chain still leaves ids for ``hpcmeg cancel``).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpcmeg.launch import scripts as S
from hpcmeg.launch.container import ContainerError
from hpcmeg.launch.rundir import RunDir, dataset_is_current, input_manifest, read_json, write_atomic, write_jobs
from hpcmeg.recipe import Recipe, RecipeError, derive, dump_yaml, load_recipe, write_resolved

ALL_STAGES = ("preprocess", "train", "convert")


@dataclass
class Prepared:
    recipe: Recipe
    derived: object
    run: RunDir
    files: list[str]
    skip_preprocess: bool
    stages: tuple[str, ...]
    plan: Optional[S.Plan] = None


def _abs(p: Optional[str]) -> Optional[str]:
    return None if not p else os.path.abspath(os.path.expanduser(p))


def absolutize(r: Recipe) -> Recipe:
    """Every path of the recipe made absolute against this process's cwd (globs keep their wildcards)."""
    d = r.data
    blend = list(d.data_path)
    if len(blend) == 1:
        blend = [_abs(str(blend[0]))]
    elif blend:
        blend = [x if i % 2 == 0 else _abs(str(x)) for i, x in enumerate(blend)]
    data = dataclasses.replace(d, inputs=[_abs(x) for x in d.inputs], vocab_file=_abs(d.vocab_file),
                               merge_file=_abs(d.merge_file), tokenizer_model=_abs(d.tokenizer_model),
                               output_prefix=_abs(d.output_prefix), data_path=blend,
                               index_cache_dir=_abs(d.index_cache_dir))
    ck = dataclasses.replace(r.checkpoint, dir=_abs(r.checkpoint.dir), load=_abs(r.checkpoint.load))
    cv = dataclasses.replace(r.convert, output_dir=_abs(r.convert.output_dir))
    run = dataclasses.replace(r.run, output_root=_abs(r.run.output_root))
    return dataclasses.replace(r, run=run, data=data, checkpoint=ck, convert=cv)


def expand_inputs(specs: list[str], allow_missing: bool = False) -> list[str]:
    """data.inputs -> sorted files per spec, in spec order; one line per spec that matches nothing.

    With ``allow_missing`` (``--dry-run`` on a machine that does not see the data, e.g. a laptop
    rendering a cluster's scripts) an unmatched spec stays as one literal shard and a warning is
    printed instead of an error."""
    out, bad = [], []
    for spec in specs:
        if any(c in spec for c in "*?["):
            found = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
        else:
            found = [spec] if os.path.isfile(spec) else []
        if not found:
            bad.append(f"data.inputs: '{spec}' matches no file (paths are relative to the directory you submit from)")
        out += found
    if bad and allow_missing:
        for line in bad:
            print(f"hpcmeg submit: warning (dry run): {line}; kept as one literal shard", file=sys.stderr)
        return out + [spec for spec in specs if not any(f == spec or fnmatch.fnmatch(f, spec) for f in out)]
    if bad:
        raise RecipeError(bad)
    return out


def parse_stages(text: str) -> tuple[str, ...]:
    st = tuple(s.strip() for s in str(text).split(",") if s.strip())
    bad = [s for s in st if s not in ALL_STAGES]
    if bad or not st:
        raise RecipeError([f"--stages: '{text}' must be a comma list of {', '.join(ALL_STAGES)}"])
    return tuple(s for s in ALL_STAGES if s in st)


def prepare(r: Recipe, stages: tuple[str, ...] = ALL_STAGES, host_python: Optional[str] = None,
            dry_run: bool = False) -> Prepared:
    r = absolutize(r)
    d = derive(r)
    run = RunDir(Path(d.run_dir))
    files: list[str] = []
    skip = False
    if "preprocess" in stages and not r.data.data_path:
        files = expand_inputs(r.data.inputs, allow_missing=dry_run)
        outs = S.dataset_outputs(d.data_prefix, r)
        if all(os.path.isfile(f) for f in files):  # (a dry run may carry unmatched specs)
            skip = dataset_is_current(d.data_prefix, outs, input_manifest(files, S.tokenizer_settings(r)))
    prep = Prepared(r, d, run, files, skip, stages)
    if r.cluster.executor == "slurm":
        warnings = unbound_paths(r, d, files)
        try:
            prep.plan = S.build_plan(r, d, files, host_python or sys.executable, stages, skip_preprocess=skip)
        except (S.ScriptError, ContainerError) as e:
            raise RecipeError([str(e)]) from None
        prep.plan.notes += warnings
    return prep


def unbound_paths(r: Recipe, d, files: list[str]) -> list[str]:
    """Warnings for recipe paths a container would not see (not under the run dir or container.binds)."""
    if r.container.runtime == "none":
        return []
    roots = [d.run_dir] + [b.split(":")[0] for b in r.container.binds]
    paths = {"data.inputs": files[0] if files else None, "data.vocab_file": r.data.vocab_file,
             "data.merge_file": r.data.merge_file, "data.tokenizer_model": r.data.tokenizer_model,
             "data.output_prefix": r.data.output_prefix, "checkpoint.dir": d.checkpoint_dir,
             "checkpoint.load": r.checkpoint.load, "convert.output_dir": r.convert.output_dir}
    out = []
    for key, p in paths.items():
        if p and not any(os.path.abspath(p) == x or os.path.abspath(p).startswith(x.rstrip("/") + "/") for x in roots):
            out.append(f"warning: {key} '{p}' is outside the run directory and container.binds; the container "
                       f"will not see it unless the image or the site binds it (add its parent to container.binds)")
    return out


def write_run_files(prep: Prepared, dependencies: Optional[dict[str, str]] = None) -> list[Path]:
    """recipe.yaml, the step scripts and the sbatch scripts (dependencies as placeholders unless given)."""
    run = prep.run.create()
    written = [write_resolved(prep.recipe, run.recipe)]
    for job in prep.plan.jobs if prep.plan else []:
        written.append(write_atomic(run.step_script(job.stage), job.step_script, mode=0o755))
        dep = (dependencies or {}).get(job.stage, _placeholder_dependency(prep.plan, job.stage))
        text = S.render_sbatch(job, str(run.submitit(job.stage)), shlex.quote(sys.executable), dep)
        written.append(write_atomic(run.sbatch_script(job.stage), text))
    return written


def _previous_stage(plan: S.Plan, stage: str) -> Optional[str]:
    stages = [j.stage for j in plan.jobs]
    i = stages.index(stage)
    return stages[i - 1] if i > 0 else None


def _placeholder_dependency(plan: S.Plan, stage: str) -> Optional[str]:
    prev = _previous_stage(plan, stage)
    return f"afterok:<{prev} job id>" if prev else None


def active_jobs(run: RunDir) -> list[str]:
    """Job ids of this run's last submission that Slurm still has queued or running."""
    rec = read_json(run.jobs, None)
    if not rec or rec.get("executor") != "slurm":
        return []
    ids = [s["job_id"] for s in rec.get("stages", {}).values() if s.get("job_id")]
    if not ids:
        return []
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%A", "-j", ",".join(ids)], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({x.strip() for x in out.split() if x.strip()})


def submit_plan(prep: Prepared) -> dict[str, str]:
    """Submit every job of the plan in order; returns {stage: job id} (array jobs: the array's id)."""
    import submitit

    from hpcmeg.launch.supervisor import run_task

    run, plan = prep.run, prep.plan
    record = {"executor": "slurm", "submitted": time.time(), "recipe": str(run.recipe), "stages": {}}
    ids: dict[str, str] = {}
    write_jobs(run, record)  # an earlier submission's record moves to "history"
    for job in plan.jobs:
        prev = _previous_stage(plan, job.stage)
        dep = f"afterok:{ids[prev]}" if prev else None
        folder = run.submitit(job.stage)
        # the script as submitted, dependency included (submitit keeps its own copy in the folder too)
        write_atomic(run.sbatch_script(job.stage),
                     S.render_sbatch(job, str(folder), shlex.quote(sys.executable), dep))
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
        ex.update_parameters(**job.params, **({"dependency": dep} if dep else {}))
        if job.array:
            jobs = ex.map_array(run_task, job.tasks)
            jid = str(jobs[0].job_id).split("_")[0]
        else:
            jid = str(ex.submit(run_task, job.tasks[0]).job_id)
        ids[job.stage] = jid
        extra = {k: job.tasks[0][k] for k in ("checkpoint_dir", "train_iters") if k in job.tasks[0]}
        record["stages"][job.stage] = {"job_id": jid, "array": job.array, "dependency": dep, **extra}
        _update_jobs(run, record)
    return ids


def _update_jobs(run: RunDir, record: dict) -> None:
    import json

    cur = read_json(run.jobs, {}) or {}
    write_atomic(run.jobs, json.dumps({**record, "history": cur.get("history", [])}, indent=2) + "\n")


def print_dry_run(prep: Prepared, written: list[Path]) -> None:
    r, d = prep.recipe, prep.derived
    print(f"# hpcmeg submit --dry-run: nothing submitted. Run directory: {prep.run.root}")
    print("# ---- resolved recipe (" + str(prep.run.recipe) + ")")
    print(dump_yaml(r), end="")
    print("# ---- derived values")
    for k, v in vars(d).items():
        print(f"#   {k}: {v}")
    if prep.plan:
        for note in prep.plan.notes:
            print(f"# {note}")
    for p in written[1:]:
        print(f"# ---- {p}")
        print(p.read_text(), end="")
    print("# ---- files written")
    for p in written:
        print(f"#   {p}")


def cli_submit(args) -> int:
    stages = parse_stages(getattr(args, "stages", ",".join(ALL_STAGES)))
    r = load_recipe(args.recipe, args.overrides, args.profile)
    prep = prepare(r, stages, dry_run=bool(args.dry_run))
    if r.cluster.executor == "local":
        from hpcmeg.launch import local

        if args.dry_run:
            written = [write_resolved(prep.recipe, prep.run.create().recipe)]
            print_dry_run(prep, written)
            print("# local executor: these commands would run here, one after the other:")
            for line in local.describe(prep):
                print(f"#   {line}")
            return 0
        return local.run_chain(prep)
    if args.dry_run:
        print_dry_run(prep, write_run_files(prep))
        return 0
    busy = active_jobs(prep.run)
    if busy:
        print(f"hpcmeg submit: run {prep.run.root} still has jobs in the queue ({', '.join(busy)}); "
              f"wait for them or run 'hpcmeg cancel {prep.run.root}' first", file=sys.stderr)
        return 1
    write_run_files(prep)
    try:
        ids = submit_plan(prep)
    except Exception as e:  # submitit raises for sbatch errors: show Slurm's message in one line
        msg = " ".join(str(e).split())
        print(f"hpcmeg submit: submission failed: {msg}", file=sys.stderr)
        done = (read_json(prep.run.jobs, {}) or {}).get("stages", {})
        if done:
            ids = ", ".join(f"{stage} {info['job_id']}" for stage, info in done.items())
            print(f"hpcmeg submit: already submitted: {ids}; 'hpcmeg cancel {prep.run.root}' removes them",
                  file=sys.stderr)
        return 1
    for note in prep.plan.notes:
        print(f"  {note}")
    for stage, jid in ids.items():
        print(f"submitted {stage:<10} job {jid}")
    print(f"run directory: {prep.run.root}")
    print(f"  hpcmeg status {shlex.quote(str(prep.run.root))}")
    print(f"  hpcmeg logs {shlex.quote(str(prep.run.root))} -f --stage train")
    if getattr(args, "wait", False):
        from hpcmeg.launch.status import wait_for_run

        return wait_for_run(prep.run.root)
    return 0
