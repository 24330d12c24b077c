"""Small things a new user trips on, each run for real: the CLI, the local chain, the local Slurm cluster.

- `hpcmeg status` before the first checkpoint says so ('checkpoint none yet (0/20)'), not 'None/20'.
- `hpcmeg cancel` stops a running local chain: the ranks save (save_interval 0 notwithstanding), the
  markers, status and train_status.json say it was cancelled, and the same command resumes it.
- A chain started again after a cancel (a resume by hand) shows only its own attempt's lines: the
  local chain appends to the same rank-0 log, the Slurm watcher sees the earlier job's logs beside
  the new job's; neither may echo the earlier attempt's lines as if they were new.
- The first loss after that resume, when it averages fewer iterations than the log interval, says so
  ('avg of 3 iterations since resume').
- The start record of a CPU run names what it computes with on the CPU, not the GPU kernels.
- The example Apptainer profile sends the CPU-only stages to a CPU partition.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from conftest import REPO, hpcmeg_cmd
from cli_helpers import TINY, hpcmeg, sets, status, wait_states
from helpers import train_cli
from hpcmeg.launch.rundir import read_markers
from hpcmeg.megatron.names import latest_iteration
from hpcmeg.train.metrics import read_metrics

RECIPE = str(REPO / "recipes" / "codeparrot_tiny.yaml")
LOG_EVERY, ITERS = 5, 20
FIRST_LOG = f"iteration {LOG_EVERY:>{len(str(ITERS))}}/{ITERS}"  # as the log pads it: "iteration  5/20"


def _overrides(tmp_path, dataset) -> list[str]:
    return TINY + [f"train.log_interval={LOG_EVERY}", "run.output_root=" + str(tmp_path),
                   f"data.data_path=[{dataset}]", f"train.train_iters={ITERS}", "checkpoint.save_interval=0",
                   "convert.enabled=false"]


def _wait_for(path, text: str, proc=None, timeout: float = 240) -> None:
    end = time.time() + timeout
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.time() < end, f"no {text!r} in {path} after {timeout} s"
        time.sleep(0.5)


def _iteration_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if re.search(r"iteration +\d+/\d+ \|", ln)]


def _check_resumed_output(out: str, resumed_at: int) -> None:
    """The resumed attempt's console: its own lines only, and its first loss says how many iterations
    it averages when that is fewer than the log interval."""
    assert "resumed from" in out and f"at iteration {resumed_at}" in out, out[-3000:]
    assert "fresh start" not in out, out[-3000:]  # the first attempt's start banner, replayed
    lines = _iteration_lines(out)
    its = [int(re.search(r"iteration +(\d+)/", ln).group(1)) for ln in lines]
    assert its and min(its) > resumed_at, lines  # nothing the first attempt logged
    first = lines[0]
    n = -resumed_at % LOG_EVERY
    if n:  # the window from the resume to the next log point is partial
        assert f"(avg of {n} iteration{'s' if n != 1 else ''} since resume)" in first, first
    else:
        assert "avg of" not in first, first
    assert all("avg of" not in ln for ln in lines[1:]), lines  # full windows; 20 is a multiple of 5


def test_local_chain_status_then_cancel_and_resume(tmp_path, tiny_dataset):
    over = _overrides(tmp_path, tiny_dataset)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([*hpcmeg_cmd(), "submit", RECIPE, "--profile", "local", *sets(over)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "codeparrot-tiny"
    _wait_for(run / "logs" / "train" / "train.local.r0.0.log", FIRST_LOG, proc)
    # no checkpoint yet (save_interval 0): status says so in words
    st = hpcmeg("status", str(run)).stdout
    assert f"checkpoint none yet (0/{ITERS})" in st and "None" not in st, st
    assert "sent SIGTERM" in hpcmeg("cancel", str(run)).stdout
    first, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, first[-2000:] + err[-2000:]
    assert "fresh start" in first
    # the ranks saved on the signal although save_interval is 0, and the run says it was cancelled
    it = latest_iteration(run / "checkpoints")
    assert it is not None and LOG_EVERY <= it < ITERS
    assert read_markers(run)["train"]["interrupted"]["iteration"] == it
    st = status(run)
    assert st["stages"]["train"]["state"] == "CANCELLED" and st["cancelled"]
    assert json.loads((run / "train_status.json").read_text())["status"] == "preempted"
    # the same command again: the chain resumes and shows only the new attempt
    again = hpcmeg("submit", RECIPE, "--profile", "local", *sets(over), cwd=tmp_path, timeout=600)
    _check_resumed_output(again.stdout, it)
    # the first attempt's lines are still in the (appended) log: they were there to be replayed
    assert "fresh start" in (run / "logs" / "train" / "train.local.r0.0.log").read_text()
    m = read_metrics(str(run / "metrics.jsonl"))
    assert [r["kernels"] for r in m["start"]] == ["plain PyTorch ops (model.fused off)"] * 2
    notes = [(r["iteration"], r["loss_note"]) for r in m["train"] if r.get("loss_note")]
    assert notes == ([] if it % LOG_EVERY == 0 else
                     [(it + -it % LOG_EVERY, f"avg of {-it % LOG_EVERY} iteration"
                       f"{'s' if -it % LOG_EVERY != 1 else ''} since resume")]), notes


def test_fused_cpu_run_names_the_twins_it_runs(tmp_path):
    """model.fused=on on the CPU: the Triton kernels' ops run their PyTorch twins there."""
    from helpers import stdlib_dataset

    prefix = stdlib_dataset(tmp_path / "data", 40)
    rd = train_cli(1, tmp_path, prefix, "fused", ["model.fused=on", "train.train_iters=3", "train.eval_interval=0",
                                                  "checkpoint.save_interval=0"])
    kernels = read_metrics(os.path.join(rd, "metrics.jsonl"))["start"][0]["kernels"]
    assert kernels == "attention SDPA auto, the Triton kernels' PyTorch twins on cpu, CE grad_in_forward", kernels


