"""`hpcmeg smoke --profile NAME`: a minutes-long chain through the real scheduler that checks a new cluster.

Contract: ``cli_smoke(args) -> exit code`` (0: every check passed; 1: one failed; 2: the profile or a
``--set`` is refused before anything is submitted, by the same checks as ``hpcmeg submit``);
``hpcmeg smoke-probe RUN``, run on every rank by the smoke's train step, is hpcmeg/launch/smoke_probe.py;
reading back what the jobs wrote is hpcmeg/launch/smoke_evidence.py.

The chain is the one ``hpcmeg submit`` builds, with the user's profile (partition, account, GPUs,
container, interpreter) and a tiny recipe: preprocess of an embedded corpus (a slice of the Python
standard library), a few training iterations on every rank of one node (gpus_per_node ranks; CPU
ranks when there are none), convert. The train step first runs the probe on the same ranks: devices,
an all-reduce (NCCL on GPUs, gloo on CPU), a write into the run directory. Then this process loads the
converted model with ``AutoModelForCausalLM``. Each check prints one PASS/FAIL line as soon as it is
known; while waiting a line comes at least every ``HEARTBEAT_S`` seconds.

The run directory is ``<--output-root>/hpcmeg-smoke``; a previous smoke run there is replaced (it is
recognised by its ``.hpcmeg-smoke`` file; another directory of that name is never touched).

Stopped (Ctrl-C, SIGTERM, SIGHUP) once jobs may be in the queue: the jobs are cancelled on the way out
(one line), exit 128 + the signal's number. A signal during the submission itself is acted on once the
submission returns, so every job submitted is recorded and cancelled. ``--timeout`` must be > 0.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from hpcmeg.launch.smoke_evidence import (checkpoint_detail, describe_ranks, first_loss_line, last_log_line,
                                          load_converted, probe_results)

HEARTBEAT_S = 8.0
POLL_S = 1.0
RUN_NAME = "hpcmeg-smoke"
TAG_FILE = ".hpcmeg-smoke"
CHECKS = ("interpreter and hpcmeg on the node", "run directory writable from the node", "preprocess",
          "container start", "devices per rank", "all-reduce across all ranks", "first loss line", "training",
          "convert", "converted model loads")


def smoke_recipe(output_root: str, world: int, gpus: bool, corpus: str) -> dict:
    """The tiny recipe (as YAML data): profile values it does not name stay the profile's."""
    return {
        "run": {"name": RUN_NAME, "output_root": output_root},
        "data": {"inputs": [corpus], "json_keys": ["content"], "workers": 1, "split": "90,10,0", "seq_length": 64,
                 "num_workers": 0},
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 64,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "train": {"micro_batch_size": 1, "global_batch_size": world, "train_iters": 6, "lr": 1e-3,
                  "min_lr": 1e-4, "lr_warmup_iters": 1, "log_interval": 1, "eval_interval": 0, "compile": "off",
                  "precision": "bf16" if gpus else "fp32", "seed": 1234},
        "checkpoint": {"save_interval": 0, "keep_last": None},
        "cluster": {"nodes": 1, "time": "00:20:00", "preprocess_time": "00:10:00", "convert_time": "00:10:00",
                    "signal_lead_s": 60, "max_requeues": 0},
        "convert": {"iterations": "last", "dtype": "fp32"},
    }


class Reporter:
    """Prints one line per check (PASS/FAIL); a daemon thread prints ``... <waiting>`` whenever nothing was
    printed for HEARTBEAT_S seconds, so a slow status query or model load never leaves the user in silence."""

    def __init__(self, out=None, clock: Callable[[], float] = time.time):
        self.out = out or sys.stdout
        self.clock = clock
        self.t0 = clock()
        self.last = self.t0
        self.done: dict[str, bool] = {}
        self.waiting = "checking the profile"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> "Reporter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        while not self._stop.wait(0.5):
            if self.clock() - self.last >= HEARTBEAT_S:
                self.line(f"... {self.waiting}")

    def line(self, text: str) -> None:
        with self._lock:
            print(f"[smoke {self.clock() - self.t0:5.0f}s] {text}", file=self.out, flush=True)
            self.last = self.clock()

    def result(self, check: str, ok: bool, detail: str) -> None:
        if check in self.done:
            return
        self.done[check] = ok
        self.line(f"{'PASS' if ok else 'FAIL'} {check}: {detail}")

    @property
    def failed(self) -> bool:
        return not all(self.done.values())


