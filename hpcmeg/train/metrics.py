"""Training metrics: the log line, the JSONL file, TensorBoard events, throughput and MFU.

Contract
- `Throughput(flops_per_token, tokens_per_iteration, world_size, peak_flops)` turns (iterations,
  seconds) into tokens/s per GPU (all tokens of the global batch / world size / second), TFLOP/s
  per GPU (tokens/s/GPU x flops_per_token, the 6N + 12 L d T convention of hpcmeg/model/flops.py)
  and MFU (TFLOP/s over `peak_flops`; None -> "n/a", as on CPU).
- `MetricsLogger(run_dir, enabled)`: only the enabled logger (global rank 0) prints or writes.
  `<run_dir>/metrics.jsonl` is appended to (restarts never overwrite it; a resumed run may re-log
  iterations after the last checkpoint, readers keep the last record per iteration); each record
  is one JSON object with "kind": "start" | "train" | "eval" | "event", flushed per line.
  TensorBoard events go to `<run_dir>/tensorboard/` when torch.utils.tensorboard imports.
- Each train line/record also carries elapsed_s (since this process started) and eta_s (iterations
  left x wall time per iteration since this process's first logged line), so a console shows how
  long the run has left; per-process numbers are labelled per GPU, or per rank on CPU (``per=``).
- The loss is the mean over the log interval's iterations; a shorter window (the first after a
  resume between two log points, or the run's last) carries loss_note, e.g. 'avg of 3 iterations
  since resume', printed after the loss.
- Units: times in seconds (step_time_s), memory in GiB (peak_mem_gib: CUDA max allocated; on
  CPU the process's max RSS), lr plain, tokens/s and TFLOP/s per GPU.
- `peak_flops_for(device)`: measured dense bf16 matmul FLOP/s on CUDA (hpcmeg.model.flops), None
  on CPU; HPCMEG_PEAK_TFLOPS overrides (e.g. to report against a datasheet number).
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch


def peak_flops_for(device: torch.device, environ=None) -> float | None:
    env = os.environ if environ is None else environ
    if env.get("HPCMEG_PEAK_TFLOPS"):
        return float(env["HPCMEG_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    from hpcmeg.model.flops import measure_bf16_peak

    return measure_bf16_peak(device)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # Linux reports ru_maxrss in KiB (macOS in bytes)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


@dataclass
class Throughput:
    flops_per_token: float
    tokens_per_iteration: int
    """Tokens of one global batch (global_batch_size x seq_length), all ranks together."""
    world_size: int
    peak_flops: float | None = None

    def compute(self, iterations: int, seconds: float) -> dict[str, float | None]:
        if iterations <= 0 or seconds <= 0:
            return {"step_time_s": None, "tokens_per_s_per_gpu": None, "tflops_per_gpu": None, "mfu": None}
        tps = self.tokens_per_iteration * iterations / seconds / self.world_size
        flops = tps * self.flops_per_token
        return {"step_time_s": seconds / iterations, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": flops / 1e12,
                "mfu": flops / self.peak_flops if self.peak_flops else None}


def _fmt(v: Any, spec: str, none: str = "n/a") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v) and spec == "pct"):
        return none
    if spec == "pct":
        return f"{100 * v:.1f}%"
    return format(v, spec)


def duration(seconds: float | None) -> str:
    """Seconds -> '45s', '12m05s', '3h07m' (None -> 'n/a')."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_train_line(record: dict, train_iters: int, per: str = "gpu") -> str:
    """One Megatron-like metrics line (rank 0's stdout); ``per`` names the unit of the per-process
    numbers: 'gpu', or 'rank' for CPU processes. Elapsed/ETA appear when the record has them."""
    w = len(str(train_iters))
    parts = [
        f"iteration {record['iteration']:>{w}}/{train_iters}",
        f"consumed samples {record['consumed_samples']}",
        f"loss {_fmt(record['loss'], '.4f')}" + (f" ({record['loss_note']})" if record.get("loss_note") else ""),
        f"lr {_fmt(record['lr'], '.3e')}",
        f"grad norm {_fmt(record['grad_norm'], '.3f')}",
    ]
    if record.get("loss_scale") is not None:
        parts.append(f"loss scale {record['loss_scale']:.0f}")
    if record.get("skipped"):
        parts.append(f"skipped {record['skipped']}")
    parts += [
        f"step {_fmt(None if record['step_time_s'] is None else 1e3 * record['step_time_s'], '.1f')} ms",
        f"tokens/s/{per} {_fmt(record['tokens_per_s_per_gpu'], ',.0f')}",
        f"TFLOP/s/{per} {_fmt(record['tflops_per_gpu'], '.2f')}",
        f"MFU {_fmt(record['mfu'], 'pct')}",
        f"peak mem {_fmt(record['peak_mem_gib'], '.2f')} GiB",
    ]
    if record.get("pipeline_bubble") is not None:  # measured idle / step beside (pp - 1) / (vpp * M + pp - 1)
        parts.append(f"bubble {_fmt(record['pipeline_bubble'], 'pct')} (ideal {_fmt(record['pipeline_bubble_ideal'], 'pct')})")
    if "elapsed_s" in record:
        parts.append(f"elapsed {duration(record['elapsed_s'])}")
    if "eta_s" in record:
        parts.append(f"ETA {duration(record['eta_s'])}")
    return " | ".join(parts)


