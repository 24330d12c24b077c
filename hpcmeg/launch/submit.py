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
submitting process's environment only while sbatch runs (hpcmeg.launch.slurm_chain) -> ``--wait``:
follow the chain (hpcmeg.launch.watch).
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from hpcmeg.fsutil import executable_mode
from hpcmeg import jobenv
from hpcmeg.launch import checks
from hpcmeg.launch import scripts
from hpcmeg.launch.container import ContainerError
from hpcmeg.launch.preflight import preflight, slurm_refusals
from hpcmeg.launch.provenance import write_record
from hpcmeg.launch.resume_layout import layout_problems
from hpcmeg.launch.rundir import RunDir, dataset_is_current, input_manifest, read_json, write_atomic
from hpcmeg.launch.stage_args import dataset_outputs, tokenizer_settings
from hpcmeg.launch.slurm_chain import active_jobs, job_environment, placeholder_dependency, submit_plan
from hpcmeg.recipe import Loaded, Recipe, RecipeError, Where, derive, dump_yaml, read_recipe, recipe_dims, run_paths

ALL_STAGES = ("preprocess", "train", "convert")
# the keys the resumed checkpoint's layout check reads
_LAYOUT_KEYS = ("parallel.tensor", "parallel.pipeline", "parallel.virtual_pipeline", "checkpoint.dir",
                "checkpoint.load", "run.name", "run.output_root")


@dataclass
class Prepared:
    recipe: Recipe
    derived: object
    run: RunDir
    files: list[str]
    skip_preprocess: bool
    stages: tuple[str, ...]
    plan: Optional[scripts.Plan] = None
    host_python: str = sys.executable
    """The interpreter on the compute nodes (cluster.python, default the submitting one)."""


def _abs(p: Optional[str]) -> Optional[str]:
    return None if not p else os.path.abspath(os.path.expanduser(p))


def absolutize(recipe: Recipe) -> Recipe:
    """Every path of the recipe made absolute against this process's cwd (globs keep their wildcards)."""
    data = recipe.data
    blend = list(data.data_path)
    if len(blend) == 1:
        blend = [_abs(str(blend[0]))]
    elif blend:
        blend = [x if i % 2 == 0 else _abs(str(x)) for i, x in enumerate(blend)]
    data = dataclasses.replace(data, inputs=[_abs(x) for x in data.inputs], vocab_file=_abs(data.vocab_file),
                               merge_file=_abs(data.merge_file), tokenizer_model=_abs(data.tokenizer_model),
                               output_prefix=_abs(data.output_prefix), data_path=blend,
                               index_cache_dir=_abs(data.index_cache_dir))
    ck = dataclasses.replace(recipe.checkpoint, dir=_abs(recipe.checkpoint.dir), load=_abs(recipe.checkpoint.load))
    cv = dataclasses.replace(recipe.convert, output_dir=_abs(recipe.convert.output_dir))
    run = dataclasses.replace(recipe.run, output_root=_abs(recipe.run.output_root))
    return dataclasses.replace(recipe, run=run, data=data, checkpoint=ck, convert=cv)


def parse_stages(text: str) -> tuple[str, ...]:
    st = tuple(s.strip() for s in str(text).split(",") if s.strip())
    bad = [s for s in st if s not in ALL_STAGES]
    if bad or not st:
        raise RecipeError([f"--stages: '{text}' must be a comma list of {', '.join(ALL_STAGES)}"])
    return tuple(s for s in ALL_STAGES if s in st)


def node_python(recipe: Recipe) -> str:
    """cluster.python, or the interpreter running this submit."""
    return recipe.cluster.python or sys.executable


def prepare(recipe: Recipe | Loaded, stages: tuple[str, ...] = ALL_STAGES, host_python: Optional[str] = None,
            dry_run: bool = False, environ: Optional[dict] = None, probe: bool = False,
            submitting: bool = False) -> Prepared:
    """Every check ``submit`` makes before writing anything; ``hpcmeg validate`` runs exactly this.

    ``recipe``: a Recipe, or what ``recipe.read_recipe`` found (``Loaded``): then the recipe's own
    problems are reported together with these checks', the checks that read a value the recipe refused
    are skipped, and each line names where its key was set (``--set``, recipe or profile line).
    The checks are independent: all of them run, and every problem is reported in one RecipeError
    (exit 2) or, when the only problem is an unreadable input, checks.DataError (exit 1); one line
    each. Warnings (dry-run leniency, secret-looking cluster.env names) are printed to stderr.
    ``probe``: the smoke test's train step (hpcmeg.launch.smoke); ``submitting``: a real submission,
    which also asks Slurm (sbatch on PATH, ``sbatch --test-only`` of every job)."""
    loaded = recipe if isinstance(recipe, Loaded) else Loaded(recipe, (), frozenset(), Where())
    recipe = absolutize(loaded.recipe)
    host_python = host_python or node_python(recipe)
    found = _run_checks(loaded, recipe, stages, host_python, dry_run, os.environ if environ is None else environ,
                        submitting and not dry_run)
    _refuse_or_warn(loaded, recipe, found)
    derived, files = found.derived, found.files
    prep = Prepared(recipe, derived, RunDir(Path(derived.run_dir)), files, _dataset_reusable(recipe, found), stages,
                    host_python=host_python)
    _add_plan(prep, found.notes, probe, loaded.where)
    if prep.plan and submitting and not dry_run:
        slurm_says = slurm_refusals(prep.plan, shlex.quote(host_python))
        if slurm_says:
            raise RecipeError(slurm_says)
    for line in found.notes if not prep.plan else []:
        print(f"hpcmeg submit: {line}", file=sys.stderr)
    return prep