@pytest.mark.parametrize("profile,gpu", [("example-apptainer", "gpu"), ("example-pyxis", "batch")])
def test_example_profiles_send_cpu_stages_to_a_cpu_partition(tmp_path, profile, gpu):
    (tmp_path / "in.jsonl").write_text(json.dumps({"content": "def f():\n    return 1\n"}) + "\n")
    hpcmeg("submit", RECIPE, "--profile", profile, "--set", f"run.output_root={tmp_path}",
           "--set", f"data.inputs=[{tmp_path}/in.jsonl]", "--dry-run", cwd=tmp_path)
    scripts = tmp_path / "codeparrot-tiny" / "scripts"
    part = {s: re.findall(r"^#SBATCH --partition=(\S+)$", (scripts / f"{s}.sbatch").read_text(), re.M)
            for s in ("preprocess", "train", "convert")}
    assert part == {"preprocess": ["cpu"], "train": [gpu], "convert": ["cpu"]}, part


@pytest.mark.slurm
@pytest.mark.slow  # 75-150 s on 2 busy cores
def test_slurm_resubmit_after_cancel_watches_only_the_new_job(slurm_cluster, tmp_path, tiny_dataset):
    # cluster.setup runs in the batch shell before the supervisor, as a site's module loads do: the
    # job is RUNNING for 8 s before its first log exists, longer than the watcher's 5 s poll, so the
    # watcher certainly looks for the train log while only the earlier job's is there
    over = _overrides(tmp_path, tiny_dataset) + ["cluster.cpu_tasks_per_node=1", "cluster.setup=" + json.dumps(["sleep 8"])]
    run = tmp_path / "codeparrot-tiny"
    hpcmeg("submit", RECIPE, "--profile", "local-slurm", *sets(over), cwd=tmp_path)
    logs = run / "logs" / "train"
    end = time.time() + 600  # the job may wait for nodes that other tests' jobs hold
    while not any(FIRST_LOG in p.read_text(errors="replace") for p in logs.glob("train.*.0.log")):
        assert time.time() < end, (sorted(p.name for p in logs.iterdir()) if logs.is_dir() else "no logs",
                                   hpcmeg("status", str(run), check=False).stdout)
        time.sleep(1)
    hpcmeg("cancel", str(run))
    wait_states(run, lambda s: s["stages"]["train"]["state"] in ("CANCELLED", "COMPLETED", "FAILED"))
    it = latest_iteration(run / "checkpoints")
    assert it is not None and LOG_EVERY <= it < ITERS
    # the same command again, watched: the old job's log lies beside the new one's
    again = hpcmeg("submit", RECIPE, "--profile", "local-slurm", *sets(over), "--wait", cwd=tmp_path, timeout=600)
    _check_resumed_output(again.stdout, it)
    assert len(list(logs.glob("train.*.r0.0.log"))) == 2