# ----------------------------------------------------------------------------- the command


# divisible by every rank count up to 16 and by 18, 20, 24, 32 ... 256: only the first load uses it,
# to learn the profile's ranks per node before the real global batch (= ranks) is set
_ANY_WORLD = 2 ** 8 * 3 ** 4 * 5 ** 2 * 7 * 11 * 13


def _prepare(args):
    """Recipe + run directory + corpus + plan; RecipeError leaves nothing of this run behind."""
    from hpcmeg.data.corpus import write_stdlib_corpus
    from hpcmeg.launch.rundir import RunDir
    from hpcmeg.launch.slurm_chain import active_jobs
    from hpcmeg.launch.submit import prepare
    from hpcmeg.recipe import RecipeError, load_recipe

    first = smoke_recipe("runs", _ANY_WORLD, False, "corpus.jsonl")
    cluster = load_recipe(None, list(args.overrides), args.profile, data=first).cluster
    if cluster.executor != "slurm":
        raise RecipeError([f"cluster.profile: '{cluster.profile}' runs without Slurm (cluster.executor "
                           f"{cluster.executor}); hpcmeg smoke checks a Slurm cluster (for this machine alone: "
                           f"hpcmeg demo --profile local)"])
    world = cluster.tasks_per_node()
    root = Path(os.path.abspath(os.path.expanduser(args.output_root)))
    run = RunDir(root / RUN_NAME)
    corpus = run.root / "smoke-corpus.jsonl"
    recipe = load_recipe(None, list(args.overrides), args.profile,
                         data=smoke_recipe(str(root), world, cluster.gpus_per_node > 0, str(corpus)))
    if run.root.exists():
        if not (run.root / TAG_FILE).exists():
            raise RecipeError([f"run.output_root: {run.root} exists and is not a smoke run directory; choose another "
                               f"--output-root"])
        busy = active_jobs(run)
        if busy:
            raise RecipeError([f"{run.root}: an earlier smoke run still has jobs in the queue ({', '.join(busy)}); "
                               f"hpcmeg cancel {run.root}"])
        shutil.rmtree(run.root)
    created = not root.exists()
    try:
        run.root.mkdir(parents=True)
        (run.root / TAG_FILE).write_text("a hpcmeg smoke run directory: the next hpcmeg smoke replaces it\n")
        write_stdlib_corpus(str(corpus), key="content", include_tests=False, max_files=40)
        prep = prepare(recipe, probe=True, submitting=True)
    except Exception:  # noqa: BLE001 - whatever refused it, nothing of this run stays behind
        shutil.rmtree(run.root, ignore_errors=True)
        if created:
            shutil.rmtree(root, ignore_errors=True)
        raise
    return prep


