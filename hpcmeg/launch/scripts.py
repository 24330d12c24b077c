"""Everything hpcmeg writes as shell text or sbatch flags, as pure functions (golden-file tested).

Contract: ``build_plan(recipe, derived, files, host_python) -> Plan``: per stage the submitit
``SlurmExecutor`` parameters, the array size and the text of ``scripts/<stage>_step.sh``;
``render_sbatch(job, folder, python, dependency)`` gives the exact sbatch text submitit submits for
it, and ``with_dependency(params, dependency)`` the parameters of a dependent job (every one carries
``--kill-on-invalid-dep=yes``: a failed parent cancels its children even on clusters without
``DependencyParameters=kill_invalid_depend``). ``host_python`` is the interpreter on the compute node
(``cluster.python``, default the submitting one): it runs the supervisor, and the ranks when there is
no container. The stages' commands in recipe terms (flags, shards, outputs): hpcmeg.launch.stage_args.

Shape of every Slurm job (slurm-design.md §0): submitit runs a host-side supervisor in the batch
shell (``use_srun=False``); the supervisor runs the stage's step script, which is one ``srun`` step
whose tasks run ``python -m hpcmeg.cli <stage> ...`` inside the container. Resource flags that
describe the step's tasks (nodes, ntasks-per-node) go through ``additional_parameters`` so that
submitit models the job as the single supervisor task it really is. Every ``srun`` passes
``--cpus-per-task`` itself: since Slurm 22.05 a step no longer inherits it from the job, and on sites
with CPU binding a rank would get one core. The CPU stages (preprocess, merge, convert) go to
``cluster.cpu_partition`` when set. Each step script exports ``HPCMEG_VERSION_FILE`` so that the
command inside the container checks it is the hpcmeg that wrote the run (hpcmeg.launch.provenance).

Quoting rules (the injection contract):
- every value that comes from a recipe is ``shlex.quote``d (sbatch's ``#SBATCH`` parser honours shell
  quotes: verified on Slurm 22.05); ``cluster.setup`` lines are shell by design and copied verbatim;
- a newline cannot live in an ``#SBATCH`` line (the rest would run as a command), so values that
  end up there are refused with a clear message, and job names are reduced to ``[A-Za-z0-9._+-]``;
- ``%`` in a path given to ``--output`` is doubled (Slurm expands ``%j``, ``%t``...), and a backslash
  is refused there (Slurm then stops expanding every pattern).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hpcmeg.launch.container import ContainerSpec, Wrapped, python_argv, wrap
from hpcmeg.jobenv import passed_names, written_env
from hpcmeg.launch.rundir import RunDir
from hpcmeg.launch.stage_args import (container_spec, dataset_outputs, hpcmeg_argv, preprocess_flags, shard_groups,
                                      shard_prefixes, tokenizer_settings)

# Time-limit/preemption lead signal for the steps of the train job. No "B:" prefix: Slurm signals the
# job steps (every rank), not the batch shell, so the supervisor keeps running and decides afterwards.
TRAIN_SIGNAL = "TERM"
# Arrays (preprocess, convert) are not requeued; their lead signal only brings the step's SIGTERM
# cleanup (partial outputs removed) a little before the hard kill.
ARRAY_SIGNAL = "TERM@30"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ScriptError(ValueError):
    """A recipe value that cannot be written safely into a script; the message names the key."""


@dataclass
class StageJob:
    stage: str
    """preprocess | merge | train | convert."""
    params: dict[str, Any]
    """``SlurmExecutor.update_parameters`` keywords (``dependency`` is added at submission)."""
    array: Optional[int]
    """Array size (None: a single job)."""
    tasks: list[dict]
    """Plain-data arguments of the supervisor, one per array task (or one)."""
    step_script: str
    """Text of scripts/<stage>_step.sh."""


@dataclass
class Plan:
    run_dir: str
    jobs: list[StageJob] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Human lines for --dry-run (skipped stages, counts)."""

    def job(self, stage: str) -> Optional[StageJob]:
        return next((j for j in self.jobs if j.stage == stage), None)


# ----------------------------------------------------------------------------- checks and escapes


def sbatch_value(key: str, value: Any) -> str:
    """A value bound for an ``#SBATCH`` line: refused when it holds a line break or NUL."""
    s = str(value)
    if any(ch in s for ch in "\n\r\0"):
        raise ScriptError(f"{key}: {s!r} contains a line break; it would end the #SBATCH line it is written to "
                          f"(and the rest would run as a command). Use a value without newlines.")
    return s


