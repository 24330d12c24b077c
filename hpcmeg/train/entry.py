"""`hpcmeg train` and `hpcmeg prepare-cache`: build every part from a recipe and run the loop.

Contract
- `train(recipe, *, environ=None, exit_interval=None, on_built=None, signals=None) -> int` (exit code;
  `on_built(trainer)` runs before the first step, `signals` is an ExitSignal the caller installed) runs on
  one process, or on each of N processes started by torchrun / srun (ranks from hpcmeg.procenv), in the
  recipe's tensor / pipeline layout. The process count actually present decides data-parallel size and
  gradient accumulation: accumulation = global_batch / (micro_batch x DP), so the recipe's global batch
  holds whatever the rank count; a count other than cluster.nodes x tasks per node is one warning line
  (rank 0), not a refusal. Resumes from the latest valid checkpoint in derived.checkpoint_dir; with none
  there and checkpoint.load set, starts from that checkpoint's weights at iteration 0 (e.g. a 'release'
  import). `exit_interval` (library/test use, Megatron's --exit-interval): save and stop with EXIT_REQUEUE
  when iteration % exit_interval == 0.
- Exit codes (the Slurm supervisor keys on these):
      0 EXIT_OK        train_iters reached, final checkpoint saved
      1 EXIT_ERROR     any error, including a non-finite loss (the line names the iteration)
      2 EXIT_BAD_RECIPE the recipe (or its fit to the process count / the checkpoint) is wrong
      3 EXIT_REQUEUE   stopped early on SIGTERM/SIGUSR2, the wall-time guard, train.exit_duration_minutes
                       or exit_interval; every rank saved the SAME iteration: requeue and rerun the
                       same command to resume.
  `<run_dir>/train_status.json` (rank 0) records {status: finished|preempted|failed, iteration,
  exit_code, reason, time}: "preempted" means "resume me".
- Files: `<run_dir>/train_recipe.yaml` (the recipe as this run resolved it; `recipe.yaml` too when the
  run dir has none), metrics.jsonl + tensorboard/ (hpcmeg/train/metrics.py), checkpoints.
- Only global rank 0 prints metric lines; other ranks print errors only (prefixed with their rank).
- A failure on any rank reaches every rank (hpcmeg/train/peers.py, through the rendezvous store): the
  rank that failed prints its line(s) (rank 0 alone when several found the same); the others stop with
  one line naming it ("stopping: rank 1 failed", rank 0 adding its line) and its exit code, no
  traceback. Start-up ends with that agreement, so a rank that fails to build or load never leaves
  the others to their first collective.
- Signals: the handlers (hpcmeg/train/signals.py) are installed before anything slow (cli_train:
  before the recipe loads and torch imports). A stop asked before the first step ends the run there
  with one line ("stopping before the first step ...: resume me") and EXIT_REQUEUE: nothing new to save.
  SIGUSR1 writes every thread's stack to stderr (faulthandler) and the run goes on: the supervisor's
  way to see where a hung rank waits.
- Heartbeat: with HPCMEG_HEARTBEAT_DIR set (the supervisor sets it), each rank writes its progress
  file there (hpcmeg/heartbeat.py) from the start of `train` (phase init) to its end (phase done),
  the trainer reporting its phases and step times; a bad HPCMEG_HEARTBEAT_S or a directory that
  cannot be created is an error line, exit 1. Start-up's waits for the other ranks are reported as
  waiting (the process group's rendezvous, the start-up agreement and the collectives after it), so
  a rank that never gets there is told apart from the ranks waiting for it.
- HPCMEG_FAULT (tests only, hpcmeg/train/faults.py): parsed at the start of `train` (a malformed
  value: one line naming it, exit 1); a fault at init blocks this rank right after its heartbeat
  started, before the process group exists.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings

from hpcmeg.errors import one_line
from hpcmeg.fsutil import write_text_atomic
from hpcmeg.heartbeat import Heartbeat
from hpcmeg.megatron.names import EXIT_BAD_RECIPE, EXIT_ERROR, EXIT_OK, EXIT_REQUEUE
from hpcmeg.procenv import dist_env, slurm_job_end_time
from hpcmeg.recipe import Recipe, RecipeError, data_plan, derive, load_recipe, run_paths
from hpcmeg.train.faults import Faults

STATUS_FILE = "train_status.json"
WALLTIME_MARGIN_S = 60.0  # plus the measured longest save and step (WallTimeGuard)


def _write_status(run_dir: str, status: str, iteration, code: int, reason: str = "") -> None:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, STATUS_FILE)
    write_text_atomic(path, json.dumps({"status": status, "iteration": iteration, "exit_code": code,
                                        "reason": reason, "time": time.time()}))


def _show_warnings(caught: list, tag: str) -> None:
    """A skipped checkpoint is one line on stderr (not Python's two-line warning with a source
    line); any other warning recorded meanwhile is shown as Python would have shown it."""
    from hpcmeg.checkpoint.store import CheckpointWarning

    for w in caught:
        if issubclass(w.category, CheckpointWarning):
            print(f"{tag}: warning: {one_line(w.message)}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _record_failure(run_dir: str, iteration, code: int, reason: str) -> None:
    """train_status.json for the supervisor, on a failure already reported on stderr. Only into an
    existing run directory (a run that failed before writing anything leaves nothing behind), and
    a status that cannot be written (the directory is what failed) must not replace that report."""
    if os.path.isdir(run_dir):
        try:
            _write_status(run_dir, "failed", iteration, code, reason)
        except OSError:
            pass


def _wall_clock_end(recipe: Recipe, ctx) -> float | None:
    """Earliest of the Slurm job's end time (asked once, by rank 0) and train.exit_duration_minutes."""
    end = slurm_job_end_time() if ctx.is_rank0 and os.environ.get("SLURM_JOB_ID") else None
    end = ctx.all_reduce_max(int(end) if end else -1)  # rank 0's answer reaches everyone
    ends = [float(end)] if end > 0 else []
    if recipe.train.exit_duration_minutes:
        ends.append(time.time() + 60.0 * recipe.train.exit_duration_minutes)
    return min(ends) if ends else None


