"""Helpers for tests that drive the hpcmeg CLI as a user would (tests import this module, never each other).

TINY (overrides that make the tiny recipe a ~3 M-parameter model), sets (--set pairs), hpcmeg (run
the CLI, assert exit 0), status / wait_states (`hpcmeg status --json`, polled), corpus_shards (the
Python standard library as JSONL shards), timed / longest_silence (stdout lines with timestamps, to
assert the CLI never goes quiet).
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from conftest import REPO, hpcmeg_cmd
from hpcmeg.data.corpus import write_stdlib_corpus

# A model small enough that a step takes well under a second on 2 busy cores.
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "data.seq_length=64",
        "model.max_position_embeddings=64", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.lr_warmup_iters=2", "train.eval_interval=0", "data.split=90,10,0", "train.log_interval=5"]


def sets(items: list[str]) -> list[str]:
    return [x for item in items for x in ("--set", item)]


def hpcmeg(*args, cwd=None, timeout=300, env=None, check=True) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    r = subprocess.run([*hpcmeg_cmd(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=e)
    if check:
        assert r.returncode == 0, f"hpcmeg {' '.join(args)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def status(run_dir, env=None) -> dict:
    return json.loads(hpcmeg("status", str(run_dir), "--json", env=env).stdout)


def wait_states(run_dir, pred, timeout=240, poll=1.0) -> dict:
    end = time.time() + timeout
    while True:
        st = status(run_dir)
        if pred(st):
            return st
        if time.time() > end:
            raise AssertionError(f"timed out; last status {json.dumps(st, indent=1)[-3000:]}")
        time.sleep(poll)


def corpus_shards(tmp: Path, n: int = 2, files: int = 160) -> list[Path]:
    """The Python standard library as n JSONL shards (real code text)."""
    whole = tmp / "stdlib.jsonl"
    write_stdlib_corpus(str(whole), key="content", include_tests=False, max_files=files)
    lines = whole.read_bytes().splitlines(keepends=True)
    out = []
    for k in range(n):
        p = tmp / f"shard{k}.jsonl"
        p.write_bytes(b"".join(lines[k::n]))
        out.append(p)
    return out


def timed(*args, cwd=None, timeout=400, env=None, umask=None) -> tuple[int, list[tuple[float, str]], str]:
    """Run hpcmeg; (exit code, [(seconds since start, stdout line)], stderr) — to measure silences."""
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    t0 = time.time()
    p = subprocess.Popen([*hpcmeg_cmd(), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=e, preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)
    lines = [(0.0, "")]
    err: list[str] = []
    th = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    th.start()
    for line in p.stdout:
        lines.append((time.time() - t0, line.rstrip("\n")))
    rc = p.wait(timeout=timeout)
    th.join(timeout=30)
    lines.append((time.time() - t0, "<exit>"))
    return rc, lines, "".join(err)


def longest_silence(lines: list[tuple[float, str]]) -> tuple[float, str]:
    gaps = [(b[0] - a[0], b[1]) for a, b in zip(lines, lines[1:])]
    return max(gaps)