def slurm_path(key: str, path: str) -> str:
    """A path for a Slurm ``--output`` pattern: ``%`` doubled, backslash and newline refused."""
    sbatch_value(key, path)
    if "\\" in path:
        raise ScriptError(f"{key}: '{path}' contains a backslash, which makes Slurm ignore the %j/%t patterns of "
                          f"log file names; choose a run directory without backslashes")
    return path.replace("%", "%%")


def job_name(run_name: str, stage: str) -> str:
    """``hpcmeg-<stage>-<run name>`` reduced to characters every Slurm tool prints safely."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", f"hpcmeg-{stage}-{run_name}")[:120]


def env_exports(env: dict[str, str]) -> list[str]:
    """``export NAME=<quoted value>`` lines; names must be shell identifiers, values stay literal."""
    lines = []
    for k, v in env.items():
        if not _ENV_NAME.match(k):
            raise ScriptError(f"cluster.env: '{k}' is not a valid environment variable name "
                              f"(letters, digits and _ only, not starting with a digit)")
        lines.append(f"export {k}={shlex.quote(str(v))}")
    return lines


def q(argv: list[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


# ----------------------------------------------------------------------------- convert tasks


def convert_task_count(recipe, train_iters: int) -> int:
    """Array size of the convert stage; the iterations themselves are resolved when the tasks run."""
    it = str(recipe.convert.iterations).strip()
    if it == "last":
        return 1
    if it == "all":
        saves = (train_iters // recipe.checkpoint.save_interval if recipe.checkpoint.save_interval > 0 else 0)
        saves += 0 if recipe.checkpoint.save_interval > 0 and train_iters % recipe.checkpoint.save_interval == 0 else 1
        return max(1, min(saves, recipe.checkpoint.keep_last) if recipe.checkpoint.keep_last else saves)
    return len(parse_iteration_list(it))


def parse_iteration_list(text: str) -> list[int]:
    try:
        its = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ScriptError(f"convert.iterations: '{text}' must be last, all, or a comma list of iterations") from None
    if not its or any(i < 0 for i in its):
        raise ScriptError(f"convert.iterations: '{text}' must be last, all, or a comma list of iterations")
    return its


# ----------------------------------------------------------------------------- step scripts


def cpu_stage_cpus(recipe) -> int:
    """``--cpus-per-task`` of the CPU stages: cluster.preprocess_cpus, else one core per tokenizer worker."""
    return int(recipe.cluster.preprocess_cpus or max(1, recipe.data.workers))


def _side(spec: ContainerSpec, host_python: str) -> str:
    """Where a step's command runs, in words (for the version check's message)."""
    if spec.runtime == "none":
        return f"the interpreter {host_python} on the node"
    return f"the {spec.runtime} image {spec.image}"


def _step_header(stage: str, recipe, run: RunDir, what: str, spec: ContainerSpec, host_python: str) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"# hpcmeg {stage} step of run {shlex.quote(recipe.run.name)!s}"[:200].replace("\n", " "),
        f"# {what}",
        "# Generated by hpcmeg submit; run by the host-side supervisor (hpcmeg.launch.supervisor) inside",
        "# the Slurm job. Every recipe value below is shell-quoted.",
        "set -u",
        'tag="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"',
        'tag="${tag:-${SLURM_JOB_ID:-local}}"',
        'restart="${SLURM_RESTART_COUNT:-0}"',
    ]
    if spec.runtime != "none":
        # Apptainer and pyxis pass the job's environment into the container: the host venv's Python
        # paths must not shadow the image's packages (its torch, its hpcmeg)
        lines.append("unset PYTHONPATH PYTHONHOME VIRTUAL_ENV")
    if recipe.cluster.version_check:
        # the command below (in the container) checks it is the hpcmeg that wrote the run
        lines += [f"export HPCMEG_VERSION_FILE={shlex.quote(str(run.root / 'hpcmeg_version.json'))}",
                  f"export HPCMEG_VERSION_SIDE={shlex.quote(_side(spec, host_python))}"]
    return lines


def _srun_line(srun_opts: list[str], log_prefix: str, wrapped: Wrapped, tail_args: str = "", exec_: bool = True,
               after: str = "") -> list[str]:
    """``[exec ]srun ...`` with per-task, per-restart log files (appended, never truncated)."""
    out = [("exec " if exec_ else "") + "srun " + q(srun_opts) + " --open-mode=append \\",
           f'    --output={shlex.quote(log_prefix)}"${{tag}}.r${{restart}}".%t.log \\']
    for part in (wrapped.srun_opts, wrapped.prefix):
        if part:
            out.append("    " + q(part) + " \\")
    out.append("    " + q(wrapped.argv) + (" " + tail_args if tail_args else "") + (" " + after if after else ""))
    return out


def train_step(recipe, run: RunDir, host_python: str, probe: bool = False) -> str:
    """The training step; ``probe`` (``hpcmeg smoke``) first runs ``hpcmeg.cli smoke-probe`` on the same
    ranks (devices, an all-reduce, a write into the run directory), then trains."""
    cluster = recipe.cluster
    spec = container_spec(recipe)
    py = python_argv(spec, host_python)
    gpus = cluster.gpus_per_node > 0
    wrapped = wrap(spec, hpcmeg_argv(py, "train", str(run.recipe)), gpus=gpus, always_bind=[str(run.root)])
    srun = [f"--nodes={cluster.nodes}", f"--ntasks-per-node={cluster.tasks_per_node()}",
            f"--cpus-per-task={cluster.cpus_per_task}",
            "--kill-on-bad-exit=1"]
    lines = _step_header("train", recipe, run, f"{cluster.nodes} node(s) x {cluster.tasks_per_node()} task(s), one "
                         f"per {'GPU' if cluster.gpus_per_node else 'CPU rank'}; ranks come from "
                         f"SLURM_PROCID/SLURM_NTASKS.",
                         spec, host_python)
    if cluster.master_port:
        lines.append(f"export MASTER_PORT={int(cluster.master_port)}")
    if probe:
        probe_wrapped = wrap(spec, hpcmeg_argv(py, "smoke-probe", str(run.root)), gpus=gpus,
                             always_bind=[str(run.root)])
        lines.append("# hpcmeg smoke: check devices, an all-reduce and the run directory on every rank first")
        lines += _srun_line(srun, slurm_path("run.output_root", str(run.logs("train") / "probe.")), probe_wrapped,
                            exec_=False, after="|| exit $?")
    lines += _srun_line(srun, slurm_path("run.output_root", str(run.logs("train") / "train.")), wrapped)
    return "\n".join(lines) + "\n"


def preprocess_step(recipe, run: RunDir, host_python: str) -> str:
    """``preprocess_step.sh OUT_PREFIX INPUT...``: tokenize one shard (a group of input files)."""
    spec = container_spec(recipe)
    argv = hpcmeg_argv(python_argv(spec, host_python), "preprocess", *preprocess_flags(recipe))
    wrapped = wrap(spec, argv, gpus=False, always_bind=[str(run.root)])
    srun = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cpu_stage_cpus(recipe)}"]
    lines = _step_header("preprocess", recipe, run, "usage: preprocess_step.sh OUT_PREFIX INPUT... (one array task)",
                         spec, host_python)
    lines += _srun_line(srun, slurm_path("run.output_root", str(run.logs("preprocess") / "preprocess.")), wrapped,
                        tail_args='--output-prefix "$1" --input "${@:2}"')
    return "\n".join(lines) + "\n"


def merge_step(recipe, run: RunDir, host_python: str, shards: list[str], prefix: str) -> str:
    """Concatenate the shards of every JSON key in shard order (one srun step per key)."""
    spec = container_spec(recipe)
    py = python_argv(spec, host_python)
    lines = _step_header("merge", recipe, run, f"merge {len(shards)} shards into {prefix}"[:150].replace("\n", " "),
                         spec, host_python)
    lines.append("set -e")
    outs = dataset_outputs(prefix, recipe)
    log = slurm_path("run.output_root", str(run.logs("merge") / "merge."))
    for k, out in zip(recipe.data.json_keys, outs):
        ins = [o for s in shards for o in dataset_outputs(s, recipe) if o.endswith(out[len(prefix):])]
        argv = hpcmeg_argv(py, "merge-datasets", "--output-prefix", out, "--input", *ins)
        wrapped = wrap(spec, argv, gpus=False, always_bind=[str(run.root)])
        srun = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cpu_stage_cpus(recipe)}"]
        lines += _srun_line(srun, log, wrapped, exec_=False)  # several keys: one step each (set -e stops at a failure)
    return "\n".join(lines) + "\n"


def convert_step(recipe, run: RunDir, host_python: str, ckpt_dir: str) -> str:
    """``convert_step.sh ITERATION OUT_DIR``: one checkpoint iteration to a Hugging Face directory."""
    spec = container_spec(recipe)
    argv = hpcmeg_argv(python_argv(spec, host_python), "convert", ckpt_dir)
    wrapped = wrap(spec, argv, gpus=False, always_bind=[str(run.root)])
    srun = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cpu_stage_cpus(recipe)}"]
    lines = _step_header("convert", recipe, run, "usage: convert_step.sh ITERATION OUT_DIR (one array task)", spec,
                         host_python)
    lines += _srun_line(srun, slurm_path("run.output_root", str(run.logs("convert") / "convert.")), wrapped,
                        tail_args=f'"$2" --iteration "$1" --dtype {shlex.quote(recipe.convert.dtype)}')
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- sbatch parameters


def _common_params(recipe, stage: str, run: RunDir, time: str, array: bool) -> dict[str, Any]:
    cluster = recipe.cluster
    params: dict[str, Any] = {"job_name": job_name(recipe.run.name, stage), "use_srun": False, "stderr_to_stdout": True,
                         "wckey": None, "time": sbatch_value("cluster.time", time)}
    cpu_own = stage != "train" and bool(cluster.cpu_partition)
    # a CPU partition's nodes lack the GPU nodes' features: cluster.constraint stays with the train job
    for key in ("cpu_partition" if cpu_own else "partition", "account", "qos", *(() if cpu_own else ("constraint",))):
        val = getattr(cluster, key)
        if val:
            params["partition" if key == "cpu_partition" else key] = sbatch_value(f"cluster.{key}", val)
    pat = "%A_%a" if array else "%j"
    log = slurm_path("run.output_root", str(run.logs(stage) / f"{stage}."))
    # requeued jobs keep their id: append, never truncate (the supervisor prints a banner per restart)
    params["additional_parameters"] = {"output": f"{log}{pat}.batch.log", "open-mode": "append"}
    # cluster.secret_env values are never rendered; they and cluster.env_passthrough travel by name in
    # sbatch's environment propagation (--export=ALL,NAME: ALL is Slurm's default, spelled out so that a
    # site's SBATCH_EXPORT=NONE cannot drop them; srun steps inherit it through SLURM_EXPORT_ENV)
    setup = ["export PYTHONUNBUFFERED=1", *env_exports(written_env(cluster))]
    names = passed_names(cluster)
    if names:
        params["additional_parameters"]["export"] = sbatch_value("cluster.env_passthrough", ",".join(["ALL", *names]))
    if cluster.setup:
        setup += ["# cluster.setup (shell by design: copied verbatim from the profile/recipe)", *cluster.setup]
    params["setup"] = setup
    return params


def train_params(recipe, run: RunDir) -> dict[str, Any]:
    cluster = recipe.cluster
    params = _common_params(recipe, "train", run, cluster.time, array=False)
    params["cpus_per_task"] = cluster.cpus_per_task
    if cluster.gpus_per_node > 0:
        params["gpus_per_node"] = cluster.gpus_per_node
    if cluster.mem is not None:
        params["mem"] = sbatch_value("cluster.mem", cluster.mem)
    if cluster.exclusive:
        params["exclusive"] = True
    params["additional_parameters"].update({
        "nodes": cluster.nodes, "ntasks_per_node": cluster.tasks_per_node(), "requeue": True,
        # overrides submitit's USR2@90 (additional_parameters are applied last)
        "signal": f"{TRAIN_SIGNAL}@{int(cluster.signal_lead_s)}"})
    return params


def array_params(recipe, run: RunDir, stage: str, time: str, array: bool = True) -> dict[str, Any]:
    """One CPU task per job or array element. A one-element array is submitted as a plain job: Slurm 22.05
    runs ``--array=0-0`` without SLURM_ARRAY_* and expands ``%a`` to 4294967294."""
    params = _common_params(recipe, stage, run, time, array=array)
    params["cpus_per_task"] = cpu_stage_cpus(recipe)
    params["additional_parameters"].update({"nodes": 1, "ntasks": 1, "signal": ARRAY_SIGNAL})
    return params


def with_dependency(params: dict[str, Any], dependency: Optional[str]) -> dict[str, Any]:
    """The parameters of a job that waits for ``dependency`` (afterok:ID). ``--kill-on-invalid-dep=yes``
    makes Slurm cancel it when the parent fails; without it, on clusters that do not set
    ``DependencyParameters=kill_invalid_depend``, the child would stay PENDING (DependencyNeverSatisfied)
    forever and the chain would never end."""
    if not dependency:
        return dict(params)
    extra = {**params.get("additional_parameters", {}), "kill-on-invalid-dep": "yes"}
    return {**params, "dependency": dependency, "additional_parameters": extra}


# ----------------------------------------------------------------------------- the plan


def build_plan(recipe, derived, files: list[str], host_python: str,
               stages: tuple[str, ...] = ("preprocess", "train", "convert"), skip_preprocess: bool = False,
               probe: bool = False) -> Plan:
    """All jobs of the chain (``files``: data.inputs expanded; ``probe``: the smoke test's train step)."""
    run = RunDir(Path(derived.run_dir))
    slurm_path("run.output_root", str(run.root))
    plan = Plan(run_dir=str(run.root))
    if "preprocess" in stages and not recipe.data.data_path:
        if skip_preprocess:
            plan.notes.append(f"preprocess: skipped, {derived.data_prefix} exists and matches its inputs and tokenizer")
        elif not files:
            raise ScriptError("data.inputs: no input files to preprocess")
        else:
            _plan_preprocess(plan, recipe, derived, run, files, host_python)
    c = recipe.cluster
    if "train" in stages:
        task = {"stage": "train", "run_dir": str(run.root), "args": [], "checkpoint_dir": derived.checkpoint_dir,
                "max_requeues": c.max_requeues, "train_iters": derived.train_iters, "world_size": c.world_size(),
                "hang": c.hang_policy()}
        plan.jobs.append(StageJob("train", train_params(recipe, run), None, [task], train_step(recipe, run, host_python, probe)))
    if "convert" in stages and recipe.convert.enabled:
        n = convert_task_count(recipe, derived.train_iters)
        out_dir = recipe.convert.output_dir or str(run.root / "hf")
        tasks = [{"stage": "convert", "run_dir": str(run.root), "args": [], "checkpoint_dir": derived.checkpoint_dir,
                  "iterations": str(recipe.convert.iterations), "out_dir": out_dir, **({"task": i} if n > 1 else {})}
                 for i in range(n)]
        plan.jobs.append(StageJob("convert", array_params(recipe, run, "convert", c.convert_time, n > 1),
                                  n if n > 1 else None, tasks, convert_step(recipe, run, host_python, derived.checkpoint_dir)))
        plan.notes.append(f"convert: {n} array task(s), iterations '{recipe.convert.iterations}' resolved at run time")
    for job in plan.jobs:  # the supervisor checks it is the hpcmeg that wrote the run (hpcmeg_version.json)
        for t in job.tasks:
            t["version_check"] = bool(recipe.cluster.version_check)
    return plan


def _plan_preprocess(plan: Plan, recipe, derived, run: RunDir, files: list[str], host_python: str) -> None:
    """The preprocess job (an array over shards when there are several) and, for shards, the merge job."""
    groups = shard_groups(files, recipe.data.shards)
    prefixes = shard_prefixes(derived.data_prefix, len(groups))
    manifest = {"files": files, "tokenizer": tokenizer_settings(recipe), "prefix": derived.data_prefix}
    one = len(groups) == 1
    tasks = [{"stage": "preprocess", "run_dir": str(run.root), "args": [pre, *g],
              **({"manifest": manifest} if one else {"task": i})}
             for i, (pre, g) in enumerate(zip(prefixes, groups))]
    time = recipe.cluster.preprocess_time
    plan.jobs.append(StageJob("preprocess", array_params(recipe, run, "preprocess", time, not one),
                              None if one else len(groups), tasks, preprocess_step(recipe, run, host_python)))
    plan.notes.append(f"preprocess: {len(files)} input file(s) in {len(groups)} array task(s)")
    if not one:
        plan.jobs.append(StageJob("merge", array_params(recipe, run, "merge", time, False), None,
                                  [{"stage": "merge", "run_dir": str(run.root), "args": [], "manifest": manifest}],
                                  merge_step(recipe, run, host_python, prefixes, derived.data_prefix)))
        plan.notes.append(f"merge: {len(groups)} shards -> {derived.data_prefix}")


def render_sbatch(job: StageJob, folder: str, python: str, dependency: Optional[str] = None) -> str:
    """The exact sbatch text submitit writes for ``job`` (its own generator, fed our parameters)."""
    from submitit.slurm.slurm import _make_sbatch_string  # submitit's sbatch text builder

    params = with_dependency(job.params, dependency)  # None values stay: wckey=None drops submitit's wckey
    command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, map_count=job.array, **params)