@dataclass
class _Found:
    """What the checks of ``prepare`` found, before anything is planned."""
    derived: object
    problems: list[str] = field(default_factory=list)
    """One line each, attributed to where their key was set only when reported."""
    data_problems: list[str] = field(default_factory=list)  # unreadable input files: exit 1 when alone
    dataset_missing: list[str] = field(default_factory=list)  # a problem, or on a dry run a warning
    env_warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # preflight's, for the plan
    files: list[str] = field(default_factory=list)  # data.inputs expanded
    present: list[str] = field(default_factory=list)  # those of them that exist (a dry run may lack some)


def _run_checks(loaded: Loaded, recipe: Recipe, stages: tuple[str, ...], host_python: str, dry_run: bool,
                environ: dict, asking_slurm: bool) -> _Found:
    """Every check of ``prepare``; each runs whatever the others found. (A further check: add its lines
    to ``found.problems`` here.)"""
    def ok(*keys: str) -> bool:  # no check reads a placeholder left where the recipe's value was refused
        return not any(k in loaded.refused or k.split(".")[0] in loaded.refused for k in keys)

    derived, lines = _derive(recipe, recipe_refused=bool(loaded.problems))
    found = _Found(derived, problems=lines)
    if ok("run.name", "run.output_root"):
        found.problems += checks.run_dir_problems(recipe, derived.run_dir)
    if "train" in stages and ok(*_LAYOUT_KEYS):  # the checkpoint it would resume must have the recipe's layout
        found.problems += layout_problems(recipe, derived)
    if ok("cluster.env", "cluster.env_passthrough", "cluster.secret_env"):
        env_errors, found.env_warnings = jobenv.problems(recipe.cluster, environ, lenient=dry_run)
        found.problems += env_errors
    more, found.notes = preflight(recipe, derived, host_python, stages, dry_run, asking_slurm, ok=ok)
    found.problems += more
    if "preprocess" in stages and ok("data.data_path", "data.inputs") and not recipe.data.data_path:
        _check_inputs(recipe, dry_run, ok, found)
    if ok("data.data_path", "data.output_prefix", "data.json_keys", "data.split_sentences", "run.name",
          "run.output_root"):
        found.dataset_missing = checks.dataset_problems(recipe, derived, stages)
    if not dry_run:
        found.problems += found.dataset_missing
    return found


def _derive(recipe: Recipe, recipe_refused: bool) -> tuple[object, list[str]]:
    """(derived values, problems): the run's paths alone where the recipe's values cannot be derived."""
    try:
        return derive(recipe), []
    except RecipeError as e:  # an unreadable vocabulary: the paths still let the other checks run
        return run_paths(recipe), e.problems
    except (ArithmeticError, TypeError, ValueError):  # a layout, batch or length the recipe refused
        if not recipe_refused:
            raise
        return run_paths(recipe), []


def _check_inputs(recipe: Recipe, dry_run: bool, ok: Callable[..., bool], found: _Found) -> None:
    """data.inputs: every entry matches a file, and each file's first document has the json_keys."""
    found.files, unmatched = checks.input_files(recipe.data.inputs, allow_missing=dry_run)
    found.problems += unmatched
    found.present = [f for f in found.files if os.path.isfile(f)]  # (a dry run may carry unmatched specs)
    if ok("data.json_keys"):
        bad_keys, found.data_problems = checks.first_document_problems(found.present, list(recipe.data.json_keys))
        found.problems += bad_keys


def _refuse_or_warn(loaded: Loaded, recipe: Recipe, found: _Found) -> None:
    """Raise every problem in one error (each attributed to where its key was set); else print the warnings."""
    problems = list(loaded.problems) + [loaded.where.attribute(line) for line in found.problems]
    if problems:
        raise RecipeError(problems + found.data_problems)
    if found.data_problems:
        raise checks.DataError(found.data_problems)
    for line in found.dataset_missing:  # a dry run may render for a machine that sees the data
        print(f"hpcmeg submit: warning (dry run): {line}", file=sys.stderr)
    cluster = recipe.cluster
    for line in found.env_warnings + recipe_dims(recipe).placement_warnings(cluster.tasks_per_node(), cluster.nodes):
        print(f"hpcmeg: warning: {line}", file=sys.stderr)
    for name in jobenv.secret_looking(cluster):
        print(f"hpcmeg: warning: cluster.env.{name} looks like a credential and is written into recipe.yaml "
              f"and the job scripts; list it in cluster.secret_env (or pass it with cluster.env_passthrough) to "
              f"keep its value out of every file", file=sys.stderr)