def format_eval_line(record: dict) -> str:
    return (f"validation at iteration {record['iteration']} | val loss {record['val_loss']:.4f} | "
            f"val ppl {_fmt(record['val_ppl'], '.2f')} | {record['eval_time_s']:.1f} s")


class MetricsLogger:
    """Rank-0 sink for metric records: stdout line, JSONL file, TensorBoard scalars."""

    def __init__(self, run_dir: str, enabled: bool, train_iters: int, tensorboard: bool = True,
                 stream: TextIO | None = None, per: str = "gpu"):
        self.enabled, self.train_iters, self.per = enabled, train_iters, per
        # elapsed: since this process built its logger (start-up included); ETA: iterations left x the
        # wall time per iteration since this process's first logged line (evals and saves included,
        # start-up and compilation not); the first line uses its own step time
        self.t_start = time.time()
        self._first: tuple[int, float] | None = None
        self.stream = stream if stream is not None else sys.stdout
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a killed run keeps its lines
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
            except ImportError:  # tensorboard not installed: JSONL only
                self._tb = None

    def print(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=self.stream, flush=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"kind": record.get("kind", "event"), "time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def timing(self, iteration: int, step_time_s: float | None, now: float | None = None) -> dict[str, float | None]:
        """{"elapsed_s", "eta_s"} for a train record at ``iteration`` (see __init__ for the rule)."""
        now = time.time() if now is None else now
        left = max(0, self.train_iters - iteration)
        if self._first is None:
            self._first = (iteration, now)
            eta = None if step_time_s is None else left * step_time_s
        elif iteration > self._first[0]:
            eta = left * (now - self._first[1]) / (iteration - self._first[0])
        else:
            eta = None if step_time_s is None else left * step_time_s
        return {"elapsed_s": round(now - self.t_start, 3), "eta_s": None if eta is None else round(eta, 3)}

    def train(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {**record, **self.timing(record["iteration"], record.get("step_time_s"))}
        self.write({"kind": "train", **record})
        self.print(format_train_line(record, self.train_iters, self.per))
        if self._tb is not None:
            it = record["iteration"]
            for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                             ("loss_scale", "train/loss_scale"), ("tokens_per_s_per_gpu", "perf/tokens_per_s_per_gpu"),
                             ("tflops_per_gpu", "perf/tflops_per_gpu"), ("mfu", "perf/mfu"),
                             ("peak_mem_gib", "perf/peak_mem_gib")):
                if record.get(key) is not None:
                    self._tb.add_scalar(tag, record[key], it)

    def eval(self, record: dict) -> None:
        if not self.enabled:
            return
        self.write({"kind": "eval", **record})
        self.print(format_eval_line(record))
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", record["val_loss"], record["iteration"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str) -> dict[str, list[dict]]:
    """metrics.jsonl -> {"train": [...], "eval": [...], "start": [...], "event": [...]}, train/eval
    de-duplicated by iteration (the LAST record wins: a resumed run re-logs after its checkpoint)
    and sorted by iteration. A torn last line (killed writer) is ignored."""
    by_kind: dict[str, Any] = {"train": {}, "eval": {}, "start": [], "event": []}
    with open(path, errors="replace") as f:  # a damaged byte spoils its line only
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            kind = record.get("kind") if isinstance(record, dict) else None  # foreign lines are skipped
            if kind in ("train", "eval") and isinstance(record.get("iteration"), int):
                by_kind[kind][record["iteration"]] = record
            elif kind in ("start", "event"):
                by_kind[kind].append(record)
    return {"train": [by_kind["train"][k] for k in sorted(by_kind["train"])],
            "eval": [by_kind["eval"][k] for k in sorted(by_kind["eval"])],
            "start": by_kind["start"], "event": by_kind["event"]}
