"""The rank side of hang detection: the heartbeat file (hpcmeg/heartbeat.py), the trainer's phases in it,
the stack dump on SIGUSR1 and the short collective timeout (ParallelContext.set_timeout).

Real parts only: the heartbeat's writer thread in this process and its files on disk; a 2-rank gloo
`hpcmeg train` (processes forked from tests/preloaded.py's server, as the other multi-rank tests) with
HPCMEG_HEARTBEAT_DIR set, polled while it runs; a SIGUSR1 sent to a running rank; a 2-rank `train`
whose collectives note the process group's timeout as they start; two gloo processes where one stays
away from a collective. (tests/test_heartbeat.py is the test suite's own heartbeat plugin, a different
thing.)
"""
from __future__ import annotations

import ast
import json
import os
import signal
import time

import pytest

from helpers import TINY_RECIPE, TRAIN_BASE, Ranks, free_port, stdlib_dataset
from hpcmeg import heartbeat
from hpcmeg.heartbeat import ENV_DIR, ENV_INTERVAL, PHASES, RECORD_BYTES, Heartbeat, beat_path, read_beats

TRAINING_PHASES = {"data", "forward-backward", "optimizer", "sync"}


def _wait_for(cond, timeout: float, what: str, step: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"{what}: not seen within {timeout} s")


# ----------------------------------------------------------------------------- the file itself

def _record(d, cond=lambda r: True, what: str = "a record", timeout: float = 10):
    """The one rank's record in `d` once `cond` holds for it (a read that meets a write in progress
    finds nothing: the next one does)."""
    return _wait_for(lambda: next((r for r in read_beats(d) if cond(r)), None), timeout, what)


def test_heartbeat_records_phases_and_beats_while_the_main_thread_sleeps(tmp_path):
    d = tmp_path / "hb"  # created by start()
    hb = Heartbeat(d, 3, interval_s=0.05, node="node7").start()
    try:
        rec = _record(d)
        assert os.path.getsize(beat_path(d, 3)) == RECORD_BYTES and open(beat_path(d, 3), "rb").read()[-1:] == b"\n"
        assert (rec["rank"], rec["node"], rec["pid"], rec["phase"], rec["iteration"], rec["step_s"]) == \
            (3, "node7", os.getpid(), "init", 0, None)
        init_since = rec["since"]
        hb.at("init", 40)  # the run resumes from 40: first_iteration follows, init keeps its start
        rec = _record(d, lambda r: r["iteration"] == 40, "init at 40")
        assert (rec["phase"], rec["first_iteration"], rec["since"]) == ("init", 40, init_since)
        before = time.time()
        hb.at("data", 41)
        after = time.time()
        # the main thread sleeps: the writer thread alone moves `beat` on, `since` stays
        time.sleep(0.3)
        rec = _record(d, lambda r: r["beat"] - r["since"] >= 0.25, "a beat 0.25 s into the phase")
        assert (rec["phase"], rec["iteration"], rec["first_iteration"]) == ("data", 41, 40)
        assert before - 0.001 <= rec["since"] <= after + 0.001 and rec["since"] > init_since
        since = rec["since"]
        _record(d, lambda r: r["beat"] > rec["beat"], "a later beat")
        hb.at("data", 41)  # same phase and iteration: since kept
        hb.at("data")  # iteration None: the current one
        for s in (0.4, 0.1, 0.3, 9.0, 0.2, 0.5):  # the last five: 0.1 0.3 9.0 0.2 0.5 -> median 0.3
            hb.iteration_done(s)
        rec = _record(d, lambda r: r["step_s"] is not None, "step_s")
        assert rec["since"] == since and rec["step_s"] == pytest.approx(0.3)
        hb.at("optimizer")
        rec = _record(d, lambda r: r["phase"] == "optimizer", "phase optimizer")
        assert rec["since"] > since and rec["iteration"] == 41
        with pytest.raises(ValueError, match="heartbeat phase 'backward'; use one of init, data"):
            hb.at("backward")
    finally:
        hb.close()
    rec = _record(d)
    assert rec["phase"] == "done"
    time.sleep(0.15)  # the thread is gone: the record no longer changes
    assert _record(d)["beat"] == rec["beat"]
    hb.close()  # twice is fine


