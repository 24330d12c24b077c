"""hpcmeg/launch/health.py: when a step counts as hung, whom it names, and the health record."""
from __future__ import annotations

from hpcmeg.launch.health import HangPolicy, diagnose, read_health, record_event
from hpcmeg.launch.requeue import decide_requeue

P = HangPolicy(after_steps=10, min_s=30, startup_s=600, checkpoint_s=900, beat_s=1)
T = 10_000.0  # "now"


def beat(rank, phase, it, since, beat=T, step_s=1.0, node=None):
    return {"rank": rank, "node": node or f"node{rank // 2 + 1}", "pid": 100 + rank, "iteration": it,
            "first_iteration": 0, "phase": phase, "since": since, "beat": beat, "step_s": step_s}


def test_a_healthy_step_is_not_a_hang_and_the_allowance_follows_the_phase():
    beats = [beat(0, "forward-backward", 7, T - 20), beat(1, "forward-backward", 7, T - 25)]
    assert diagnose(beats, 2, T, T - 500, P) is None  # 20 s < max(10 x 1 s, 30 s)
    # a slow step raises the allowance: 10 x 5 s = 50 s > 40 s stuck
    slow = [dict(b, step_s=5.0) for b in beats]
    assert diagnose([dict(b, since=T - 40) for b in slow], 2, T, T - 500, P) is None
    assert diagnose([dict(b, since=T - 60) for b in slow], 2, T, T - 500, P) is not None
    # start-up (no iteration finished yet) and checkpoints get their own allowance
    init = [beat(0, "init", 0, T - 500, step_s=None), beat(1, "init", 0, T - 500, step_s=None)]
    assert diagnose(init, 2, T, T - 550, P) is None
    h = diagnose(init, 2, T + 200, T - 550, P)
    assert h is not None and h.phase == "init" and "at start-up" in h.line and h.allowance_s == 600
    ck = [beat(0, "checkpoint", 10, T - 800), beat(1, "checkpoint", 10, T - 800)]
    assert diagnose(ck, 2, T, T - 900, P) is None
    assert diagnose(ck, 2, T + 200, T - 900, P).allowance_s == 900


def test_the_rank_behind_is_named_with_its_node_phase_and_iteration():
    beats = [beat(0, "forward-backward", 8, T - 100), beat(1, "data", 8, T - 101, node="node7"),
             beat(2, "forward-backward", 8, T - 99), beat(3, "forward-backward", 8, T - 100)]
    h = diagnose(beats, 4, T, T - 1000, P)
    assert h is not None and [c.rank for c in h.culprits] == [1] and h.nodes == ["node7"]
    assert h.phase == "data" and h.iteration == 8 and 98 < h.stuck_s < 100
    assert "rank 1 on node7 in data at iteration 8" in h.line and "the others wait in forward-backward" in h.line


def test_in_one_phase_the_rank_still_working_is_named_not_the_ones_waiting_for_it():
    # a save: rank 0 waits in the barrier after its shard write, rank 1 never got there
    ck = [beat(0, "checkpoint", 15, T - 1000, step_s=0.2), beat(1, "checkpoint", 15, T - 1001, step_s=0.2)]
    ck[0]["waiting"] = True
    h = diagnose(ck, 2, T, T - 5000, P)
    assert [c.rank for c in h.culprits] == [1] and (h.phase, h.iteration, h.allowance_s) == ("checkpoint", 15, 900)
    assert "rank 1 on node1 in checkpoint at iteration 15 for 1001 s; the others wait in checkpoint at iteration 15" \
        in h.line, h.line
    # without `waiting` (a writer of an older hpcmeg) nobody is behind: the shared stall is said as such
    assert not diagnose([dict(b, waiting=False) for b in ck], 2, T, T - 5000, P).culprits
    # start-up: rank 0 waits in the process group's rendezvous for rank 1, stuck before it
    init = [beat(0, "init", 0, T - 650, step_s=None), beat(1, "init", 0, T - 700, step_s=None)]
    init[0]["waiting"] = True
    h = diagnose(init, 2, T, T - 700, P)
    assert [c.rank for c in h.culprits] == [1] and h.allowance_s == 600 and h.phase == "init"
    assert h.line.startswith("hang at start-up: no rank advanced for 650 s (allowed 600 s); rank 1 on node1 in "
                             "start-up for 700 s; the others wait in start-up"), h.line
    # every rank waiting (a collective none of them leaves): said as where they all wait
    both = [dict(b, waiting=True) for b in ck]
    assert "every rank is waiting in checkpoint at iteration 15" in diagnose(both, 2, T, T - 5000, P).line
    # a stopped rank's line says it was waiting
    stale = [dict(ck[0], beat=T - 50), ck[1]]
    assert "rank 0 on node1 waiting in checkpoint at iteration 15: no heartbeat for 50 s" in \
        diagnose(stale, 2, T, T - 5000, P).line