class _TrainJob:
    """One `train` call on this rank: what its failure report and status file read at any point (the
    trainer and context once built, the peers once the process group exists)."""

    def __init__(self, recipe: Recipe, env, sig, guard, fault: Faults):
        self.recipe, self.env, self.sig, self.guard, self.fault = recipe, env, sig, guard, fault
        self.tag = f"hpcmeg train [rank {env.rank}]" if env.world_size > 1 else "hpcmeg train"
        self.run_dir = run_paths(recipe).run_dir  # for the status file; build_trainer derives the rest, once
        self.trainer = self.ctx = self.peers = None
        self.heartbeat: Heartbeat | None = None

    def start_heartbeat(self, environ) -> None:
        """This rank's heartbeat when the supervisor asked for one (HPCMEG_HEARTBEAT_DIR), in phase init."""
        self.heartbeat = Heartbeat.from_env(self.env.rank, os.environ if environ is None else environ)
        if self.heartbeat is not None:
            self.heartbeat.start()

    def progress(self, phase: str, iteration: int | None = None, waiting: bool = False) -> None:
        if self.heartbeat is not None:
            self.heartbeat.at(phase, iteration, waiting)

    def step_time(self, seconds: float) -> None:
        self.guard.record_step(seconds)
        if self.heartbeat is not None:
            self.heartbeat.iteration_done(seconds)

    def stop(self) -> str | None:
        if self.sig.flag:
            return f"signal {self.sig.received.name}"
        if self.guard.should_stop():
            return f"wall-time guard ({self.guard.remaining_s():.0f} s left)"
        return None

    def on_context(self, context) -> None:
        from hpcmeg.train.peers import PeerReport

        self.peers = PeerReport.of(context)  # from here on a failure on any rank is seen by every rank
        self.progress("init")  # every rank joined the process group: building, no longer waiting

    def iteration(self):
        return self.trainer.state.iteration if self.trainer else None

    def failed(self, code: int, lines: list[str], same_everywhere: bool = False) -> int:
        """This rank's failure: its lines (by rank 0 alone when several ranks found the same),
        recorded for the other ranks and, on rank 0, in train_status.json."""
        if self.peers is not None:
            show = self.peers.fail(code, lines)
        else:  # before the process group: a recipe problem is found alike by every rank
            show = self.env.rank == 0 or not same_everywhere
        if show:
            for line in lines:
                print(f"{self.tag}: {line}", file=sys.stderr)
        if self.env.rank == 0:
            _record_failure(self.run_dir, self.iteration(), code, lines[0])
        return code

    def stopped_by(self, failure) -> int:
        """Another rank failed (it printed its own line): one line naming it, its exit code."""
        first, code, lines = failure.failures[0]
        rank0 = self.env.rank == 0
        print(f"{self.tag}: stopping: {failure}" + (f": {lines[0]}" if rank0 else " (its own line names the problem)"),
              file=sys.stderr)
        if rank0:
            _record_failure(self.run_dir, self.iteration(), code, f"rank {first}: {lines[0]}")
        self.peers.acknowledge()
        return code

    def build(self, exit_interval: int | None) -> None:
        """build_trainer; the checkpoints it skipped are one line each (none when loading failed: the
        error line names the checkpoint files already, it alone is the report)."""
        from hpcmeg.checkpoint.safe import UnreadableCheckpointError, UnsafeCheckpointError
        from hpcmeg.checkpoint.store import CheckpointLoadError, CheckpointWarning
        from hpcmeg.train.build import build_trainer

        caught: list = []
        self.progress("init", waiting=True)  # until on_context: the process group's rendezvous waits for every rank
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CheckpointWarning)
                self.trainer, self.ctx = build_trainer(
                    self.recipe, self.env, stop=self.stop, exit_interval=exit_interval,
                    on_step_time=self.step_time, on_save_time=self.guard.record_save,
                    on_context=self.on_context, progress=self.progress, fault=self.fault)
        except (CheckpointLoadError, UnsafeCheckpointError, UnreadableCheckpointError):
            caught = [w for w in caught if not issubclass(w.category, CheckpointWarning)]
            raise
        finally:
            _show_warnings(caught, self.tag)

    def run(self, exit_interval: int | None, on_built, environ) -> int:
        """Heartbeat, build, learn whether every rank started, then train; the exit code."""
        self.start_heartbeat(environ)
        self.fault("init")
        rank0 = self.env.rank == 0
        if rank0:
            _process_count_warning(self.recipe, self.env.world_size, self.tag)
        self.build(exit_interval)
        if self.peers is not None:
            self.progress("init", waiting=True)  # for the others, then their collectives (the trainer's init ends it)
            self.peers.startup_done()  # every rank learns here whether another one failed to start
        self.guard.end_time = _wall_clock_end(self.recipe, self.ctx)
        if self.ctx.all_reduce_max(self.sig.flag):  # a stop asked before the first step: nothing new to save
            return self.stopped_before_first_step()
        if on_built is not None:
            on_built(self.trainer)
        out = self.trainer.run()
        code = EXIT_OK if out.status == "finished" else EXIT_REQUEUE
        if rank0:
            _write_status(self.run_dir, out.status, out.iteration, code, out.reason)
        return code

    def stopped_before_first_step(self) -> int:
        reason = f"signal {self.sig.received.name}" if self.sig.flag else "a signal on another rank"
        it = self.trainer.state.iteration
        self.trainer.metrics.write({"kind": "event", "what": "preempted", "iteration": it, "reason": reason})
        self.trainer.metrics.print(f"stopping before the first step at iteration {it} ({reason}): nothing new "
                                   f"to save; resume me")
        if self.env.rank == 0:
            _write_status(self.run_dir, "preempted", it, EXIT_REQUEUE, reason)
        return EXIT_REQUEUE

    def close(self) -> None:
        try:
            if self.trainer is not None:
                self.trainer.wait_for_save()
                self.trainer.metrics.close()
        finally:
            if self.ctx is not None:
                self.ctx.destroy()
            if self.heartbeat is not None:
                self.heartbeat.close()  # after the last collective; lingering below is not a hang
            if self.peers is not None:
                self.peers.linger()  # a failed rank waits for the others' lines (kill-on-bad-exit)
                self.peers.close()  # rank 0, which serves the store, leaves after the others