def test_a_torn_record_is_skipped_and_a_missing_directory_is_empty(tmp_path):
    assert read_beats(tmp_path / "nowhere") == []

    def rec(rank, beat, step_s):
        return {"rank": rank, "node": "n", "pid": 1, "iteration": 12, "first_iteration": 0, "phase": "sync",
                "since": 1796670400.0, "beat": beat, "step_s": step_s}

    older, newer = heartbeat.encode(rec(0, 1796670400.125, 0.25)), heartbeat.encode(rec(0, 1796670405.13, 0.5))
    # what a reader may catch of an in-place rewrite: the new record's start over the old one's end, cut
    # inside `beat`. It is valid JSON with a beat neither record had; the crc gives it away
    cut = newer.index(b'"beat":') + len('"beat":1796670405')
    torn = newer[:cut] + older[cut:]
    assert json.loads(torn)["beat"] not in (1796670400.125, 1796670405.13)
    open(beat_path(tmp_path, 0), "wb").write(torn)
    open(beat_path(tmp_path, 1), "wb").write(heartbeat.encode(rec(1, 1796670405.0, 0.5)))
    open(beat_path(tmp_path, 2), "wb").write(newer[:100])  # cut short: not JSON
    open(beat_path(tmp_path, 3), "wb").write(b"")  # created, not written yet
    open(tmp_path / "notes.txt", "w").write("not a heartbeat")
    assert [r["rank"] for r in read_beats(tmp_path)] == [1]
    open(beat_path(tmp_path, 0), "wb").write(newer)  # the next beat repairs it
    # the crc is checked and dropped; a record without `waiting` (an older writer's) reads as not waiting
    assert read_beats(tmp_path)[0] == {**rec(0, 1796670405.13, 0.5), "waiting": False}


def test_waiting_for_the_other_ranks_is_recorded_and_moves_since(tmp_path):
    hb = Heartbeat(tmp_path, 0, interval_s=0.02, node="n").start()
    try:
        rec = _record(tmp_path)
        assert (rec["phase"], rec["waiting"]) == ("init", False)
        time.sleep(0.05)
        hb.at("init", waiting=True)  # the process group's rendezvous: a wait, and a change the supervisor sees
        waiting = _record(tmp_path, lambda r: r["waiting"], "waiting in init")
        assert waiting["since"] > rec["since"] and waiting["iteration"] == 0
        hb.at("init", 30, waiting=True)  # in init a new start iteration alone keeps since
        assert _record(tmp_path, lambda r: r["iteration"] == 30, "init at 30")["since"] == waiting["since"]
        hb.at("checkpoint", 31)
        working = _record(tmp_path, lambda r: r["phase"] == "checkpoint", "checkpoint")
        assert not working["waiting"]
        time.sleep(0.05)
        hb.at("checkpoint", waiting=True)  # the save's barrier
        rec = _record(tmp_path, lambda r: r["waiting"], "waiting in checkpoint")
        assert (rec["phase"], rec["iteration"]) == ("checkpoint", 31) and rec["since"] > working["since"]
        hb.at("checkpoint", waiting=True)  # the same: since kept
        hb.at("checkpoint")  # the barrier passed: working again
        assert _record(tmp_path, lambda r: not r["waiting"], "working")["since"] > rec["since"]
    finally:
        hb.close()


def test_from_env_reads_the_supervisors_variables(tmp_path):
    assert Heartbeat.from_env(0, {}) is None
    hb = Heartbeat.from_env(2, {ENV_DIR: str(tmp_path), ENV_INTERVAL: "0.5", "SLURMD_NODENAME": "node3"})
    assert (hb.directory, hb.rank, hb.interval_s, hb.node) == (str(tmp_path), 2, 0.5, "node3")
    assert Heartbeat.from_env(0, {ENV_DIR: str(tmp_path)}).interval_s == 5.0
    with pytest.raises(ValueError, match=f"{ENV_INTERVAL}='soon' is not a positive number of seconds"):
        Heartbeat.from_env(0, {ENV_DIR: str(tmp_path), ENV_INTERVAL: "soon"})