def test_a_stopped_or_dead_rank_is_named_by_its_stale_heartbeat_before_position():
    # rank 1 is AHEAD in position but its heartbeat stopped (SIGSTOP): it is the cause, not rank 0
    beats = [beat(0, "sync", 8, T - 60), beat(1, "forward-backward", 9, T - 61, beat=T - 58)]
    h = diagnose(beats, 2, T, T - 1000, P)
    assert [c.rank for c in h.culprits] == [1] and "no heartbeat for 58 s (stopped or dead)" in h.line


def test_a_rank_that_never_reported_is_named_and_a_shared_stall_names_nobody():
    h = diagnose([beat(0, "init", 0, T - 700, step_s=None)], 2, T, T - 700, P)
    assert [c.rank for c in h.culprits] == [1] and "never reported" in h.line
    same = [beat(r, "data", 5, T - 100) for r in range(3)]
    h = diagnose(same, 3, T, T - 1000, P)
    assert h is not None and not h.culprits and h.nodes == []
    assert "every rank is in data at iteration 5: no rank is behind the others" in h.line


def test_the_health_record_keeps_events_and_the_excluded_nodes(tmp_path):
    assert read_health(tmp_path) == {"events": [], "excluded": []}
    record_event(tmp_path, "hang", "hang at iteration 3: ...", iteration=3)
    record_event(tmp_path, "excluded", "excluding node1", excluded=["node1"])
    d = read_health(tmp_path)
    assert [e["kind"] for e in d["events"]] == ["hang", "excluded"] and d["excluded"] == ["node1"]
    assert d["events"][0]["iteration"] == 3
    (tmp_path / "health.json").write_text("{not json")
    assert read_health(tmp_path) == {"events": [], "excluded": []}  # a broken file never stops status


def test_a_requeue_away_from_the_hung_node_does_not_count_as_no_progress():
    kw = dict(restart_count=0, max_restarts=3, start_iteration=5, current_iteration=5, no_progress_streak=0,
              max_no_progress=1)
    assert not decide_requeue(**kw).requeue
    d = decide_requeue(**kw, elsewhere=True)
    assert d.requeue and "without the hung node" in d.reason
    assert not decide_requeue(**dict(kw, restart_count=3), elsewhere=True).requeue  # the cap still holds


def test_a_rank_that_died_of_a_signal_is_named_from_sruns_first_task_line():
    from hpcmeg.launch.health import died

    beats = [beat(0, "sync", 8, T), beat(1, "forward-backward", 8, T, node="node2")]
    # what srun 22.05 printed on the local cluster for a 2-task step whose task 1 got kill -9
    text = ("srun: error: node2: task 1: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=2520.0\n"
            "srun: error: node2: task 0: Terminated\nsrun: Force Terminated StepId=2520.0\n")
    (c,) = died(text, beats)
    assert (c.rank, c.node, c.phase, c.iteration) == (1, "node2", "forward-backward", 8) and "Killed" in c.why
    assert [x.rank for x in died("srun: error: node1: tasks 2-3: Out Of Memory\n", [])] == [2, 3]
    # the first task srun reports exited by itself: its own error line is the cause, nobody died
    assert died("srun: error: node1: task 0: Exited with exit code 1\nsrun: error: node1: task 1: Killed\n", beats) == []
    assert died("", beats) == []
