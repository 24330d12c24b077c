"""`hpcmeg demo` on the local Slurm cluster (a smaller model through --set, same code path): the console
is never 15 s silent, the sample is labelled as what a tiny model trained for minutes produces, the
PNG has the name `hpcmeg plot` gives it, and a re-run of the finished demo takes seconds, submits
nothing and says how to force a re-run."""
from __future__ import annotations

import json

import pytest

from cli_helpers import TINY, corpus_shards, hpcmeg, longest_silence, sets, timed

pytestmark = pytest.mark.slurm


@pytest.mark.slow  # ~60-90 s on 2 busy cores
def test_demo_then_rerun_says_nothing_to_do(slurm_cluster, tmp_path):
    (shard,) = corpus_shards(tmp_path, n=1, files=60)  # a small input (the demo's own corpus takes 10+ s)
    over = TINY + ["train.train_iters=10", "checkpoint.save_interval=10", "train.log_interval=5",
                   f"data.inputs=[{shard}]"]
    rc, lines, err = timed("demo", "--profile", "local-slurm", "--output-root", str(tmp_path), *sets(over),
                           cwd=tmp_path, timeout=600)
    out = "\n".join(t for _, t in lines)
    assert rc == 0, out[-3000:] + err[-3000:]
    gap, after = longest_silence(lines)
    assert gap < 15, f"{gap:.1f} s without a line before {after!r}"
    run = tmp_path / "codeparrot-tiny"
    assert "train: iteration 10/10 |" in out and "convert: COMPLETED" in out
    # the sample says what it is: a ~3 M-parameter model (TINY) trained for minutes, not working code
    assert "[demo] generated completion (what a ~3 M-parameter model trained for" in out and "not working code" in out
    summary = (run / "summary.md").read_text()
    assert "~3 M-parameter model trained for" in summary and "not working code" in summary
    # one PNG name for demo and `hpcmeg plot`
    png = run / "curves.png"
    assert png.is_file() and str(png) in summary and not (run / "loss_curve.png").exists()
    assert hpcmeg("plot", str(run)).stdout.strip() == str(png)
    jobs = (run / "jobs.json").read_text()
    markers = sorted(p.name for p in (run / "markers").iterdir())
    # the re-run: seconds, nothing submitted or converted again, the way to force it named
    rc2, lines2, err2 = timed("demo", "--profile", "local-slurm", "--output-root", str(tmp_path), *sets(over),
                              cwd=tmp_path, timeout=120)
    out2 = "\n".join(t for _, t in lines2)
    assert rc2 == 0 and err2.strip() == "", err2
    assert lines2[-1][0] < 20, f"re-run took {lines2[-1][0]:.1f} s"
    assert "[demo] nothing to do" in out2 and "--force" in out2 and "submitted" not in out2
    assert (run / "jobs.json").read_text() == jobs and sorted(p.name for p in (run / "markers").iterdir()) == markers
    assert json.loads(jobs)["stages"]["train"]["job_id"]
    # a changed recipe is not "finished": it would run (checked without running: validate's view)
    from hpcmeg.demo import RECIPE, finished_run
    from hpcmeg.launch.submit import prepare
    from hpcmeg.recipe import load_recipe

    base = [f"run.output_root={tmp_path}"]
    assert finished_run(prepare(load_recipe(RECIPE, base + over, "local-slurm")))
    assert not finished_run(prepare(load_recipe(RECIPE, base + over + ["train.lr=0.001"], "local-slurm")))