def test_heartbeat_imports_nothing_from_hpcmeg_and_no_torch():
    """Both hpcmeg/train and hpcmeg/launch (which runs where torch may be missing) import it."""
    tree = ast.parse(open(heartbeat.__file__, encoding="utf-8").read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert [m for m in names if m.split(".")[0] in ("hpcmeg", "torch", "numpy", "") or m == "."] == []


# ----------------------------------------------------------------------------- a real 2-rank run

@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    """`hpcmeg train` on 2 gloo ranks (8 iterations, eval and save at 4 and 8) with a heartbeat every
    0.05 s, polled while it runs; once a rank is seen training, SIGUSR1 goes to rank 1 (the
    supervisor's stack dump). Returns (heartbeat dir, run dir, phases seen, ranks, exit code, stderr)."""
    out = tmp_path_factory.mktemp("hb")
    prefix = stdlib_dataset(out / "data")
    hb_dir = out / "heartbeat"
    sets = [f"run.output_root={out}", "run.name=watched", f"data.data_path=[{prefix}]", *TRAIN_BASE]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd(), **{ENV_DIR: str(hb_dir), ENV_INTERVAL: "0.05"})
    ranks = Ranks(2, ["train", TINY_RECIPE] + [x for s in sets for x in ("--set", s)], env)
    seen: set[tuple[int, str]] = set()
    signalled = False
    deadline = time.monotonic() + 600
    while ranks.poll() is None and time.monotonic() < deadline:
        for rec in read_beats(hb_dir):
            seen.add((rec["rank"], rec["phase"]))
            if not signalled and rec["phase"] in TRAINING_PHASES:
                ranks.procs[1].send_signal(signal.SIGUSR1)
                signalled = True
        time.sleep(0.01)
    pids = [p.pid for p in ranks.procs]
    _, err = ranks.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return hb_dir, out / "watched", seen, signalled, pids, ranks.returncode(), err


def test_a_training_run_reports_its_phases_and_ends_done(watched_run):
    hb_dir, rd, seen, _, pids, code, err = watched_run
    assert code == 0, err[-3000:]
    assert {phase for _, phase in seen} & TRAINING_PHASES, seen
    assert ({phase for _, phase in seen} - set(PHASES)) == set()
    beats = read_beats(hb_dir)
    assert [b["rank"] for b in beats] == [0, 1]
    for b, pid in zip(beats, pids):
        assert (b["phase"], b["iteration"], b["first_iteration"], b["pid"]) == ("done", 8, 0, pid), b
        assert b["step_s"] is not None and b["step_s"] > 0, b
        assert b["node"] and b["beat"] >= b["since"]
    # the trainer shortened the collective timeout after 3 iterations: for 0.1 s steps the floor, twice
    # the supervisor's cluster.hang_min_s (300 s by default)
    events = [json.loads(line) for line in open(rd / "metrics.jsonl")]
    (ev,) = [e for e in events if e.get("what") == "collective_timeout"]
    assert (ev["iteration"], ev["seconds"]) == (3, 600) and 0 < ev["median_step_s"] < 30


def test_sigusr1_dumps_every_threads_stack_and_the_run_goes_on(watched_run):
    _, _, _, signalled, _, code, err = watched_run
    assert signalled
    assert code == 0, err[-3000:]
    assert "most recent call first" in err and ("Thread 0x" in err or "Current thread 0x" in err), err[-3000:]
    assert "hpcmeg/heartbeat.py" in err and " in _beat" in err  # every thread: the heartbeat's writer too
    assert "hpcmeg/train/entry.py" in err  # and the main thread, inside the run


# ----------------------------------------------------------------------------- the collective timeout

