"""The 'local' executor (no Slurm): the same chain, run directory, markers and status as on Slurm.

preprocess (2 shards -> merge) -> train with 2 local rank processes (RANK/WORLD_SIZE env, gloo) ->
convert; the converted model loads in transformers. That `hpcmeg cancel` stops a running local chain
(the ranks save, the run can be resumed) is tests/test_user_trips.py's local chain test.
"""
from __future__ import annotations

import json

import pytest

from conftest import REPO
from cli_helpers import TINY, corpus_shards, hpcmeg, longest_silence, sets, status, timed


@pytest.mark.slow  # 45-75 s on 2 busy cores; an acceptance test, so it must exist
def test_local_chain_end_to_end(tmp_path):
    corpus_shards(tmp_path)
    over = TINY + ["run.output_root=" + str(tmp_path / "runs"), f"data.inputs=[{tmp_path}/shard*.jsonl]",
                   "train.train_iters=10", "checkpoint.save_interval=5", "convert.iterations=last"]
    rc, lines, err = timed("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local",
                           *sets(over), cwd=tmp_path, timeout=400)
    run = tmp_path / "runs" / "codeparrot-tiny"
    out = "\n".join(t for _, t in lines)
    assert rc == 0 and f"done: {run}" in out, out[-3000:] + err[-3000:]
    # the console shows what the ranks do (rank 0's lines, with elapsed time and ETA), never 15 s silent
    assert "train: iteration  5/10 |" in out and "train: iteration 10/10 |" in out and "| ETA " in out
    assert "preprocess 0: Processed" in out or "preprocess: Processed" in out
    gap, after = longest_silence(lines)
    assert gap < 15, f"{gap:.1f} s without a line before {after!r}"
    # a finished chain has nothing to cancel, and is not marked cancelled
    c = hpcmeg("cancel", str(run))
    assert "nothing to cancel" in c.stdout and "train COMPLETED" in c.stdout
    assert "cancelled_at" not in json.loads((run / "jobs.json").read_text())
    st = status(run)
    assert {s: v["state"] for s, v in st["stages"].items()} == {
        "preprocess": "COMPLETED", "merge": "COMPLETED", "train": "COMPLETED", "convert": "COMPLETED"}
    assert st["executor"] == "local" and len(st["stages"]["preprocess"]["tasks"]) == 2
    logs = run / "logs"
    assert (logs / "train" / "train.local.r0.0.log").exists() and (logs / "train" / "train.local.r0.1.log").exists()
    assert "iteration 10/10" in hpcmeg("logs", str(run), "--stage", "train").stdout
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(run / "hf" / "iter_0000010").eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[15496, 995]])).logits).all()
    # the same recipe again: the dataset is current, so only the plan changes
    dry = hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local", *sets(over),
                 "--dry-run", cwd=tmp_path)
    assert "preprocess] skipped" in dry.stdout and "[train] 2 process(es)" in dry.stdout
