"""`hpcmeg submit RECIPE`: recipe -> run directory -> preprocess / train / convert jobs (Slurm or local).

Contract: ``cli_submit(args) -> exit code`` (args: recipe, overrides, profile, dry_run, stages, wait),
``prepare(recipe, stages) -> Prepared`` (resolved recipe with absolute paths, derived values, expanded
inputs, whether the dataset can be reused, the plan) and ``submit_plan(prep) -> {stage: job id}``.

Order of work (every check runs and their problems are reported together, each attributed to the
``--set``, recipe line or profile line that set its key): validate -> make every path absolute (jobs
and containers do not share the login shell's cwd) -> the checkpoint the train job would resume has
the recipe's tensor/pipeline layout (hpcmeg.launch.resume_layout) -> the shared checks
(hpcmeg.launch.checks: no '%' in the run dir, every data.inputs entry matches a file whose first
document has the json_keys; pass-through/secret variables set) -> preflight (hpcmeg.launch.preflight:
profile/executor fit, the compute-node interpreter ``cluster.python``, node-local paths, resource
shapes) -> reuse the dataset when its manifest matches (inputs' paths, sizes, mtimes and the
tokenizer) -> the plan (Slurm, not --dry-run: then
``sbatch --test-only`` of every job, so nothing Slurm would refuse is half-submitted; ``prepare``:
all of this is what ``hpcmeg validate`` runs too) -> write recipe.yaml, hpcmeg_version.json (which
hpcmeg wrote the run: every stage checks it), scripts/*.sbatch and scripts/*_step.sh (--dry-run:
print them and stop; where the run dir cannot be created, print them and say nothing was written) ->
refuse if this run still has jobs in the queue -> submit each stage through submitit with
``afterok`` (and ``--kill-on-invalid-dep=yes``) on the previous one, recording jobs.json after every
submission (a failure mid-chain still leaves ids for ``hpcmeg cancel``); secret values sit in the
submitting process's environment only while sbatch runs -> ``--wait``: follow the chain
(hpcmeg.launch.watch).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from hpcmeg.fsutil import executable_mode
from hpcmeg import jobenv
from hpcmeg.launch import checks
from hpcmeg.launch import scripts as S
from hpcmeg.launch.container import ContainerError
from hpcmeg.launch.preflight import preflight, slurm_refusals
from hpcmeg.launch.provenance import write_record
from hpcmeg.launch.resume_layout import layout_problems
from hpcmeg.launch.rundir import RunDir, dataset_is_current, input_manifest, read_json, write_atomic, write_jobs
from hpcmeg.recipe import Loaded, Recipe, RecipeError, Where, derive, dump_yaml, read_recipe, recipe_dims, run_paths

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
    host_python: str = sys.executable
    """The interpreter on the compute nodes (cluster.python, default the submitting one)."""


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


def parse_stages(text: str) -> tuple[str, ...]:
    st = tuple(s.strip() for s in str(text).split(",") if s.strip())
    bad = [s for s in st if s not in ALL_STAGES]
    if bad or not st:
        raise RecipeError([f"--stages: '{text}' must be a comma list of {', '.join(ALL_STAGES)}"])
    return tuple(s for s in ALL_STAGES if s in st)


def node_python(r: Recipe) -> str:
    """cluster.python, or the interpreter running this submit."""
    return r.cluster.python or sys.executable


def prepare(r: Recipe | Loaded, stages: tuple[str, ...] = ALL_STAGES, host_python: Optional[str] = None,
            dry_run: bool = False, environ: Optional[dict] = None, probe: bool = False,
            submitting: bool = False) -> Prepared:
    """Every check ``submit`` makes before writing anything; ``hpcmeg validate`` runs exactly this.

    ``r``: a Recipe, or what ``recipe.read_recipe`` found (``Loaded``): then the recipe's own problems
    are reported together with these checks', the checks that read a value the recipe refused are
    skipped, and each line names where its key was set (``--set``, recipe or profile line).
    The checks are independent: all of them run, and every problem is reported in one RecipeError
    (exit 2) or, when the only problem is an unreadable input, checks.DataError (exit 1); one line
    each. Warnings (dry-run leniency, secret-looking cluster.env names) are printed to stderr.
    ``probe``: the smoke test's train step (hpcmeg.launch.smoke); ``submitting``: a real submission,
    which also asks Slurm (sbatch on PATH, ``sbatch --test-only`` of every job)."""
    loaded = r if isinstance(r, Loaded) else Loaded(r, (), frozenset(), Where())
    where, refused = loaded.where, loaded.refused
    problems: list[str] = list(loaded.problems)  # one line each, from every check below
    found: list[str] = []  # this function's own lines, attributed to where their key was set at the end

    def ok(*keys: str) -> bool:  # no check reads a placeholder left where the recipe's value was refused
        return not any(k in refused or k.split(".")[0] in refused for k in keys)

    r = absolutize(loaded.recipe)
    try:
        d = derive(r)
    except RecipeError as e:  # an unreadable vocabulary: the paths still let the other checks run
        found += e.problems
        d = run_paths(r)
    except (ArithmeticError, TypeError, ValueError):  # a layout, batch or length the recipe refused
        if not problems:
            raise
        d = run_paths(r)
    if ok("run.name", "run.output_root"):
        found += checks.run_dir_problems(r, d.run_dir)
    layout_keys = ("parallel.tensor", "parallel.pipeline", "parallel.virtual_pipeline", "checkpoint.dir",
                   "checkpoint.load", "run.name", "run.output_root")
    if "train" in stages and ok(*layout_keys):  # the checkpoint it would resume must have the recipe's layout
        found += layout_problems(r, d)
    env_errors, env_warnings = [], []
    if ok("cluster.env", "cluster.env_passthrough", "cluster.secret_env"):
        env_errors, env_warnings = jobenv.problems(r.cluster, os.environ if environ is None else environ,
                                                   lenient=dry_run)
    found += env_errors
    host_python = host_python or node_python(r)
    more, notes = preflight(r, d, host_python, stages, dry_run, submitting and not dry_run, ok=ok)
    found += more
    files: list[str] = []
    data_problems: list[str] = []  # unreadable input files: exit 1 when nothing else is wrong
    present: list[str] = []
    if "preprocess" in stages and ok("data.data_path", "data.inputs") and not r.data.data_path:
        files, unmatched = checks.input_files(r.data.inputs, allow_missing=dry_run)
        found += unmatched
        present = [f for f in files if os.path.isfile(f)]  # (a dry run may carry unmatched specs)
        if ok("data.json_keys"):
            bad_keys, data_problems = checks.first_document_problems(present, list(r.data.json_keys))
            found += bad_keys
    missing = []
    if ok("data.data_path", "data.output_prefix", "data.json_keys", "data.split_sentences", "run.name",
          "run.output_root"):
        missing = checks.dataset_problems(r, d, stages)
    if not dry_run:
        found += missing
    # (a further check: append its lines to `found` above this line)
    problems += [where.attribute(line) for line in found]
    if problems:
        raise RecipeError(problems + data_problems)
    if data_problems:
        raise checks.DataError(data_problems)
    for line in missing:  # a dry run may render for a machine that sees the data
        print(f"hpcmeg submit: warning (dry run): {line}", file=sys.stderr)
    c = r.cluster
    for line in env_warnings + recipe_dims(r).placement_warnings(c.tasks_per_node(), c.nodes):
        print(f"hpcmeg: warning: {line}", file=sys.stderr)
    for name in jobenv.secret_looking(r.cluster):
        print(f"hpcmeg: warning: cluster.env.{name} looks like a credential and is written into recipe.yaml "
              f"and the job scripts; list it in cluster.secret_env (or pass it with cluster.env_passthrough) to "
              f"keep its value out of every file", file=sys.stderr)
    run = RunDir(Path(d.run_dir))
    skip = False
    if files:
        outs = S.dataset_outputs(d.data_prefix, r)
        if len(present) == len(files):
            skip = dataset_is_current(d.data_prefix, outs, input_manifest(files, S.tokenizer_settings(r)))
    prep = Prepared(r, d, run, files, skip, stages, host_python=host_python)
    try:
        if r.cluster.executor == "slurm":
            warnings = unbound_paths(r, d, files)
            prep.plan = S.build_plan(r, d, files, host_python, stages, skip_preprocess=skip, probe=probe)
            where = "cluster.python" if r.cluster.python else "this submit's, as cluster.python is unset"
            prep.plan.notes.append(f"compute-node interpreter: {host_python} ({where}; it runs each job's supervisor "
                                   f"on the node)")
            prep.plan.notes += notes + warnings
        else:
            from hpcmeg.launch import local

            local.describe(prep)  # the local executor's own refusals (pyxis needs srun)
            S.env_exports(r.cluster.env)
    except (S.ScriptError, ContainerError) as e:  # reached only when every check above passed
        raise RecipeError([where.attribute(str(e))]) from None
    if prep.plan and submitting and not dry_run:
        slurm_says = slurm_refusals(prep.plan, shlex.quote(host_python))
        if slurm_says:
            raise RecipeError(slurm_says)
    for line in notes if not prep.plan else []:
        print(f"hpcmeg submit: {line}", file=sys.stderr)
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


def run_files(prep: Prepared, dependencies: Optional[dict[str, str]] = None) -> list[tuple[Path, str, bool]]:
    """(path, text, executable) of recipe.yaml, the step scripts and the sbatch scripts (dependencies
    as placeholders unless given), rendered without touching the filesystem."""
    run = prep.run
    out = [(run.recipe, dump_yaml(prep.recipe), False)]
    for job in prep.plan.jobs if prep.plan else []:
        out.append((run.step_script(job.stage), job.step_script, True))
        dep = (dependencies or {}).get(job.stage, _placeholder_dependency(prep.plan, job.stage))
        out.append((run.sbatch_script(job.stage),
                    S.render_sbatch(job, str(run.submitit(job.stage)), shlex.quote(prep.host_python), dep), False))
    return out


def write_run_files(prep: Prepared, dependencies: Optional[dict[str, str]] = None) -> list[Path]:
    """Write `run_files` into the run directory (created); step scripts get ``0o777 & ~umask``."""
    files = run_files(prep, dependencies)
    prep.run.create()
    write_record(prep.run.root)  # which hpcmeg wrote the run: every stage checks it (hpcmeg.launch.provenance)
    return [write_atomic(p, text, mode=executable_mode() if exe else None) for p, text, exe in files]


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
                     S.render_sbatch(job, str(folder), shlex.quote(prep.host_python), dep))
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=shlex.quote(prep.host_python))
        ex.update_parameters(**S.with_dependency(job.params, dep))
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


def print_dry_run(prep: Prepared, files: list[tuple[Path, str, bool]], written: bool) -> None:
    d = prep.derived
    print(f"# hpcmeg submit --dry-run: nothing submitted. Run directory: {prep.run.root}")
    print("# ---- resolved recipe (" + str(prep.run.recipe) + ")")
    print(files[0][1], end="")
    print("# ---- derived values")
    for k, v in vars(d).items():
        print(f"#   {k}: {v}")
    if prep.plan:
        for note in prep.plan.notes:
            print(f"# {note}")
    for p, text, _ in files[1:]:
        print(f"# ---- {p}")
        print(text, end="")
    if written:
        print("# ---- files written")
        for p, _, _ in files:
            print(f"#   {p}")


def _os_error(e: OSError) -> str:
    """'No such file or directory: /lustre' (strerror and the path it is about)."""
    return f"{e.strerror or e}" + (f": {e.filename}" if getattr(e, "filename", None) else "")


def dry_run(prep: Prepared) -> int:
    """Write the run directory's files so they can be read as files; where run.output_root cannot be
    created here (a laptop rendering a cluster's scripts) print them and say in one line that nothing
    was written. Exit 0 either way."""
    files = run_files(prep)
    try:
        write_run_files(prep)
        written, why = True, ""
    except OSError as e:
        written, why = False, _os_error(e)
    print_dry_run(prep, files, written)
    if prep.recipe.cluster.executor == "local":
        from hpcmeg.launch import local

        print("# local executor: these commands would run here, one after the other:")
        for line in local.describe(prep):
            print(f"#   {line}")
    sys.stdout.flush()
    if not written:
        print(f"hpcmeg submit: dry run: nothing was written (cannot create the run directory {prep.run.root}: "
              f"{why}); the files above are what submit would write there", file=sys.stderr)
    return 0


def cli_submit(args) -> int:
    stages = parse_stages(getattr(args, "stages", ",".join(ALL_STAGES)))
    loaded = read_recipe(args.recipe, args.overrides, args.profile)  # its problems are reported by prepare
    r = loaded.recipe
    try:
        prep = prepare(loaded, stages, dry_run=bool(args.dry_run), submitting=not args.dry_run)
    except checks.DataError as e:
        print(f"hpcmeg submit: {e.lines[0]}", file=sys.stderr)
        return 1
    if args.dry_run:
        return dry_run(prep)
    try:
        prep.run.create()
    except OSError as e:
        print(f"hpcmeg submit: cannot create the run directory {prep.run.root}: {_os_error(e)}; check run.output_root",
              file=sys.stderr)
        return 1
    if r.cluster.executor == "local":
        from hpcmeg.launch import local

        return local.run_chain(prep)
    busy = active_jobs(prep.run)
    if busy:
        print(f"hpcmeg submit: run {prep.run.root} still has jobs in the queue ({', '.join(busy)}); "
              f"wait for them or run 'hpcmeg cancel {prep.run.root}' first", file=sys.stderr)
        return 1
    try:
        write_run_files(prep)
    except OSError as e:
        print(f"hpcmeg submit: cannot write the run directory {prep.run.root}: {_os_error(e)}; check run.output_root",
              file=sys.stderr)
        return 1
    try:
        with _job_environment(jobenv.submission_values(r.cluster)):
            ids = submit_plan(prep)
    except Exception as e:  # submitit raises for sbatch errors: show Slurm's message in one line
        msg = " ".join(str(e).split())
        done = (read_json(prep.run.jobs, {}) or {}).get("stages", {})
        more = ""
        if done:  # one line: what failed, and what is already queued
            ids = ", ".join(f"{stage} {info['job_id']}" for stage, info in done.items())
            more = f"; already submitted: {ids} ('hpcmeg cancel {prep.run.root}' removes them)"
        print(f"hpcmeg submit: submission failed: {msg}{more}", file=sys.stderr)
        return 1
    for note in prep.plan.notes:
        print(f"  {note}")
    for stage, jid in ids.items():
        print(f"submitted {stage:<10} job {jid}")
    print(f"run directory: {prep.run.root}")
    print(f"  hpcmeg status {shlex.quote(str(prep.run.root))}")
    print(f"  hpcmeg logs {shlex.quote(str(prep.run.root))} -f --stage train")
    if getattr(args, "wait", False):
        from hpcmeg.launch.watch import watch_run

        sys.stdout.flush()
        return watch_run(prep.run.root)
    return 0


@contextlib.contextmanager
def _job_environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while sbatch runs (submitit starts it with ours), so
    secrets reach the jobs through Slurm's --export and no file; the old environment comes back after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