def train(recipe: Recipe, *, environ=None, exit_interval: int | None = None, on_built=None, signals=None) -> int:
    """Train `recipe` in this process group; returns an exit code (see the module docstring).

    on_built(trainer) runs after everything is built and before the first step (hooks for fault
    injection in tests, or extra instrumentation). signals: an ExitSignal the caller installed
    earlier (cli_train: before the recipe loads and torch imports); None = installed here."""
    from hpcmeg.parallel.context import DeviceUnavailableError
    from hpcmeg.checkpoint.safe import UnreadableCheckpointError, UnsafeCheckpointError
    from hpcmeg.checkpoint.store import CheckpointLoadError
    from hpcmeg.train.data import TokenIdError
    from hpcmeg.train.peers import PeerFailed
    from hpcmeg.train.signals import ExitSignal, WallTimeGuard, dump_stacks_on_signal, stop_dumping_stacks
    from hpcmeg.train.trainer import TrainingDiverged

    env = dist_env(environ)
    try:
        fault = Faults.from_env(env.rank, environ)
    except ValueError as e:  # every rank reads the same value: rank 0 says it
        if env.rank == 0:
            print(f"hpcmeg train: {e}", file=sys.stderr)
        return EXIT_ERROR
    sig = signals if signals is not None else ExitSignal().install()  # a SIGTERM in start-up is kept
    if signals is None:
        dump_stacks_on_signal()
    job = _TrainJob(recipe, env, sig, WallTimeGuard(None, WALLTIME_MARGIN_S), fault)
    try:
        return job.run(exit_interval, on_built, environ)
    except PeerFailed as e:
        return job.stopped_by(e)
    except RecipeError as e:
        return job.failed(EXIT_BAD_RECIPE, list(e.problems), same_everywhere=True)
    except (TokenIdError, DeviceUnavailableError) as e:  # the recipe does not fit the data / the machine
        return job.failed(EXIT_BAD_RECIPE, [one_line(e)])
    except (TrainingDiverged, OSError, ValueError, CheckpointLoadError, UnsafeCheckpointError,
            UnreadableCheckpointError) as e:  # data and runtime faults whose message names the file and fix
        return job.failed(EXIT_ERROR, [one_line(e)])
    except Exception as e:  # noqa: BLE001 - report, mark, exit non-zero
        # a collective that lost its peer: the rank that failed recorded why (PeerReport)
        peer = job.peers.peer_failures() if job.peers is not None and isinstance(e, RuntimeError) else None
        if peer is not None:
            return job.stopped_by(peer)
        traceback.print_exc()
        return job.failed(EXIT_ERROR, [f"error: {type(e).__name__}: {one_line(e)}"])
    finally:
        try:
            job.close()
        finally:
            if signals is None:
                sig.restore()
                stop_dumping_stacks()


