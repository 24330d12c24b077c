"""Pipeline schedules as pure data: each pipeline rank's ordered list of actions for one step.

No torch import: tests and the runner read the same lists.
API: make_schedule(pp, rank, M, vpp=1) (= no_pipeline | one_f_one_b | interleaved), all_ranks,
schedule_advice (lines for the log), warmup_count, bubble_fraction, chunk_layers, format_actions /
parse_actions. Which micro-batch counts the interleaved schedule can run is Megatron's rule,
hpcmeg.megatron.parallel_dims.validate_schedule (recipe validation applies it too); all_ranks refuses
what it refuses.

Contract
- Stages. A model of L layers is cut into pp * vpp virtual stages; virtual stage s = chunk * pp + rank
  lives on pipeline rank `rank` as its model chunk `chunk` and holds layers
  [s * L / (pp*vpp), (s+1) * L / (pp*vpp)) (Megatron's interleaved chunk->layer map;
  `chunk_layers`). Stage 0 takes the micro batch, stage pp*vpp-1 computes the loss.
- Action(op, stage, mb, chunk, peer): op is one of
    F       forward of micro batch mb through this rank's chunk (= virtual stage `stage`)
    B       backward of it (full backward: input grad and weight grads)
    SEND_F  send stage's forward output of mb to stage+1 (on pipeline rank `peer`)
    RECV_F  receive stage's forward input of mb from stage-1 (on `peer`)
    SEND_B  send the grad of stage's input of mb to stage-1 (on `peer`)
    RECV_B  receive the grad of stage's output of mb from stage+1 (on `peer`)
  str(action) is torch.distributed.pipelining's notation: "0F1", "1B0", "0SEND_F1", "1RECV_F1".
  `peer` is a pipeline rank (index into the PP group), None for F/B.
- Compute order per rank is exactly Megatron's (core/pipeline_parallel/schedules.py at HEAD):
  1F1B: warm-up W = min(pp - rank - 1, M) forwards, then M - W pairs (F, B), then W backwards.
  Interleaved: a table of (mb, chunk) in micro-batch groups of `group` (default pp) per chunk
  (`microbatch_table`; forward k runs table[k], backward k runs table[k] with chunk reversed),
  W = min((pp - rank - 1) * 2 + (vpp - 1) * group, M * vpp), same warm-up / steady / cool-down shape.
- Where the sends and receives go, and why it cannot deadlock. All ranks' compute orders are
  replayed together (a forward costs 1, a backward `b_cost`, default 2 = its FLOPs; a transfer is
  one rendezvous event of its two ranks), always taking the earliest possible event next. That
  yields ONE global sequence of events, and each rank's action list is that sequence restricted
  to the rank. Under blocking rendezvous semantics (a send returns only when the peer has posted
  the matching recv and vice versa: the strictest model, covering gloo and NCCL alike) such
  projections cannot deadlock, whatever the real durations: the earliest unfinished event of the
  global sequence has every earlier event of both its ranks finished, so both ranks wait at it and
  it completes. Ties are broken Megatron's even/odd way: links (link l joins pipeline ranks l and
  l+1 mod pp) with even l first, forward before backward on a link.
  Tensors are received as soon as both ranks are free (a received tensor waits in a buffer of
  [mb, s, h] until its compute: at most 2 per rank in 1F1B, 4 measured for interleaved).
  Activations kept for backward: at most min(W + 1, M * vpp) chunk-micro-batches per rank
  (= pp - rank for 1F1B, Megatron's bound); tests/test_pp_schedule.py checks all of it.
  Replayed at the b_cost it was built for, the makespan is the ideal (M*vpp + pp - 1) * (1 + b_cost)
  (checked for b_cost 1 and 2). Built for 2 and run at B = F or B = 3F, interleaved layouts
  (pp 2-8, vpp 2-4) take up to 30 % / 8 % longer in the same replay, 1F1B nothing: pass the
  measured ratio as b_cost if it is far from 2.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpcmeg.megatron.parallel_dims import validate_schedule

COMPUTE = ("F", "B")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    op: str
    stage: int
    """virtual stage index = chunk * pp + rank (torch's stage_index)"""
    mb: int
    chunk: int
    peer: int | None = None
    """pipeline rank of the other end of a SEND_*/RECV_*; None for F/B"""

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.mb}"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE


def bubble_fraction(pp: int, vpp: int, M: int) -> float:
    """Theoretical pipeline bubble as a share of the step: idle / (compute + idle) of the first stage,
    whose step spans the whole pipeline. With equal stages a rank computes M * vpp chunk forwards and
    backwards and waits (pp - 1) of them (Megatron's bubble, (pp - 1) / (vpp * M) of the compute), so
    the share is (pp - 1) / (vpp * M + pp - 1): 1/2 for PP2 with one micro batch, 0 without PP."""
    return (pp - 1) / (vpp * M + pp - 1)


def chunk_layers(num_layers: int, pp: int, vpp: int, rank: int, chunk: int) -> range:
    """Global layer indices of model chunk `chunk` on pipeline rank `rank` (Megatron's map)."""
    n = pp * vpp
    if num_layers % n:
        raise ValueError(f"{num_layers} layers are not divisible by pipeline {pp} x virtual pipeline {vpp}")
    per, s = num_layers // n, chunk * pp + rank
    return range(s * per, (s + 1) * per)


def microbatch_table(M: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """Megatron's interleaved forward order [(mb, chunk), ...]: `group` micro batches through chunk
    0, the same through chunk 1, ..., then the next group; the last group takes the remainder.
    Megatron's example (PP2, group 3, M 5, V 2): mb 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1."""
    table = []
    for lo in range(0, M, group):
        hi = M if lo + group >= M else lo + group
        table += [(mb, c) for c in range(vpp) for mb in range(lo, hi)]
    return table


def warmup_count(pp: int, rank: int, M: int, vpp: int = 1, group: int | None = None) -> int:
    """Forwards before the first backward-bearing step (Megatron's get_pp_rank_microbatches)."""
    if pp == 1:
        return 0
    if vpp == 1:
        return min(pp - rank - 1, M)
    return min((pp - rank - 1) * 2 + (vpp - 1) * (group or pp), M * vpp)


def schedule_advice(pp: int, vpp: int, M: int) -> list[str]:
    """Non-fatal advice lines for the log (the bubble is large when M is small)."""
    if pp > 1 and M < pp:
        return [f"{M} micro batches per step on {pp} pipeline stages: stages idle much of the step (bubble "
                f"{bubble_fraction(pp, vpp, M):.0%} of the step); use at least {pp}, better {4 * pp} or more"]
    return []


def _compute_order(pp: int, rank: int, M: int, vpp: int, group: int) -> list[tuple[str, int, int]]:
    """This rank's computes [(op, mb, chunk)] in Megatron's order."""
    table = microbatch_table(M, vpp, group) if vpp > 1 else [(mb, 0) for mb in range(M)]
    fwd = [("F", mb, c) for mb, c in table]
    bwd = [("B", mb, vpp - 1 - c) for mb, c in table]
    w = warmup_count(pp, rank, M, vpp, group)
    order = fwd[:w]
    for k in range(len(table) - w):  # steady state: one forward, then one backward
        order += [fwd[w + k], bwd[k]]
    return order + bwd[len(table) - w:]


def _link(src_stage: int, dst_stage: int, pp: int) -> int:
    """Link l joins pipeline ranks l and (l + 1) % pp: the lower stage's rank."""
    return min(src_stage, dst_stage) % pp


def _place_comms(pp: int, vpp: int, orders: list[list[tuple[str, int, int]]],
                 f_cost: float = 1.0, b_cost: float = 2.0) -> list[list[Action]]:
    """Replay all ranks' computes (F takes f_cost, B b_cost) with each transfer a rendezvous of its
    two ranks, always taking the earliest possible event next; the sequence taken, restricted to a
    rank, is its action list (see the header for why that cannot deadlock)."""
    last = pp * vpp - 1
    lists: list[list[Action]] = [[] for _ in range(pp)]
    ptr, clock = [0] * pp, [0.0] * pp
    arrived, done_f = set(), set()  # ("F"|"B", stage, mb) received; (stage, mb) forwarded
    pending = []  # transfers produced, not yet taken: (back, src stage, dst stage, mb)
    while pending or any(ptr[r] < len(orders[r]) for r in range(pp)):
        best = None  # (start, 0 = transfer first on ties, even/odd link phase, link, ...)
        for i, (back, src, dst, mb) in enumerate(pending):
            ln = _link(src, dst, pp)
            key = (max(clock[src % pp], clock[dst % pp]), 0, ln % 2, ln, back, i)
            best = min(best, key) if best else key
        for r in range(pp):
            if ptr[r] < len(orders[r]):
                op, mb, c = orders[r][ptr[r]]
                s = c * pp + r
                ready = ((s == 0 or ("F", s, mb) in arrived) if op == "F"
                         else (s, mb) in done_f and (s == last or ("B", s, mb) in arrived))
                if ready:
                    key = (clock[r], 1, 0, r, 0, -1)
                    best = min(best, key) if best else key
        if best is None:
            raise RuntimeError(f"compute order has a dependency cycle at pipeline {pp} x vpp {vpp}: "
                               + ", ".join(f"rank {r} waits at {orders[r][ptr[r]]}" for r in range(pp)
                                           if ptr[r] < len(orders[r])))
        start, is_compute, _, who, _, i = best
        if is_compute:
            op, mb, c = orders[who][ptr[who]]
            s = c * pp + who
            lists[who].append(Action(op, s, mb, c))
            ptr[who] += 1
            clock[who] = start + (f_cost if op == "F" else b_cost)
            if op == "F":
                done_f.add((s, mb))
            if op == "F" and s < last:
                pending.append((0, s, s + 1, mb))
            elif op == "B" and s > 0:
                pending.append((1, s, s - 1, mb))
        else:
            back, src, dst, mb = pending.pop(i)
            kind = "B" if back else "F"
            lists[src % pp].append(Action(f"SEND_{kind}", src, mb, src // pp, peer=dst % pp))
            lists[dst % pp].append(Action(f"RECV_{kind}", dst, mb, dst // pp, peer=src % pp))
            clock[src % pp] = clock[dst % pp] = start  # both ranks waited for the rendezvous
            arrived.add((kind, dst, mb))
    return lists


def all_ranks(pp: int, M: int, vpp: int = 1, group: int | None = None, b_cost: float = 2.0) -> list[list[Action]]:
    """Every pipeline rank's action list (index = pipeline rank). Raises ValueError on a layout
    that `validate_schedule` refuses. b_cost: backward time / forward time the transfers are
    placed for (correct for any real ratio; only the waiting changes)."""
    problems = validate_schedule(pp, vpp, M, group)
    if problems:
        raise ValueError(problems[0])
    n = group or pp
    return _place_comms(pp, vpp, [_compute_order(pp, r, M, vpp, n) for r in range(pp)], 1.0, b_cost)


def no_pipeline(M: int) -> list[Action]:
    """pp = 1: forward and backward of each micro batch in turn (Megatron's no-pipelining)."""
    return all_ranks(1, M)[0]


def one_f_one_b(pp: int, rank: int, M: int) -> list[Action]:
    """Megatron's non-interleaved 1F1B schedule of pipeline rank `rank`, with transfers."""
    return all_ranks(pp, M)[rank]


def interleaved(pp: int, rank: int, M: int, vpp: int, group: int | None = None,
                b_cost: float = 2.0) -> list[Action]:
    """Megatron's interleaved 1F1B schedule (vpp model chunks on this rank), with transfers."""
    return all_ranks(pp, M, vpp, group, b_cost)[rank]


def make_schedule(pp: int, rank: int, M: int, vpp: int = 1, group: int | None = None) -> list[Action]:
    """The schedule a layout uses: no pipelining at pp 1, 1F1B at vpp 1, interleaved otherwise."""
    return all_ranks(pp, M, vpp, group)[rank]


def format_actions(actions: list[Action]) -> str:
    """One rank's list in torch's notation, space separated (for logs)."""
    return " ".join(map(str, actions))


def parse_actions(text: str, pp: int) -> list[Action]:
    """Inverse of format_actions for tests and hand-written schedules ("0F0 0SEND_F0 ...")."""
    out = []
    for word in text.split():
        i = next(k for k, ch in enumerate(word) if not ch.isdigit())
        j = next(k for k in range(len(word), 0, -1) if not word[k - 1].isdigit())
        stage, op, mb = int(word[:i]), word[i:j], int(word[j:])
        if op not in COMPUTE + COMM:
            raise ValueError(f"unknown action '{word}'")
        peer = None if op in COMPUTE else ((stage + 1) if op in ("SEND_F", "RECV_B") else (stage - 1)) % pp
        out.append(Action(op, stage, mb, stage // pp, peer))
    return out
