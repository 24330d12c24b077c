"""The pieces of progress and failure reporting, on their own: preprocessing percent/ETA from the input
sizes (plain and gzip), training lines with elapsed time and ETA (per rank on CPU), the one-line cause
picked from a rank log, the log follower, and a real preprocess run printing its percentage."""
from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import time

from conftest import REPO, hpcmeg_cmd
from hpcmeg.data.preprocess import PreprocessConfig, PreprocessStats, _Progress, input_size_estimate
from hpcmeg.launch.causes import error_line, failure_cause, line_cause
from hpcmeg.launch.watch import LogFollower, clock, describe_stage, shown
from hpcmeg.train.metrics import MetricsLogger, duration, format_train_line


def test_input_size_estimate_plain_and_gzip(tmp_path):
    plain = tmp_path / "a.jsonl"
    plain.write_bytes(b'{"text": "abc"}\n' * 1000)
    body = os.urandom(300_000).hex().encode()  # incompressible-ish: compressed size close to raw/2
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(body))
    assert input_size_estimate([str(plain)]) == plain.stat().st_size
    assert input_size_estimate([str(plain), str(gz)]) == plain.stat().st_size + len(body)
    assert input_size_estimate([str(tmp_path / "missing")]) == 0


def test_progress_line_has_percent_and_eta():
    p = _Progress(PreprocessConfig(), total_bytes=4 * 2**20)
    p.t0 -= 10.0  # 10 s in, a quarter read: 30 s to go
    st = PreprocessStats(documents=100, tokens=5000, input_bytes=2**20)
    line = p.line(st)
    assert line.startswith("Processed 100 documents") and "| 25.0% of 4.0 MB |" in line
    eta = float(line.rsplit("ETA ", 1)[1].split()[0])
    assert 29 <= eta <= 31
    assert "%" not in p.line(st, done=True) and shown(line)