def _probed_rank(rank: int, port: int, out: str, prefix: str, results) -> None:
    """One rank of a 2-rank `train` (8 iterations, eval and save at 4 and 8) whose collectives note the
    default group's timeout as they start: the step's agreement all-reduce, the save's barrier, the
    evaluation's loss (each wrapped on this run's own objects; what they do is unchanged)."""
    import traceback

    import torch
    import torch.distributed as dist

    from hpcmeg.recipe import load_recipe
    from hpcmeg.train.entry import train

    seen = []
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.update(env)
        recipe = load_recipe(TINY_RECIPE, [f"run.output_root={out}", "run.name=probed", f"data.data_path=[{prefix}]",
                                           *TRAIN_BASE])

        def timeout_s() -> float:
            return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()

        def noting(what, fn):
            def wrapped(*a, **kw):
                seen.append((what, trainer_state[0].state.iteration, timeout_s()))
                return fn(*a, **kw)
            return wrapped

        trainer_state = []

        def on_built(trainer):
            trainer_state.append(trainer)
            ctx = trainer.ctx
            ctx.all_reduce_max_ = noting("step", ctx.all_reduce_max_)
            ctx.barrier = noting("save", ctx.barrier)
            trainer.step.eval_loss = noting("eval", trainer.step.eval_loss)

        code = train(recipe, environ=env, on_built=on_built)
        results.put((rank, code, seen))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, traceback.format_exc(), seen))
    results.close()
    results.join_thread()


def test_the_trainer_shortens_the_collective_timeout_after_three_steps_and_lengthens_it_to_save_and_evaluate(tmp_path):
    from preloaded import context

    prefix = stdlib_dataset(tmp_path / "data")
    mp = context()
    results = mp.Queue()
    port = free_port()
    procs = [mp.Process(target=_probed_rank, args=(r, port, str(tmp_path), prefix, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict((r, (code, seen)) for r, code, seen in (results.get(timeout=300) for _ in range(2)))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        code, seen = got[rank]
        assert code == 0, code
        # (what, trainer.state.iteration when it started, timeout in seconds): the counter has moved to
        # N when iteration N's agreement all-reduce starts, and is N at the save and eval after it
        steps = {it: t for what, it, t in seen if what == "step"}
        # 1800 s: the process group's start; then twice the recipe's cluster.hang_min_s (300 s) for
        # 0.1 s steps, and twice cluster.hang_checkpoint_s (1800 s) while saving and evaluating
        assert steps == {1: 1800, 2: 1800, 3: 1800, 4: 600, 5: 600, 6: 600, 7: 600, 8: 600}, seen
        assert {t for what, _, t in seen if what in ("save", "eval")} == {3600}, seen
        assert sorted({it for what, it, _ in seen if what in ("save", "eval")}) == [4, 8], seen


def _stay_away_rank(rank: int, port: int, results) -> None:
    """A gloo rank of a 2-process world. Both meet in one all-reduce and shorten the timeout to 2 s
    (after meeting: on a loaded box one rank may reach the first collective seconds after the other);
    then rank 1 stays away and rank 0 reports how long its next all-reduce waited, and why it ended.
    An unexpected error on either rank is reported instead (the test would otherwise wait in vain)."""
    import traceback

    try:
        import torch
        import torch.distributed as dist

        from hpcmeg.megatron.parallel_dims import ParallelDims
        from hpcmeg.parallel.context import context_for

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        ctx = context_for(ParallelDims(2), rank, rank, torch.device("cpu"))
        assert ctx.all_reduce_max(rank + 5) == 6
        ctx.set_timeout(2)
        if rank == 1:
            time.sleep(120)  # stopped, as far as rank 0 can tell (the test kills it sooner)
            os._exit(0)
        t0 = time.monotonic()
        try:
            ctx.all_reduce_max(1)
            results.put(("returned", time.monotonic() - t0))
        except RuntimeError as e:
            results.put((str(e).splitlines()[0][:300], time.monotonic() - t0))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((f"rank {rank} failed: {traceback.format_exc()}", None))
    results.close()
    results.join_thread()  # the queue's feeder thread writes the result out before the process ends
    os._exit(0)  # no destroy_process_group: it could wait for the peer that stays away


def test_set_timeout_makes_a_collective_with_a_missing_peer_fail_fast():
    """Without set_timeout the all-reduce would wait out the group's 30 minutes (init_distributed)."""
    from preloaded import context

    mp = context()
    results = mp.Queue()
    port = free_port()
    procs = [mp.Process(target=_stay_away_rank, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        what, waited = results.get(timeout=180)  # generous: start-up on a loaded 2-core box
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    assert waited is not None and what != "returned", what
    assert 1.5 <= waited < 10, (what, waited)
    assert "timed out" in what.lower() or "timeout" in what.lower(), what
