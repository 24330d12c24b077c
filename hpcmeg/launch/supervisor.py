"""Host-side supervisor: the submitit callable of every hpcmeg Slurm job, and the requeue decision.

Contract: ``run_task(task: dict)`` is what submitit pickles (a module-level function of an installed
module, pickled by reference, with plain-data arguments; only the host Python that wrote the pickle
ever reads it, so host/container Python versions never meet). It runs in the batch shell
(``use_srun=False``) on the job's first node, where the Slurm commands exist, and:

  0. checks that the hpcmeg it imports is the one that wrote the run (``hpcmeg_version.json``, unless
     cluster.version_check is false): otherwise one line, a ``failed`` marker, and no step is run;
  1. writes ``markers/<stage>[.<task>].started`` (with this interpreter and hpcmeg version, which
     ``hpcmeg smoke`` reports) and a banner in the batch log (job id, restart);
  2. runs ``scripts/<stage>_step.sh ARGS`` (one ``srun`` step; the ranks run in the container), a train
     step watched through its ranks' heartbeats (``health/<job>.r<restart>/``): a hang (hpcmeg/launch/
     health.py) is one line naming the rank(s) behind with node, phase and iteration (batch log,
     ``health.json``); stacks dumped, step cancelled, job requeued without the culprits' node
     (hpcmeg/launch/hang.py; counts against max_requeues) or failed. A rank that died of a signal
     (srun's 'task N: Killed' line in this batch log) is named and routed around the same way;
  3. decides. Train: finished -> ``done``; the trainer saved for a requeue (exit code
     ``REQUEUE_EXIT_CODES`` or exit 0 before ``train_iters``) and restarts < ``max_requeues`` and the
     checkpointed iteration advanced during this attempt -> ``scontrol requeue $SLURM_JOB_ID`` (same
     job id, so ``afterok`` dependants keep waiting) and exit without a result; otherwise ``failed``
     with one clear line. Other stages: step exit 0 -> ``done`` (+ dataset manifest), else ``failed``.
     A failure's marker reason carries the failing task's own error line and log path
     (hpcmeg.launch.causes); the job then ends with that line and exit code 1, no traceback.

Signals: the train job's ``--signal=TERM@lead`` has no ``B:``, so it reaches the step's ranks and not
this process (verified on Slurm 22.05). This process only gets SIGTERM when Slurm itself ends the
job (scancel, ``scontrol requeue``, preemption, hard time limit); then it writes ``interrupted`` at
once (Slurm's SIGKILL follows KillWait seconds later), lets the step finish its save, rewrites the
marker with the step's exit code and leaves requeueing to Slurm: Slurm requeues (preemption/requeue) or
not (cancel, timeout), and the restarted job resumes from the latest checkpoint.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from hpcmeg.heartbeat import ENV_DIR, ENV_INTERVAL, read_beats
from hpcmeg.launch.causes import failure_cause
from hpcmeg.launch.hang import dump_and_cancel, requeue_excluding, usable_exclusion, watch_step
from hpcmeg.launch.health import HangPolicy, died, excluded_nodes, record_event
from hpcmeg.launch.rundir import (RunDir, input_manifest, read_json, write_manifest, write_marker)
from hpcmeg.megatron.names import REQUEUE_EXIT_CODES, committed_iterations, latest_iteration
from hpcmeg.procenv import slurm_job_end_time
from hpcmeg.launch.scripts import parse_iteration_list


@dataclass(frozen=True)
class TrainOutcome:
    action: str  # done | requeue | fail
    reason: str


def effective_train_rc(rc: int, run_dir: str | os.PathLike, attempt_start: float) -> int:
    """The trainer's own verdict when srun's exit code hides it.

    srun --kill-on-bad-exit ends the step as soon as one rank exits non-zero, so when rank 0 exits 3
    ("saved, requeue me") a slower rank may be killed and srun reports 143. Rank 0 writes
    ``train_status.json`` (status "preempted" = resume me) before exiting: trust it when it was written
    during this attempt."""
    if rc in REQUEUE_EXIT_CODES or rc == 0:
        return rc
    try:
        st = read_json(Path(run_dir) / "train_status.json", None) or {}
    except ValueError:
        return rc
    if st.get("status") == "preempted" and float(st.get("time", 0)) >= attempt_start:
        return REQUEUE_EXIT_CODES[0]
    return rc


def train_outcome(rc: int, end_iteration: Optional[int], train_iters: int, needs_requeue_ok: tuple[bool, str],
                  cause: Optional[str] = None) -> TrainOutcome:
    """Pure decision after a train step ended (``needs_requeue_ok``: the requeue guard's verdict;
    ``cause``: the failing rank's one-line cause and log, hpcmeg.launch.causes)."""
    finished = end_iteration is not None and end_iteration >= train_iters
    if rc == 0 and finished:
        return TrainOutcome("done", f"finished at iteration {end_iteration}")
    if rc in REQUEUE_EXIT_CODES or rc == 0:
        ok, why = needs_requeue_ok
        if ok:
            return TrainOutcome("requeue", f"saved at iteration {end_iteration} of {train_iters}; requeue: {why}")
        return TrainOutcome("fail", f"training stopped at checkpointed iteration {end_iteration} of {train_iters} "
                                    f"and will not be requeued: {why}")
    return TrainOutcome("fail", f"the training step failed (exit code {rc}, last checkpointed iteration "
                                f"{end_iteration}): {cause or 'no error line in the rank logs (killed?)'}")


class StageFailed(Exception):
    """An expected failure of a stage (its marker is written): one line in the batch log, exit 1."""


def _tag() -> tuple[str, int]:
    """(log tag, restart) as the step scripts name this job's task logs."""
    env = os.environ
    tag = (f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}" if env.get("SLURM_ARRAY_JOB_ID")
           else env.get("SLURM_JOB_ID", "local"))
    return tag, int(env.get("SLURM_RESTART_COUNT", "0") or 0)