def test_real_preprocess_prints_percent(tmp_path):
    src = tmp_path / "c.jsonl"
    # 3.5 MB: the reader hands out batches of at least 1 MiB, so this makes several progress lines
    src.write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(17000)))
    r = subprocess.run([*hpcmeg_cmd(), "preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"),
                        "--json-keys", "text", "--append-eod", "--workers", "1", "--log-interval", "500"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    pct = [float(ln.split("| ")[1].split("%")[0]) for ln in r.stderr.splitlines() if "% of " in ln]
    assert len(pct) >= 2 and all(0 < a < b < 100 for a, b in zip(pct, pct[1:])), r.stderr
    assert "ETA" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("wrote ")


def test_train_line_elapsed_eta_and_units(tmp_path):
    buf = io.StringIO()
    m = MetricsLogger(str(tmp_path), enabled=True, train_iters=100, tensorboard=False, stream=buf, per="rank")
    rec = {"iteration": 10, "consumed_samples": 80, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": None,
           "skipped": 0, "step_time_s": 0.5, "tokens_per_s_per_gpu": 100.0, "tflops_per_gpu": 0.01, "mfu": None,
           "peak_mem_gib": 1.0}
    m.t_start -= 30
    m.train(rec)  # first line: ETA from its own step time, 90 x 0.5 s
    first = buf.getvalue().splitlines()[-1]
    assert "tokens/s/rank 100" in first and "gpu" not in first.lower()
    assert "| elapsed 30s | ETA 45s" in first
    # later lines: wall time per iteration since the first logged line (evals/saves included)
    assert m.timing(20, 0.5, now=m._first[1] + 20.0)["eta_s"] == 160.0
    m.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["eta_s"] == 45.0 and recs[0]["elapsed_s"] >= 30
    assert "tokens/s/gpu" in format_train_line(rec, 100) and "ETA" not in format_train_line(rec, 100)
    assert duration(59) == "59s" and duration(61) == "1m01s" and duration(7322) == "2h02m" and duration(None) == "n/a"
    assert clock(65) == "1:05" and clock(3725) == "1:02:05"


def test_cause_is_the_ranks_own_error_line(tmp_path):
    banner = "hpcmeg train: run | 2 process(es) on cpu | DP 2 x micro 4 | fresh start"
    assert not error_line(banner) and not error_line("hpcmeg convert: wrote /x")
    assert not error_line("hpcmeg preprocess: warning: --vocab is deprecated")
    assert error_line("hpcmeg train [rank 1]: no tokenized dataset at /x.bin/.idx")
    assert error_line("hpcmeg: data.inputs[0]: 'x' matches no file")
    assert line_cause([banner, "iteration 1/2 | loss 3", "hpcmeg train: checkpoint.load: no checkpoint in '/c'"]) \
        == "hpcmeg train: checkpoint.load: no checkpoint in '/c'"
    tb = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>', "    boom()",
          "RuntimeError: the real reason", "hpcmeg train: error: RuntimeError: the real reason"]
    assert line_cause(tb) == "hpcmeg train: error: RuntimeError: the real reason"
    assert line_cause(tb[:4]) == "RuntimeError: the real reason"
    assert line_cause([banner, "iteration 1/2 | loss 3"]) is None
    d = tmp_path / "logs" / "train"
    d.mkdir(parents=True)
    (d / "train.7.r0.0.log").write_text(banner + "\nhpcmeg train: old attempt's error\n")
    (d / "train.7.r0.1.log").write_text("")
    time.sleep(0.02)
    (d / "train.7.r1.0.log").write_text(banner + "\n")  # the newest attempt: rank 0 says nothing...
    (d / "train.7.r1.1.log").write_text("hpcmeg train [rank 1]: rank 1's cause\n")  # ...rank 1 does
    (d / "train.7.batch.log").write_text("hpcmeg train: not a task log\n")
    c = failure_cause(tmp_path, "train")
    assert c.task == 1 and c.line == "hpcmeg train [rank 1]: rank 1's cause"
    assert c.describe(tmp_path) == "rank 1: hpcmeg train [rank 1]: rank 1's cause (log: logs/train/train.7.r1.1.log)"
    assert failure_cause(tmp_path, "train", "7", 0).line == "hpcmeg train: old attempt's error"
    assert failure_cause(tmp_path, "convert") is None


def test_log_follower_and_stage_description(tmp_path):
    p = tmp_path / "x.log"
    f = LogFollower(p)
    assert f.new_lines() == []
    p.write_bytes(b"one\ntw")
    assert f.new_lines() == ["one"]
    with open(p, "ab") as h:
        h.write(b"o\nthree\n")
    assert f.new_lines() == ["two", "three"] and f.new_lines() == []
    one = {"state": "PENDING", "detail": "", "tasks": {"": {"state": "PENDING", "reason": "Dependency"}}}
    assert describe_stage(one) == "PENDING (Dependency)"
    run = {"state": "RUNNING", "detail": "", "tasks": {"": {"state": "RUNNING", "nodes": "node2"}}}
    assert describe_stage(run) == "RUNNING on node2"
    arr = {"state": "RUNNING", "detail": "1 COMPLETED, 1 RUNNING", "tasks": {"0": {}, "1": {}}}
    assert describe_stage(arr) == "RUNNING (1 COMPLETED, 1 RUNNING)"
    # failed within one poll: where and for how long it ran; a job that never ran says only its state
    failed = {"state": "FAILED", "detail": "", "tasks": {"": {"state": "FAILED", "nodes": "node1", "elapsed": "00:00:04"}}}
    assert describe_stage(failed) == "FAILED on node1 after 00:00:04"
    never = {"state": "CANCELLED", "detail": "", "tasks": {"": {"state": "CANCELLED", "nodes": "None assigned",
                                                                "elapsed": "00:00:00"}}}
    assert describe_stage(never) == "CANCELLED"
    assert shown("iteration  10/200 | consumed samples 80 | loss 9.8")
    assert not shown("Traceback (most recent call last):")
    assert not shown("hpcmeg train: checkpoint.load: bad") and shown("validation at iteration 50 | val loss 3.2")