class Stopped(Exception):
    """A stop signal arrived while the smoke jobs may be queued."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP raise Stopped, or, while `defer` is set (the submission: a job
    submitted must also be recorded to be cancelled), are recorded and raised once it is cleared."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received: int | None = None
        self.defer = False
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.received is None:
            self.received = signum
        if not self.defer:
            raise Stopped(self.received)

    def __enter__(self) -> "StopSignals":
        self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def resume(self) -> None:
        """End of a deferred part: raise Stopped for a signal that came meanwhile."""
        self.defer = False
        if self.received is not None:
            raise Stopped(self.received)

    def ignore(self) -> None:
        """While cancelling: further signals must not cut the cancellation short."""
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def cli_smoke(args) -> int:
    from hpcmeg.launch.checks import DataError

    if not args.timeout > 0:  # (NaN too)
        print(f"hpcmeg smoke: error: argument --timeout: {args.timeout:g} is not a positive number of seconds; "
              f"see 'hpcmeg smoke --help'", file=sys.stderr)
        return 2
    with Reporter() as rep:
        try:
            return _smoke(args, rep)
        except DataError as e:  # (the embedded corpus is always readable; a broken install is not)
            print(f"hpcmeg smoke: {e.lines[0]}", file=sys.stderr)
            return 1


def _smoke(args, rep: Reporter) -> int:
    from hpcmeg.launch.slurm_chain import submit_plan
    from hpcmeg.launch.submit import write_run_files

    rep.line(f"hpcmeg smoke with profile {args.profile}: checking the profile and the compute-node interpreter")
    prep = _prepare(args)  # RecipeError: one line per problem, exit 2 (nothing submitted)
    run = prep.run
    rep.waiting = "submitting"
    write_run_files(prep)
    with StopSignals() as stop:
        try:
            stop.defer = True
            try:
                ids = submit_plan(prep)
            except Exception as e:  # noqa: BLE001 - Slurm's own refusal, in one line
                rep.line(f"FAIL submission: {' '.join(str(e).split())[:400]}")
                _cancel(run)  # a job submitted before the refusal
                return 1
            stop.resume()
            return _watch(args, rep, prep, ids)
        except Stopped as e:
            stop.ignore()
            _cancel(run)
            rep.line(f"stopped by {e}: cancelled the smoke jobs (hpcmeg status {run.root})")
            return 128 + e.signum


def _watch(args, rep: Reporter, prep, ids: dict) -> int:
    """From the submitted jobs to the verdict (Stopped may come from any line: the caller cancels)."""
    from hpcmeg.launch import status as launch_status
    from hpcmeg.launch.job_states import BAD
    from hpcmeg.launch.provenance import describe, fingerprint
    from hpcmeg.launch.rundir import read_markers

    recipe, run = prep.recipe, prep.run
    cluster = recipe.cluster
    ranks_desc = f"{cluster.tasks_per_node()} {'GPU' if cluster.gpus_per_node > 0 else 'CPU'} rank(s) on 1 node"
    rep.line(f"submitted {', '.join(f'{s} {j}' for s, j in ids.items())} ({ranks_desc}); run directory {run.root}")
    mine = fingerprint()
    deadline = time.time() + float(args.timeout)
    last_status = 0.0
    status: dict = {"stages": {}}
    while True:
        markers = read_markers(run)
        now = time.time()
        if now - last_status >= 2.0 or not status["stages"]:
            status = launch_status.run_status(run.root)
            last_status = now
        states = {s: v["state"] for s, v in status["stages"].items()}
        _progress(rep, prep, markers, states, mine, describe)
        failed = [s for s in ("preprocess", "merge", "train", "convert") if states.get(s) in BAD]
        if failed or rep.failed:
            return _fail(rep, run, markers, states, failed)
        if all(v == "COMPLETED" for v in states.values()) and "convert" in states:
            break
        if now > deadline:
            rep.line(f"FAIL timed out after {args.timeout:.0f} s: {states}")
            _cancel(run)
            return 1
        waiting = next((s for s in ("preprocess", "train", "convert") if states.get(s) not in (None, "COMPLETED")), "")
        why = sorted({t.get("reason", "") for t in status["stages"].get(waiting, {}).get("tasks", {}).values()} - {""})
        rep.waiting = f"waiting for {waiting}: {states.get(waiting, '?')}" + (f" ({why[0]})" if why else "")
        time.sleep(POLL_S)
    return _verdict(rep, recipe, run)


def _fail(rep: Reporter, run, markers: dict, states: dict, failed: list[str]) -> int:
    """A stage failed (``failed``) or a check did: say which and why, cancel the rest, exit 1."""
    if failed:  # the first stage that failed; what it cancelled downstream is "not reached"
        stage = next((x for x in failed if states[x] != "CANCELLED"), failed[0])
        ev = markers.get(stage) or next((m for k, m in markers.items() if k.startswith(stage + ".")), {})
        why = (ev.get("failed") or {}).get("reason") or "no reason recorded"
        rank_logs = [p for p in run.logs(stage).glob("*.log") if not p.name.endswith(".batch.log")]
        detail = last_log_line(rank_logs) if rank_logs else last_log_line(list(run.logs(stage).glob("*.log")))
        pending = next((k for k in _pending_for(stage) if k not in rep.done), stage)
        rep.result(pending, False, f"the {stage} job ended {states[stage]}: {why}; last log line: {detail}")
    _cancel(run)
    left = [k for k in CHECKS if k not in rep.done]
    if left:
        rep.line(f"not reached: {', '.join(left)}")
    rep.line(f"smoke test FAILED; logs: hpcmeg logs {run.root} --stage {failed[0] if failed else 'train'}")
    return 1


def _verdict(rep: Reporter, recipe, run) -> int:
    """Every job completed: load the converted model, then PASS only if every check was seen to pass."""
    rep.waiting = "loading the converted model with transformers"
    rep.line(f"... {rep.waiting}")
    ok, detail = load_converted(run.root / "hf" / f"iter_{recipe.train.train_iters:07d}")
    rep.result("converted model loads", ok, f"AutoModelForCausalLM.from_pretrained({detail})")
    missing = [k for k in CHECKS if k not in rep.done]
    for k in missing:
        rep.result(k, False, "not observed")
    if rep.failed:
        rep.line("smoke test FAILED")
        return 1
    rep.line(f"smoke test PASSED: {len(CHECKS)} checks in {time.time() - rep.t0:.0f} s (run directory {run.root})")
    return 0


def _pending_for(stage: str) -> tuple[str, ...]:
    return {"preprocess": ("interpreter and hpcmeg on the node", "preprocess"),
            "merge": ("preprocess",),
            "train": ("container start", "devices per rank", "all-reduce across all ranks", "first loss line",
                      "training"),
            "convert": ("convert",)}.get(stage, (stage,))


def _progress(rep: Reporter, prep, markers: dict, states: dict, mine: dict, describe) -> None:
    """Print every check whose answer the run directory now holds."""
    recipe, run, cluster = prep.recipe, prep.run, prep.recipe.cluster
    started = next((markers[s]["started"] for s in ("preprocess", "train") if "started" in markers.get(s, {})), None)
    if started:
        same = (started.get("hpcmeg_version"), started.get("hpcmeg_source")) == (mine["version"], mine["source"])
        node = started.get("node") or started.get("host")
        rep.result("interpreter and hpcmeg on the node", same,
                   f"{started.get('python')} (Python {started.get('python_version')}) on {node} runs "
                   f"hpcmeg {started.get('hpcmeg_version')} (source {started.get('hpcmeg_source')})"
                   + ("" if same else f"; this submit is {describe(mine)}"))
        rep.result("run directory writable from the node", True,
                   f"the supervisor on {node} wrote {run.markers}")
    if states.get("preprocess") == "COMPLETED":
        rep.result("preprocess", True, f"{len(prep.files)} input file(s) tokenized into {prep.derived.data_prefix}_*")
    ranks = probe_results(run)
    world = cluster.tasks_per_node()
    if ranks and len(ranks) == world:
        spec = (f"{recipe.container.runtime} image {recipe.container.image}" if recipe.container.runtime != "none"
                else "no container (container.runtime none)")
        ev = ranks[0]
        rep.result("container start", True,
                   f"{spec}: rank 0 ran {ev['python']} (Python {ev['python_version']}, torch {ev['torch']}, hpcmeg "
                   f"{ev['hpcmeg_version']}); {ev['container']}")
        ok, text = describe_ranks(ranks, cluster.gpus_per_node)
        rep.result("devices per rank", ok, text)
        sums_ok = all(x.get("allreduce_sum") == x.get("allreduce_expected") and x.get("allreduce_16mib_ok")
                      for x in ranks)
        rep.result("all-reduce across all ranks", sums_ok,
                   f"{ev.get('backend')} over {world} rank(s): sum {ev.get('allreduce_sum'):g} (expected "
                   f"{ev.get('allreduce_expected'):g}) and a 16 MiB all-reduce, {ev.get('allreduce_s')} s")
        rep.result("run directory writable from the node", True, f"every rank wrote {run.root / 'smoke'}")
    line = first_loss_line(run)
    if line:
        import math

        try:
            loss = float(line.split("| loss ", 1)[1].split()[0])
        except (IndexError, ValueError):
            loss = float("nan")
        rep.result("first loss line", math.isfinite(loss), line)
    if states.get("train") == "COMPLETED":
        iters = recipe.train.train_iters
        rep.result("training", True, f"{iters} iterations on {world} rank(s): "
                                     f"{checkpoint_detail(prep.derived.checkpoint_dir, iters)}")
    if states.get("convert") == "COMPLETED":
        rep.result("convert", True, f"the convert job wrote {run.root / 'hf'}")


def _cancel(run) -> None:
    from hpcmeg.launch.status import cli_cancel

    try:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            cli_cancel(str(run.root))
    except Exception:  # noqa: BLE001 - best effort: the jobs end by themselves (kill-on-invalid-dep)
        pass