def step_cause(run: RunDir, stage: str) -> Optional[str]:
    """The failing task's one-line cause in this job's task logs (None: no error line found)."""
    tag, restart = _tag()
    c = failure_cause(run.root, stage, tag, restart)
    return c.describe(run.root) if c else None


class _SlurmEnds:
    """Records SIGTERM (Slurm ending the whole job); replaces submitit's handlers in this process.

    ``on_first`` runs once, at the first signal: Slurm SIGKILLs this process KillWait seconds later
    (30 s by default, 5 on some sites and on the local test cluster) whether or not the step has
    finished its save by then, so whatever must be on disk after an ending (the ``interrupted``
    marker) is written at once and only refined after the step ends, if there is time."""

    def __init__(self, on_first: Optional[Callable[[], None]] = None) -> None:
        self.signal: Optional[int] = None
        self.on_first = on_first

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        first, self.signal = self.signal is None, self.signal or signum
        if first and self.on_first is not None:
            self.on_first()  # a Python-level handler: runs in the main thread between bytecodes
        print(f"[hpcmeg supervisor] got {signal.Signals(signum).name}: Slurm is ending this job; waiting for the "
              f"step to finish its save", flush=True)

    def install(self) -> "_SlurmEnds":
        signal.signal(signal.SIGTERM, self)
        # submitit's USR2 handler would try its own checkpoint/requeue; ranks handle signals here
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return self


def _banner(task: dict) -> None:
    env = os.environ
    job = env.get("SLURM_ARRAY_JOB_ID") and f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}"
    print(f"\n===== hpcmeg {task['stage']}" + (f" task {task['task']}" if "task" in task else "") +
          f" | job {job or env.get('SLURM_JOB_ID', '?')} | restart {env.get('SLURM_RESTART_COUNT', '0')} | "
          f"{socket.gethostname()} | {time.strftime('%Y-%m-%d %H:%M:%S')} =====", flush=True)


def _start_step(run: RunDir, stage: str, args: list[str], env: Optional[dict] = None) -> subprocess.Popen:
    cmd = ["bash", str(run.step_script(stage)), *[str(a) for a in args]]
    print("[hpcmeg supervisor] step:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})})


def _run_step(run: RunDir, stage: str, args: list[str], env: Optional[dict] = None) -> int:
    proc = _start_step(run, stage, args, env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # a SIGINT must not orphan the step
            proc.send_signal(signal.SIGINT)


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def _requeue_self() -> None:
    job = os.environ["SLURM_JOB_ID"]
    r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job} failed (rc {r.returncode}): {r.stderr.strip() or r.stdout.strip()}; "
                           f"is the job submitted with --requeue and does the cluster allow requeues?")


