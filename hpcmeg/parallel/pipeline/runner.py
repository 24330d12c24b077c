"""Execute one pipeline rank's action list (schedule.py) for one optimizer step, generic over the model.

Contract
- `run_schedule(actions, chunks, micro_batches, loss_fn, p2p, *, first_input=None,
  after_backward=None, on_action=None) -> Tensor | None`
  - actions: this rank's list from schedule.py (make_schedule / one_f_one_b / interleaved /
    no_pipeline), executed strictly in order; sends and receives are blocking (p2p.py).
  - chunks[v]: this rank's model chunk v = virtual stage v * pp + rank, an nn.Module mapping its
    input to its output. Virtual stage 0 (rank 0, chunk 0) gets `first_input(micro_batches[mb])`
    (default: the micro batch itself, e.g. a tokens tensor); every other stage gets the received
    activation [mb, s, h] (a leaf with requires_grad, so its grad can be sent upstream).
  - The last virtual stage (rank pp-1, chunk vpp-1) passes its output to
    `loss_fn(output, micro_batches[mb]) -> scalar`; the scalar is what is backpropagated, so
    loss normalisation (1 / global token count) and loss scaling belong to loss_fn.
  - Forward keeps (input leaf, output) per (chunk, mb) until its backward; backward calls
    torch.autograd.backward(output, grad received from downstream) (the loss: no grad) and queues
    the input's grad for SEND_B. Parameter grads accumulate in .grad (or the caller's hooks) in
    the schedule's backward order, which per chunk is micro batch 0, 1, ..., M-1, the same order
    as a loop over micro batches on one process.
  - after_backward(chunk, mb): called after each backward, e.g. for a gradient buffer that counts
    micro batches per parameter (its last call for a chunk has mb == M - 1).
  - on_action(action, "start" | "end"): around every action, for timing (StepTimer) or logs.
  - Returns the sum over micro batches (in micro-batch order) of the detached losses on the rank
    holding the last virtual stage, None elsewhere. No host sync.
  - p2p may be None when no action transfers anything (pp = 1).
  - Raises RuntimeError if the list leaves tensors unsent/unused (a malformed schedule).
- `StepTimer(device)`: an on_action hook; `.result()` after the step gives step and compute
  seconds and the measured bubble (step - compute) / step: the share of this rank's schedule (first
  action's start to last action's end) spent outside its forwards and backwards, i.e. waiting in
  blocking sends/receives (plus the transfers themselves). The F/B intervals are disjoint parts of
  that span, so it lies in [0, 1]; on the first stage the span is the whole pipeline's, which is what
  schedule.bubble_fraction(pp, vpp, M) describes. CUDA events on GPU (read after the step: one event
  sync), perf_counter on CPU.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from hpcmeg.parallel.pipeline.schedule import Action


def run_schedule(actions: Sequence[Action], chunks: Sequence[nn.Module], micro_batches: Sequence[Any],
                 loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], p2p=None, *,
                 first_input: Callable[[Any], Any] | None = None,
                 after_backward: Callable[[int, int], None] | None = None,
                 on_action: Callable[[Action, str], None] | None = None) -> torch.Tensor | None:
    pp = p2p.pp_size if p2p is not None else 1
    last = pp * len(chunks) - 1
    received: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F"|"B", chunk, mb) -> input | output grad
    outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F"|"B", chunk, mb) -> output | input grad
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}  # (chunk, mb) -> input leaf (None on stage 0)
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> output (the loss on the last stage)
    loss_sum = None
    for a in actions:
        if on_action is not None:
            on_action(a, "start")
        key = (a.chunk, a.mb)
        if a.op == "F":
            if a.stage == 0:
                mb = micro_batches[a.mb]
                x, inputs[key] = (first_input(mb) if first_input is not None else mb), None
            else:
                x = inputs[key] = received.pop(("F", *key)).requires_grad_()
            y = chunks[a.chunk](x)
            if a.stage == last:
                y = loss_fn(y, micro_batches[a.mb])
                loss_sum = y.detach() if loss_sum is None else loss_sum + y.detach()
            else:
                outbox[("F", *key)] = y.detach()
            outputs[key] = y
        elif a.op == "B":
            y = outputs.pop(key)
            torch.autograd.backward(y, None if a.stage == last else received.pop(("B", *key)))
            x = inputs.pop(key)
            if a.stage > 0:
                if x.grad is None:
                    raise RuntimeError(f"{a}: chunk {a.chunk}'s output does not depend on its input")
                outbox[("B", *key)] = x.grad
            del x, y  # the graph of this micro batch is freed here
            if after_backward is not None:
                after_backward(a.chunk, a.mb)
        elif a.op in ("SEND_F", "SEND_B"):
            p2p.send(outbox.pop((a.op[-1], *key)), a.peer)
        elif a.op in ("RECV_F", "RECV_B"):
            received[(a.op[-1], *key)] = p2p.recv(a.peer)
        else:
            raise ValueError(f"unknown pipeline action {a}")
        if on_action is not None:
            on_action(a, "end")
    if received or outbox or outputs:
        left = sorted(map(str, list(received) + list(outbox) + list(outputs)))
        raise RuntimeError(f"pipeline schedule left tensors unused: {', '.join(left)}")
    return loss_sum


@dataclass
class StepTiming:
    step_s: float
    compute_s: float
    forward_s: float
    backward_s: float

    @property
    def bubble(self) -> float:
        """Measured idle share of the step, (step - compute) / step in [0, 1]: compare with
        schedule.bubble_fraction(pp, vpp, M). Clamped only against the rounding of event times
        (compute is a sum of disjoint sub-intervals of the step)."""
        if self.step_s <= 0:
            return float("nan")
        return min(1.0, max(0.0, (self.step_s - self.compute_s) / self.step_s))


class StepTimer:
    """on_action hook timing one step on this rank. The wait inside blocking receives and sends is
    what the pipeline bubble is made of, so step - compute = idle time (+ transfer time)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str, str, Any]] = []  # (op, "start"|"end", event or seconds)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def __call__(self, action: Action, when: str) -> None:
        self._marks.append((action.op, when, self._now()))

    def result(self) -> StepTiming:
        if not self._marks:
            return StepTiming(0.0, 0.0, 0.0, 0.0)
        if self.cuda:
            self._marks[-1][2].synchronize()
            span = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731 - ms -> s
        else:
            span = lambda a, b: b - a  # noqa: E731
        f = b = 0.0
        for (op, when, t0), (_, _, t1) in zip(self._marks, self._marks[1:]):
            if when == "start" and op in ("F", "B"):  # the next mark is this action's end
                if op == "F":
                    f += span(t0, t1)
                else:
                    b += span(t0, t1)
        step = span(self._marks[0][2], self._marks[-1][2])
        self._marks = []  # ready for the next step
        return StepTiming(step, f + b, f, b)
