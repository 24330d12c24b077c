"""Pipeline schedule generators (hpcmeg/parallel/pipeline/schedule.py), without processes.

`simulate` below is written independently of the generator: it executes every rank's action list
with blocking rendezvous send/recv (a send and its recv complete together, only when both ranks
are at them; the strictest model, covering gloo and NCCL), checks each compute's data is there
(received, or produced on the rank), and raises Deadlock when no rank can move.
"""
from __future__ import annotations

import pytest

from hpcmeg.megatron.parallel_dims import validate_schedule
from hpcmeg.parallel.pipeline.schedule import (all_ranks, bubble_fraction, chunk_layers, format_actions,
                                               interleaved, microbatch_table, no_pipeline, one_f_one_b,
                                               parse_actions, warmup_count)


class Deadlock(AssertionError):
    pass


MATCH = {"SEND_F": ("RECV_F", 1), "RECV_F": ("SEND_F", -1), "SEND_B": ("RECV_B", -1), "RECV_B": ("SEND_B", 1)}


def simulate(lists, pp, vpp, f_time=1.0, b_time=1.0):
    """Run all ranks; return (global event order [(rank, action)], makespan with F/B durations)."""
    last = pp * vpp - 1
    ptr, clock = [0] * pp, [0.0] * pp
    have = [set() for _ in range(pp)]  # ("in"|"grad"|"out"|"ingrad", stage, mb) present on a rank
    order = []
    while any(ptr[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            if ptr[r] == len(lists[r]):
                continue
            a = lists[r][ptr[r]]
            assert a.stage % pp == r and a.chunk == a.stage // pp, f"rank {r} runs {a} of another rank"
            h = have[r]
            if a.op == "F":
                assert a.stage == 0 or ("in", a.stage, a.mb) in h, f"rank {r}: {a} before its input arrived"
                h.add(("out", a.stage, a.mb))
                clock[r] += f_time
            elif a.op == "B":
                assert ("out", a.stage, a.mb) in h, f"rank {r}: {a} before its forward"
                assert a.stage == last or ("grad", a.stage, a.mb) in h, f"rank {r}: {a} before its grad arrived"
                h.add(("ingrad", a.stage, a.mb))
                clock[r] += b_time
            else:
                p = a.peer
                b = lists[p][ptr[p]] if ptr[p] < len(lists[p]) else None
                want, step = MATCH[a.op]
                if not (b and b.op == want and b.stage == a.stage + step and b.mb == a.mb and b.peer == r):
                    continue  # blocked until the peer reaches the matching call
                send, recv, sr, rr = (a, b, r, p) if a.op.startswith("SEND") else (b, a, p, r)
                produced = ("out" if send.op == "SEND_F" else "ingrad", send.stage, send.mb)
                assert produced in have[sr], f"rank {sr}: {send} sends what it has not computed"
                have[rr].add(("in" if recv.op == "RECV_F" else "grad", recv.stage, recv.mb))
                clock[r] = clock[p] = max(clock[r], clock[p])
                ptr[p] += 1
                order.append((p, b))
            order.append((r, a))
            ptr[r] += 1
            moved = True
        if not moved:
            raise Deadlock("deadlock: " + "; ".join(f"rank {r} at {lists[r][ptr[r]]}" for r in range(pp)
                                                    if ptr[r] < len(lists[r])))
    return order, max(clock)


def layouts():
    """(pp, vpp, M): the acceptance grid, plus every M the validator accepts up to 3pp, plus pp 3."""
    out = []
    for pp in (2, 3, 4):
        for vpp in (1, 2, 3):
            for M in range(1, 3 * pp + 1):
                if not validate_schedule(pp, vpp, M):
                    out.append((pp, vpp, M))
    return out


@pytest.mark.parametrize("pp,vpp,M", layouts())
def test_schedule_properties_and_deadlock_freedom(pp, vpp, M):
    lists = all_ranks(pp, M, vpp)
    order, _ = simulate(lists, pp, vpp)  # raises on a deadlock or a missing input
    pos = {(a.op, a.stage, a.mb): i for i, (_, a) in enumerate(order)}
    for r, acts in enumerate(lists):
        comp = [(a.op, a.mb, a.chunk) for a in acts if a.is_compute]
        want = {(op, mb, c) for op in "FB" for mb in range(M) for c in range(vpp)}
        assert sorted(comp) == sorted(want), f"rank {r}: each (F|B, mb, chunk) exactly once"
        local = {x: i for i, x in enumerate(comp)}
        assert all(local[("B", mb, c)] > local[("F", mb, c)] for _, mb, c in want)
        # no transfer or compute twice (a stray send would block its rank forever)
        assert len(acts) == len(set(map(str, acts))), f"rank {r}: an action repeats"
    n = pp * vpp
    for s in range(1, n):
        for mb in range(M):
            assert pos[("F", s, mb)] > pos[("F", s - 1, mb)]  # through RECV_F
            assert pos[("B", s - 1, mb)] > pos[("B", s, mb)]  # backward in reverse stage order
            assert pos[("RECV_F", s, mb)] < pos[("F", s, mb)] and pos[("RECV_B", s - 1, mb)] < pos[("B", s - 1, mb)]


@pytest.mark.parametrize("pp,vpp,M", layouts())
def test_warmup_counts_are_megatrons(pp, vpp, M):
    for r, acts in enumerate(all_ranks(pp, M, vpp)):
        comp = [a.op for a in acts if a.is_compute]
        total = M * vpp
        # Megatron, schedules.py get_pp_rank_microbatches / forward_backward_pipelining_without_interleaving
        w = min(pp - r - 1, M) if vpp == 1 else min((pp - r - 1) * 2 + (vpp - 1) * pp, total)
        assert warmup_count(pp, r, M, vpp) == w
        assert comp == ["F"] * w + ["F", "B"] * (total - w) + ["B"] * w


@pytest.mark.parametrize("pp,vpp,M", layouts())
def test_activations_alive_are_bounded_as_in_1f1b(pp, vpp, M):
    for r, acts in enumerate(all_ranks(pp, M, vpp)):
        alive = peak = buffered = peak_buf = 0
        for a in acts:
            alive += (a.op == "F") - (a.op == "B")
            used = (a.op == "F" and a.stage > 0) or (a.op == "B" and a.stage < pp * vpp - 1)  # consumes a recv
            buffered += a.op.startswith("RECV") - used
            peak, peak_buf = max(peak, alive), max(peak_buf, buffered)
        bound = min(pp - r, M) if vpp == 1 else min(warmup_count(pp, r, M, vpp) + 1, M * vpp)
        assert peak == bound
        assert peak_buf <= (2 if vpp == 1 else 4), f"rank {r}: {peak_buf} received tensors waiting at once"


@pytest.mark.parametrize("pp,vpp,M,b", [(2, 1, 5, 1.0), (4, 1, 8, 2.0), (4, 2, 8, 1.0), (4, 2, 8, 2.0),
                                        (2, 3, 6, 2.0), (4, 3, 12, 1.0)])
def test_replayed_makespan_is_the_ideal_pipeline(pp, vpp, M, b):
    """Replayed at the durations it was built for, the schedule has exactly Megatron's bubble,
    (pp-1)/(vpp*M) of the compute, which is (pp-1)/(vpp*M + pp-1) of the step (bubble_fraction)."""
    _, t = simulate(all_ranks(pp, M, vpp, b_cost=b), pp, vpp, 1.0, b)
    compute = M * vpp * (1 + b)  # per rank, in forward-chunk units
    assert (t - compute) / compute == pytest.approx((pp - 1) / (vpp * M))
    assert (t - compute) / t == pytest.approx(bubble_fraction(pp, vpp, M))


def test_megatron_table_example_and_group_option():
    # schedules.py's own example: PP2 N3 M5 VP2
    assert [mb for mb, _ in microbatch_table(5, 2, 3)] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in microbatch_table(5, 2, 3)] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    lists = [interleaved(2, r, 5, 2, group=3) for r in range(2)]
    simulate(lists, 2, 2)
    assert [a.op for a in lists[0] if a.is_compute][:warmup_count(2, 0, 5, 2, 3)] == ["F"] * 5  # 2 + 1*3


def test_schedule_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, hpcmeg.parallel.pipeline.schedule; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0  # recipe.validate may import it


def test_no_pipeline_and_notation():
    assert format_actions(no_pipeline(2)) == "0F0 0B0 0F1 0B1"
    text = format_actions(one_f_one_b(2, 1, 2))
    assert text.split()[:2] == ["1RECV_F0", "1F0"]
    assert parse_actions(text, 2) == one_f_one_b(2, 1, 2)
    assert str(interleaved(2, 1, 2, 2)[-1]) == "1SEND_B1"  # rank 1's chunk 0 = virtual stage 1


def test_chunk_layers_are_megatrons_interleaved_map():
    # 8 layers, pp 2, vpp 2: rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7
    assert [list(chunk_layers(8, 2, 2, r, c)) for r in range(2) for c in range(2)] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    with pytest.raises(ValueError, match="not divisible"):
        chunk_layers(6, 2, 2, 0, 0)


def test_validation_lines_name_the_valid_counts():
    assert validate_schedule(4, 1, 1) == [] and validate_schedule(4, 2, 8) == []
    (line,) = validate_schedule(4, 2, 6)
    assert "6 micro batches" in line and "use 4 or 8" in line
    (line,) = validate_schedule(2, 2, 7, group=3)  # 7 % 3 = 1 < pp 2
    assert "use 6 or 8" in line and not validate_schedule(2, 2, 8, group=3)
    assert validate_schedule(1, 2, 4) and validate_schedule(2, 1, 0)
    with pytest.raises(ValueError, match="multiple of pipeline 4"):
        interleaved(4, 0, 6, 2)


def _sends_first(acts):
    """Reorder each run of consecutive transfers so that its sends come before its recvs."""
    out, run = [], []
    for a in acts + [None]:
        if a is not None and not a.is_compute:
            run.append(a)
            continue
        out += [x for x in run if x.op.startswith("SEND")] + [x for x in run if x.op.startswith("RECV")]
        run = []
        if a is not None:
            out.append(a)
    return out


def test_simulator_reports_a_deadlock_when_both_neighbours_send_first():
    lists = all_ranks(2, 4)
    simulate(lists, 2, 1)
    with pytest.raises(Deadlock, match="rank 0 at 0SEND_F"):
        simulate([_sends_first(x) for x in lists], 2, 1)
    with pytest.raises(AssertionError, match="before its input arrived"):  # a compute moved before its recv
        simulate([lists[0], [lists[1][1], lists[1][0]] + lists[1][2:]], 2, 1)