def _requeue_guard(run: RunDir, max_requeues: int):
    # the trainer helper's file-backed policy (restart cap + no-progress loop guard); torch-free module
    from hpcmeg.launch.requeue import RequeueGuard

    return RequeueGuard(str(run.markers / "train.requeue-state.json"), max_restarts=max_requeues, max_no_progress=1)


def _train_env(beat_dir: Path, policy) -> dict:
    """What the train step's ranks get besides the job's environment."""
    env = {ENV_DIR: str(beat_dir), ENV_INTERVAL: str(policy.beat_s)}
    # the trainer's wall-time guard reads the end time from the environment (containers have no scontrol)
    end_time = None if os.environ.get("SLURM_JOB_END_TIME") else slurm_job_end_time(timeout_s=30)
    if end_time:
        env["SLURM_JOB_END_TIME"] = str(int(end_time))
    # NCCL's Flight Recorder (GPU ranks): each rank's last collectives, dumped beside the heartbeats
    # when a collective times out (unless the recipe's cluster.env says otherwise)
    env.update({k: v for k, v in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{beat_dir}/nccl_trace_rank_")) if k not in os.environ})
    return env


def run_train(task: dict) -> dict:
    run = RunDir(Path(task["run_dir"]))
    ckpt = task["checkpoint_dir"]
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    guard = _requeue_guard(run, int(task["max_requeues"]))
    start_it = latest_iteration(ckpt)
    guard.on_start(restart, start_it)
    write_marker(run, "train", "started", start_iteration=start_it, **host_info())
    ends = _SlurmEnds(on_first=lambda: write_marker(
        run, "train", "interrupted", exit_code=None, iteration=latest_iteration(ckpt),
        reason="Slurm ended the job (requeue, preemption, cancel or time limit); written at the signal, "
               "before the step had ended")).install()
    policy = HangPolicy.of(task.get("hang"))
    tag, _ = _tag()
    beat_dir = run.root / "health" / f"{tag}.r{restart}"  # this attempt's heartbeats (hpcmeg/heartbeat.py)
    env = _train_env(beat_dir, policy)
    attempt_start = time.time()
    batch_log = run.logs("train") / f"train.{tag}.batch.log"  # where srun's own lines go (this process's output)
    log_at = batch_log.stat().st_size if batch_log.exists() else 0
    proc = _start_step(run, "train", [], env)
    hang = watch_step(proc, str(beat_dir), int(task.get("world_size") or 1), policy)
    if hang is not None:
        _answer_hang(run, task, hang, proc, guard, restart)
    rc = effective_train_rc(proc.returncode, run.root, attempt_start)
    if rc not in REQUEUE_EXIT_CODES and rc != 0 and ends.signal is None:
        dead = died(_read_from(batch_log, log_at), read_beats(beat_dir))
        if dead:
            _answer_death(run, task, dead, rc, guard, restart)
    end_it = latest_iteration(ckpt)
    print(f"[hpcmeg supervisor] train step exit code {rc}; checkpointed iteration {start_it} -> {end_it}", flush=True)
    if ends.signal is not None:
        write_marker(run, "train", "interrupted", exit_code=rc, iteration=end_it,
                     reason="Slurm ended the job (requeue, preemption, cancel or time limit)")
        sys.exit(128 + ends.signal)  # SystemExit: submitit writes no result; Slurm decides what comes next
    verdict = (False, "not asked")
    if rc in REQUEUE_EXIT_CODES or (rc == 0 and (end_it is None or end_it < int(task["train_iters"]))):
        d = guard.decide(restart, end_it)
        verdict = (d.requeue, d.reason)
    cause = step_cause(run, "train") if rc not in REQUEUE_EXIT_CODES and rc != 0 else None
    out = train_outcome(rc, end_it, int(task["train_iters"]), verdict, cause)
    print(f"[hpcmeg supervisor] decision: {out.action}: {out.reason}", flush=True)
    if out.action == "done":
        write_marker(run, "train", "done", iteration=end_it)
        return {"stage": "train", "iteration": end_it}
    if out.action == "requeue":
        write_marker(run, "train", "requeued", iteration=end_it, reason=out.reason)
        try:
            _requeue_self()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            write_marker(run, "train", "failed", exit_code=rc, iteration=end_it, reason=str(e))
            raise StageFailed(f"train failed: {e}") from None
        sys.exit(0)  # SystemExit: no result pickle, the same job id runs again
    write_marker(run, "train", "failed", exit_code=rc, iteration=end_it, reason=out.reason)
    raise StageFailed(f"train failed: {out.reason}")


def _answer_hang(run: RunDir, task: dict, hang, proc: subprocess.Popen, guard, restart: int) -> None:
    """A hung step (hpcmeg/launch/hang.py): stacks dumped into the rank logs, the step cancelled, then
    routed around (_route_around). Never returns."""
    print(f"[hpcmeg supervisor] {hang.line}", flush=True)
    record_event(run.root, "hang", hang.line, iteration=hang.iteration, nodes=hang.nodes,
                 ranks=[c.rank for c in hang.culprits], job=os.environ["SLURM_JOB_ID"], restart=restart)
    dump_and_cancel(os.environ["SLURM_JOB_ID"], proc)
    _route_around(run, task, hang.line, hang.nodes, proc.returncode, guard, restart)


def _answer_death(run: RunDir, task: dict, culprits, rc: int, guard, restart: int) -> None:
    """A step that failed because rank(s) died of a signal (health.died): named, then routed around."""
    nodes = sorted({c.node for c in culprits})
    line = "; ".join(f"rank {c.rank} on {c.node} {c.why}" for c in culprits[:8])
    print(f"[hpcmeg supervisor] {line}", flush=True)
    record_event(run.root, "dead", line, iteration=culprits[0].iteration, nodes=nodes,
                 ranks=[c.rank for c in culprits], job=os.environ["SLURM_JOB_ID"], restart=restart)
    _route_around(run, task, line, nodes, rc, guard, restart)


def _route_around(run: RunDir, task: dict, line: str, suspects: list[str], rc, guard, restart: int) -> None:
    """Requeue the job without the suspect node(s) when the restart cap and the partition allow
    (hpcmeg/launch/hang.py), else fail with `line`. Never returns: SystemExit (requeued) or StageFailed."""
    job = os.environ["SLURM_JOB_ID"]
    end_it = latest_iteration(task["checkpoint_dir"])
    before = excluded_nodes(run.root)
    nodes, note = before, "no single node to blame"
    if suspects:
        try:
            nodes, note = usable_exclusion(job, suspects, before)
        except RuntimeError as e:
            note = f"not excluding {', '.join(suspects)}: {e}"
    moved = bool(set(suspects) & (set(nodes) - set(before)))  # the next attempt avoids a suspect's node
    d = guard.decide(restart, end_it, elsewhere=moved)
    print(f"[hpcmeg supervisor] {note}; decision: {'requeue' if d.requeue else 'fail'}: {d.reason}", flush=True)
    if not d.requeue:
        reason = f"{line}; not requeued: {d.reason}"
        write_marker(run, "train", "failed", exit_code=rc, iteration=end_it, reason=reason)
        raise StageFailed(f"train failed: {reason}")
    record_event(run.root, "excluded" if moved else "note", note, excluded=nodes, job=job)
    write_marker(run, "train", "requeued", iteration=end_it, reason=f"{line}; {note}; requeue: {d.reason}")
    # the requeue's SIGTERM reaches this shell and its children: ignored (inherited by the scontrol
    # that follows), so the marker stays 'requeued' and the exclusion is set before KillWait ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        requeue_excluding(job, nodes)
    except RuntimeError as e:
        print(f"[hpcmeg supervisor] {e}", flush=True)
        if "exclusion" not in str(e):
            write_marker(run, "train", "failed", iteration=end_it, reason=f"{line}; {e}")
            raise StageFailed(f"train failed: {e}") from None
    sys.exit(0)


def convert_iteration(task: dict) -> Optional[int]:
    """The checkpoint iteration array task ``task['task']`` converts (None: nothing left to do)."""
    ckpt, i, spec = task["checkpoint_dir"], int(task.get("task") or 0), str(task["iterations"]).strip()
    have = committed_iterations(ckpt)
    if spec == "last":
        it = latest_iteration(ckpt)
        if it is None:
            raise RuntimeError(f"convert: no checkpoint in {ckpt} (no latest_checkpointed_iteration.txt)")
        return it
    if spec == "all":
        return have[i] if i < len(have) else None
    want = parse_iteration_list(spec)[i]
    if want not in have:
        raise RuntimeError(f"convert: iteration {want} (convert.iterations) has no committed checkpoint in {ckpt}; "
                           f"available: {have or 'none'}")
    return want


def run_array_task(task: dict) -> dict:
    run = RunDir(Path(task["run_dir"]))
    stage, idx = task["stage"], task.get("task")
    write_marker(run, stage, "started", task=idx, **host_info())
    _SlurmEnds().install()
    args = list(task.get("args", []))
    manifest = None
    if task.get("manifest"):
        m = task["manifest"]  # taken before the step: a file edited meanwhile makes the dataset stale
        manifest = (m["prefix"], input_manifest(m["files"], m["tokenizer"]))
    if stage == "convert":
        try:
            it = convert_iteration(task)
        except RuntimeError as e:
            write_marker(run, stage, "failed", task=idx, reason=str(e))
            raise StageFailed(f"{stage} failed: {e}") from None
        if it is None:
            print(f"[hpcmeg supervisor] convert task {idx}: no checkpoint left to convert", flush=True)
            write_marker(run, stage, "done", task=idx, iteration=None)
            return {"stage": stage, "task": idx, "iteration": None}
        args = [str(it), str(Path(task["out_dir"]) / f"iter_{it:07d}")]
    rc = _run_step(run, stage, args)
    if rc != 0:
        reason = f"{stage} step failed (exit code {rc}): {step_cause(run, stage) or f'no error line in logs/{stage}/'}"
        write_marker(run, stage, "failed", task=idx, exit_code=rc, reason=reason)
        raise StageFailed(reason)
    if manifest:
        write_manifest(*manifest)
    write_marker(run, stage, "done", task=idx, **({"iteration": int(args[0])} if stage == "convert" else {}))
    return {"stage": stage, "task": idx, "args": args}


def host_info() -> dict:
    """This supervisor's interpreter and hpcmeg (stored in the started markers)."""
    from hpcmeg.launch.provenance import fingerprint

    fp = fingerprint()
    return {"node": os.environ.get("SLURMD_NODENAME"), "python": sys.executable,
            "python_version": ".".join(map(str, sys.version_info[:3])), "hpcmeg_version": fp["version"], "hpcmeg_source": fp["source"], "hpcmeg_path": fp["path"]}


def check_version(task: dict) -> None:
    """Step 0 of the module docstring: refuse to run a stage with another hpcmeg than the run's."""
    if not task.get("version_check"):
        return
    from hpcmeg.launch.provenance import RECORD_NAME, mismatch

    run = RunDir(Path(task["run_dir"]))
    why = mismatch(run.root / RECORD_NAME, f"the supervisor's interpreter {sys.executable} on {socket.gethostname()}")
    if why:
        write_marker(run, task["stage"], "failed", task=task.get("task"), reason=why)
        raise StageFailed(f"{task['stage']} failed: {why}")


def run_task(task: dict) -> dict:
    """The submitit entry point of every hpcmeg job (see the module docstring).

    An expected failure (``StageFailed``: marker written, cause known) ends the job with one line and
    exit code 1 through SystemExit, which submitit does not catch: no traceback of submitit's frames in
    the batch log (Slurm still records FAILED, and hpcmeg never reads submitit's result pickles)."""
    _banner(task)
    try:
        check_version(task)
        if task["stage"] == "train":
            return run_train(task)
        return run_array_task(task)
    except StageFailed as e:
        print(f"[hpcmeg supervisor] {e}", flush=True)
        sys.exit(1)