def _dataset_reusable(recipe: Recipe, found: _Found) -> bool:
    """Every input is there and the dataset's manifest matches them (paths, sizes, mtimes, tokenizer)."""
    prefix = found.derived.data_prefix
    if not found.files or len(found.present) != len(found.files):
        return False
    return dataset_is_current(prefix, dataset_outputs(prefix, recipe),
                              input_manifest(found.files, tokenizer_settings(recipe)))


def _add_plan(prep: Prepared, notes: list[str], probe: bool, where: Where) -> None:
    """The Slurm plan (scripts, parameters, notes), or the local executor's own refusals; reached only
    when every check passed, so a script that cannot be written is the one problem reported."""
    recipe, derived = prep.recipe, prep.derived
    try:
        if recipe.cluster.executor == "slurm":
            warnings = unbound_paths(recipe, derived, prep.files)
            prep.plan = scripts.build_plan(recipe, derived, prep.files, prep.host_python, prep.stages,
                                     skip_preprocess=prep.skip_preprocess, probe=probe)
            source = "cluster.python" if recipe.cluster.python else "this submit's, as cluster.python is unset"
            prep.plan.notes.append(f"compute-node interpreter: {prep.host_python} ({source}; it runs each job's "
                                   f"supervisor on the node)")
            prep.plan.notes += notes + warnings
        else:
            from hpcmeg.launch import local

            local.describe(prep)  # the local executor's own refusals (pyxis needs srun)
            scripts.env_exports(recipe.cluster.env)
    except (scripts.ScriptError, ContainerError) as e:
        raise RecipeError([where.attribute(str(e))]) from None


def unbound_paths(recipe: Recipe, derived, files: list[str]) -> list[str]:
    """Warnings for recipe paths a container would not see (not under the run dir or container.binds)."""
    if recipe.container.runtime == "none":
        return []
    roots = [derived.run_dir] + [b.split(":")[0] for b in recipe.container.binds]
    data = recipe.data
    paths = {"data.inputs": files[0] if files else None, "data.vocab_file": data.vocab_file,
             "data.merge_file": data.merge_file, "data.tokenizer_model": data.tokenizer_model,
             "data.output_prefix": data.output_prefix, "checkpoint.dir": derived.checkpoint_dir,
             "checkpoint.load": recipe.checkpoint.load, "convert.output_dir": recipe.convert.output_dir}
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
        dep = (dependencies or {}).get(job.stage, placeholder_dependency(prep.plan, job.stage))
        out.append((run.sbatch_script(job.stage),
                    scripts.render_sbatch(job, str(run.submitit(job.stage)), shlex.quote(prep.host_python), dep), False))
    return out


def write_run_files(prep: Prepared, dependencies: Optional[dict[str, str]] = None) -> list[Path]:
    """Write `run_files` into the run directory (created); step scripts get ``0o777 & ~umask``."""
    files = run_files(prep, dependencies)
    prep.run.create()
    write_record(prep.run.root)  # which hpcmeg wrote the run: every stage checks it (hpcmeg.launch.provenance)
    return [write_atomic(p, text, mode=executable_mode() if exe else None) for p, text, exe in files]


def print_dry_run(prep: Prepared, files: list[tuple[Path, str, bool]], written: bool) -> None:
    print(f"# hpcmeg submit --dry-run: nothing submitted. Run directory: {prep.run.root}")
    print("# ---- resolved recipe (" + str(prep.run.recipe) + ")")
    print(files[0][1], end="")
    print("# ---- derived values")
    for k, v in vars(prep.derived).items():
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
    if prep.recipe.cluster.executor == "local":
        from hpcmeg.launch import local

        return local.run_chain(prep)
    rc = _submit_to_slurm(prep)
    if rc == 0 and getattr(args, "wait", False):
        from hpcmeg.launch.watch import watch_run

        sys.stdout.flush()
        return watch_run(prep.run.root)
    return rc


def _submit_to_slurm(prep: Prepared) -> int:
    """Refuse a run that still has jobs queued, write its files, submit the chain and print the job ids."""
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
        with job_environment(jobenv.submission_values(prep.recipe.cluster)):
            ids = submit_plan(prep)
    except Exception as e:  # submitit raises for sbatch errors: show Slurm's message in one line
        msg = " ".join(str(e).split())
        done = (read_json(prep.run.jobs, {}) or {}).get("stages", {})
        more = ""
        if done:  # one line: what failed, and what is already queued
            queued = ", ".join(f"{stage} {info['job_id']}" for stage, info in done.items())
            more = f"; already submitted: {queued} ('hpcmeg cancel {prep.run.root}' removes them)"
        print(f"hpcmeg submit: submission failed: {msg}{more}", file=sys.stderr)
        return 1
    for note in prep.plan.notes:
        print(f"  {note}")
    for stage, jid in ids.items():
        print(f"submitted {stage:<10} job {jid}")
    print(f"run directory: {prep.run.root}")
    print(f"  hpcmeg status {shlex.quote(str(prep.run.root))}")
    print(f"  hpcmeg logs {shlex.quote(str(prep.run.root))} -f --stage train")
    return 0