def _process_count_warning(recipe: Recipe, running: int, tag: str) -> None:
    """One line when the processes running are not the recipe's cluster.nodes x tasks per node. Not
    refused: data parallelism takes whatever count runs (one process to debug, torchrun on a
    workstation, srun in an allocation), keeping the global batch by gradient accumulation."""
    cluster = recipe.cluster
    planned = cluster.world_size()
    if planned == running:
        return
    per = "cluster.gpus_per_node" if cluster.gpus_per_node > 0 else "cluster.cpu_tasks_per_node"
    print(f"{tag}: warning: {running} process(es) are running but the recipe plans {planned} (cluster.nodes "
          f"{cluster.nodes} x {per} {cluster.tasks_per_node()}); data parallelism and gradient accumulation follow "
          f"the {running} running (train.global_batch_size {recipe.train.global_batch_size} is kept); start "
          f"{planned} to run as planned", file=sys.stderr)


def cli_train(args) -> int:
    from hpcmeg.train.signals import ExitSignal, dump_stacks_on_signal, stop_dumping_stacks

    # first: a SIGTERM while the recipe loads and torch imports is kept (the run then stops before
    # its first step with a line), not fatal; a SIGUSR1 then shows where start-up waits
    dump_stacks_on_signal()
    try:
        with ExitSignal() as sig:
            recipe = load_recipe(args.recipe, args.overrides, args.profile)
            return train(recipe, signals=sig)
    finally:
        stop_dumping_stacks()


def cli_prepare_cache(args) -> int:
    """Build the GPT dataset index cache the training run will load (run it on a login node)."""
    from hpcmeg.data.blended import prepare_cache
    from hpcmeg.train.data import blend_arg, check_inputs_exist, dataset_config

    recipe = load_recipe(args.recipe, args.overrides, args.profile)
    plan = data_plan(recipe, derive(recipe))
    try:
        check_inputs_exist(plan)
        t0 = time.time()
        out = prepare_cache(dataset_config(plan), blend_arg(plan), plan.samples)
    except (OSError, ValueError) as e:
        print(f"hpcmeg prepare-cache: {one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    for name, n, ds in zip(("train", "valid", "test"), plan.samples, out):
        print(f"{name}: requested {n} samples, built {len(ds) if ds is not None else 0}")
    print(f"index cache ready in {plan.cache_dir} ({time.time() - t0:.1f} s)")
    return EXIT_OK
