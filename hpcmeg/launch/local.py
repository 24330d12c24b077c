"""The 'local' executor: the same preprocess -> train -> convert chain without Slurm, in the foreground.

Contract: ``run_chain(prep) -> exit code`` (0: every stage done). Same run directory layout, markers,
jobs.json (executor "local", this process's pid for ``hpcmeg cancel``) and log names as on Slurm
(tag "local", e.g. ``logs/train/train.local.r0.1.log`` for rank 1 of the first start), so
``hpcmeg status/logs`` read both alike. ``describe(prep)`` lists the commands for ``--dry-run``.

Train runs world_size = nodes x tasks_per_node local processes with RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT set (what torchrun would set; hpcmeg.procenv reads them). If one rank
fails the others are stopped (srun --kill-on-bad-exit). When training stops early to be resumed
(exit code 3), the run restarts in place under the same rules as the Slurm supervisor (restart cap,
progress required). SIGTERM/SIGINT to this process (``hpcmeg cancel``, Ctrl-C) are forwarded to the
ranks, which save and exit; the chain then stops with ``interrupted`` markers.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from hpcmeg.launch import scripts
from hpcmeg.launch.causes import failure_cause
from hpcmeg.launch.container import ContainerError, local_wrap
from hpcmeg.launch.stage_args import (container_spec, dataset_outputs, hpcmeg_argv, preprocess_flags, shard_groups,
                                      shard_prefixes, tokenizer_settings)
from hpcmeg.launch.rundir import RunDir, input_manifest, write_jobs, write_manifest, write_marker
from hpcmeg.launch.supervisor import convert_iteration, effective_train_rc, train_outcome
from hpcmeg.megatron.names import REQUEUE_EXIT_CODES, latest_iteration
from hpcmeg.launch.watch import LogFollower, Ticker, clock, shown
from hpcmeg.recipe import RecipeError, write_resolved


class _Stopped(Exception):
    """SIGTERM/SIGINT arrived: finish what is running, then stop the chain."""


class _Forwarder:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.signal: Optional[int] = None

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        self.signal = signum
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def install(self):
        return {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}


def _cmd(prep, stage: str, *args: str) -> list[str]:
    recipe = prep.recipe
    python = [sys.executable] if recipe.container.runtime == "none" else [recipe.container.python]
    return local_wrap(container_spec(recipe), hpcmeg_argv(python, stage, *args),
                      gpus=recipe.cluster.gpus_per_node > 0, always_bind=[str(prep.run.root)])


def _plan(prep) -> list[tuple[str, Optional[int], list[str], dict]]:
    """[(stage, task, argv, extra)] of everything but train and convert (whose args depend on run time)."""
    recipe, data_prefix = prep.recipe, prep.derived.data_prefix
    out = []
    if "preprocess" in prep.stages and not recipe.data.data_path and not prep.skip_preprocess:
        groups = shard_groups(prep.files, recipe.data.shards)
        prefixes = shard_prefixes(data_prefix, len(groups))
        for i, (pre, group) in enumerate(zip(prefixes, groups)):
            argv = _cmd(prep, "preprocess", *preprocess_flags(recipe), "--output-prefix", pre, "--input", *group)
            out.append(("preprocess", i if len(groups) > 1 else None, argv, {}))
        if len(groups) > 1:
            for output in dataset_outputs(data_prefix, recipe):
                suffix = output[len(data_prefix):]
                ins = [pre + suffix for pre in prefixes]
                argv = _cmd(prep, "merge-datasets", "--output-prefix", output, "--input", *ins)
                out.append(("merge", None, argv, {}))
    return out


def describe(prep) -> list[str]:
    recipe, derived = prep.recipe, prep.derived
    lines = [f"[{st}{'' if t is None else ' ' + str(t)}] " + scripts.q(argv) for st, t, argv, _ in _plan(prep)]
    if prep.skip_preprocess:
        lines.append(f"[preprocess] skipped: {derived.data_prefix} matches its inputs")
    if "train" in prep.stages:
        world = recipe.cluster.world_size()
        lines.append(f"[train] {world} process(es) with RANK=0..{world - 1}: "
                     + scripts.q(_cmd(prep, "train", str(prep.run.recipe))))
    if "convert" in prep.stages and recipe.convert.enabled:
        lines.append("[convert] " + scripts.q(_cmd(prep, "convert", derived.checkpoint_dir, "<out_dir>/iter_N", "--iteration",
                                             "N", "--dtype", recipe.convert.dtype)))
    return lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(fw: _Forwarder, argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:  # appended, never truncated (same rule as on Slurm)
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                             stdin=subprocess.DEVNULL)
    fw.procs.append(p)
    return p


def _wait_all(fw: _Forwarder, procs: list[subprocess.Popen], echo: Optional[tuple[str, LogFollower]] = None,
              tick: Optional[Ticker] = None) -> int:
    """Wait for every process; the first non-zero exit stops the rest. Returns the first failure's code.

    ``echo`` = (stage, follower of task/rank 0's log, made before the launch): the lines ``watch.shown``
    picks from what this launch appends go to the console as they are written, and ``tick`` prints a
    heartbeat when it has been quiet for its interval."""
    first_bad = 0
    follower = echo[1] if echo else None
    t_start = time.time()
    def show() -> None:
        if follower is not None and tick is not None:
            for line in follower.new_lines():
                if shown(line):
                    tick.say(f"{echo[0]}: {line}")

    while True:
        show()
        if tick is not None and tick.quiet_for() >= tick.heartbeat_s:
            tick.say(f"{echo[0] if echo else 'chain'}: still running, {clock(time.time() - t_start)} so far")
        alive = [p for p in procs if p.poll() is None]
        bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if bad and not first_bad:
            first_bad = bad[0]
            if first_bad not in REQUEUE_EXIT_CODES:  # one rank died: the others would hang in a collective
                for p in alive:
                    p.send_signal(signal.SIGTERM)
        if not alive:
            show()  # what the processes wrote last
            fw.procs = [p for p in fw.procs if p not in procs]
            return first_bad
        time.sleep(0.2)


def _new_lines_of(log: Path) -> LogFollower:
    """A follower of what is appended to ``log`` from now on. A chain started again (a resume by hand)
    appends to the same files (tag "local", restart 0), and the earlier chain's lines are not news."""
    return LogFollower(log, from_start=False)


def _simple(fw, run: RunDir, stage: str, task: Optional[int], argv: list[str], env: dict, tick: Ticker) -> None:
    tag = "local" if task is None else f"local_{task}"
    write_marker(run, stage, "started", task=task)
    tick.say(f"{stage}{'' if task is None else ' ' + str(task)}: running {scripts.q(argv)}")
    log = run.logs(stage) / f"{stage}.{tag}.r0.0.log"
    follower = _new_lines_of(log)
    rc = _wait_all(fw, [_launch(fw, argv, log, env)], (stage, follower), tick)
    if fw.signal is not None:
        write_marker(run, stage, "interrupted", task=task, exit_code=rc)
        raise _Stopped()
    if rc != 0:
        c = failure_cause(run.root, stage, tag, 0)
        reason = f"{stage} failed (exit code {rc}): {c.describe(run.root) if c else f'no error line in {log}'}"
        write_marker(run, stage, "failed", task=task, exit_code=rc, reason=reason)
        raise RuntimeError(reason)
    write_marker(run, stage, "done", task=task)


def _train(fw, prep, env: dict, tick: Ticker) -> None:
    from hpcmeg.launch.requeue import RequeueGuard

    r, d, run = prep.recipe, prep.derived, prep.run
    world = r.cluster.world_size()
    guard = RequeueGuard(str(run.markers / "train.requeue-state.json"), max_restarts=r.cluster.max_requeues,
                         max_no_progress=1)
    restart = 0
    while True:
        start_it = latest_iteration(d.checkpoint_dir)
        guard.on_start(restart, start_it)
        write_marker(run, "train", "started", start_iteration=start_it, restart=restart)
        port = r.cluster.master_port or _free_port()
        argv = _cmd(prep, "train", str(run.recipe))
        tick.say(f"train: {world} rank(s) x {scripts.q(argv)}" + (f" (restart {restart})" if restart else ""))
        procs = []
        attempt_start = time.time()
        rank0 = run.logs("train") / f"train.local.r{restart}.0.log"
        follower = _new_lines_of(rank0)
        for rank in range(world):
            renv = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(_launch(fw, argv, run.logs("train") / f"train.local.r{restart}.{rank}.log", renv))
        rc = effective_train_rc(_wait_all(fw, procs, ("train", follower), tick), run.root, attempt_start)
        end_it = latest_iteration(d.checkpoint_dir)
        if fw.signal is not None:
            write_marker(run, "train", "interrupted", exit_code=rc, iteration=end_it, restart=restart)
            raise _Stopped()
        verdict = (False, "not asked")
        if rc in REQUEUE_EXIT_CODES or (rc == 0 and (end_it is None or end_it < d.train_iters)):
            dec = guard.decide(restart, end_it)
            verdict = (dec.requeue, dec.reason)
        cause = None
        if rc != 0 and rc not in REQUEUE_EXIT_CODES:
            c = failure_cause(run.root, "train", "local", restart)
            cause = c.describe(run.root) if c else None
        out = train_outcome(rc, end_it, d.train_iters, verdict, cause)
        if out.action != "fail":  # a failure is said once, as the chain's last line
            tick.say(f"train: {out.action}: {out.reason}")
        if out.action == "done":
            write_marker(run, "train", "done", iteration=end_it, restart=restart)
            return
        if out.action == "fail":
            write_marker(run, "train", "failed", exit_code=rc, iteration=end_it, reason=out.reason, restart=restart)
            raise RuntimeError(out.reason)
        write_marker(run, "train", "requeued", iteration=end_it, reason=out.reason, restart=restart)
        restart += 1


def run_chain(prep, heartbeat_s: float = 10.0) -> int:
    recipe, derived, run = prep.recipe, prep.derived, prep.run.create()
    try:
        plan = _plan(prep)
        env = {"PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in recipe.cluster.env.items()}}
        scripts.env_exports(recipe.cluster.env)  # same name check as on Slurm
    except (ContainerError, scripts.ScriptError) as e:
        raise RecipeError([str(e)]) from None
    write_resolved(recipe, run.recipe)
    n_convert = (scripts.convert_task_count(recipe, derived.train_iters)
                 if "convert" in prep.stages and recipe.convert.enabled else 0)
    _write_jobs(prep, plan, n_convert)
    tick = Ticker(sys.stdout, heartbeat_s)
    if recipe.cluster.setup:
        tick.say("note: cluster.setup lines are for Slurm batch scripts; not run locally")
    fw = _Forwarder()
    old = fw.install()
    print(f"run directory: {run.root}", flush=True)
    try:
        manifest = None
        if plan:
            manifest = (derived.data_prefix, input_manifest(prep.files, tokenizer_settings(recipe)))
        elif prep.skip_preprocess:
            tick.say(f"preprocess: skipped, {derived.data_prefix} matches its inputs and tokenizer")
        for st, t, argv, _ in plan:
            _simple(fw, run, st, t, argv, env, tick)
        if manifest:
            write_manifest(*manifest)
        if "train" in prep.stages:
            _train(fw, prep, env, tick)
        _convert(fw, prep, n_convert, env, tick)
    except _Stopped:
        print(f"hpcmeg: the local chain was stopped ({signal.Signals(fw.signal).name}); resubmit to resume",
              file=sys.stderr)
        return 128 + int(fw.signal)
    except RuntimeError as e:
        sys.stdout.flush()
        print(f"hpcmeg submit: {e}; more: hpcmeg logs {scripts.q([str(run.root)])}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(f"done: {run.root}", flush=True)
    return 0


def _write_jobs(prep, plan: list, n_convert: int) -> None:
    """jobs.json as on Slurm (job id "local", this process's pid for ``hpcmeg cancel``)."""
    derived, run = prep.derived, prep.run
    stages = {}
    for st, t, _, _ in plan:
        stages.setdefault(st, {"job_id": "local", "array": None})
        if t is not None:
            stages[st]["array"] = t + 1
    if "train" in prep.stages:
        stages["train"] = {"job_id": "local", "array": None, "checkpoint_dir": derived.checkpoint_dir,
                           "train_iters": derived.train_iters}
    if n_convert:
        stages["convert"] = {"job_id": "local", "array": n_convert if n_convert > 1 else None}
    write_jobs(run, {"executor": "local", "submitted": time.time(), "pid": os.getpid(), "recipe": str(run.recipe),
                     "stages": stages})


def _convert(fw: _Forwarder, prep, n_convert: int, env: dict, tick: Ticker) -> None:
    """The convert tasks in turn, each resolving its iteration as the Slurm array task would."""
    recipe, derived, run = prep.recipe, prep.derived, prep.run
    out_dir = recipe.convert.output_dir or str(run.root / "hf")
    for i in range(n_convert):
        task = {"task": i, "checkpoint_dir": derived.checkpoint_dir, "iterations": str(recipe.convert.iterations)}
        try:
            it = convert_iteration(task)
        except RuntimeError as e:
            write_marker(run, "convert", "failed", task=i if n_convert > 1 else None, reason=str(e))
            raise
        t = i if n_convert > 1 else None  # marker names as on Slurm: one-task stages are not arrays
        if it is None:
            write_marker(run, "convert", "started", task=t)
            write_marker(run, "convert", "done", task=t, iteration=None)
            continue
        argv = _cmd(prep, "convert", derived.checkpoint_dir, str(Path(out_dir) / f"iter_{it:07d}"), "--iteration",
                    str(it), "--dtype", recipe.convert.dtype)
        _simple(fw, run, "convert", t, argv, env, tick)
