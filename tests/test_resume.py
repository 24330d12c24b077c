"""Exact resume on CPU: an interrupted-and-resumed run equals the uninterrupted one, bit for bit.

Dropout is ON (0.1) so the RNG restore matters; the interruption is Megatron's exit interval
(in process) and a real SIGTERM to a `hpcmeg train` process (all ranks agree, save, exit 3), forked
from tests/preloaded.py's server, which has imported torch.
Per-step losses, grad norms and validation losses from metrics.jsonl are compared with ==, and the
final checkpoints (model, optimizer moments, schedule) with torch.equal.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time

import pytest
import torch

from hpcmeg.checkpoint.store import load_checkpoint
from hpcmeg.megatron.names import EXIT_BAD_RECIPE, EXIT_OK, EXIT_REQUEUE
from hpcmeg.train.entry import train
from hpcmeg.train.metrics import read_metrics
from helpers import SMALL, TINY_RECIPE as TINY, run_dir, small_recipe, stdlib_dataset
from preloaded import CliProcess, run_cli

N = 10
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", f"train.train_iters={N}", "train.eval_interval=4"]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run: (dataset prefix, output root, run dir)."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prefix = stdlib_dataset(tmp_path_factory.mktemp("data"))
    out = tmp_path_factory.mktemp("runs")
    r = small_recipe(out, prefix, *DROPOUT, name="straight")
    assert train(r) == EXIT_OK
    return prefix, out, run_dir(r)


def curves(rd):
    m = read_metrics(os.path.join(rd, "metrics.jsonl"))
    return ([(x["iteration"], x["loss"], x["grad_norm"], x["lr"]) for x in m["train"]],
            [(x["iteration"], x["val_loss"]) for x in m["eval"]])


def final_state(rd):
    it, st = load_checkpoint(os.path.join(rd, "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1, pp_size=1)
    return it, st


def assert_same_final(rd_a, rd_b):
    (ia, a), (ib, b) = final_state(rd_a), final_state(rd_b)
    assert ia == ib == N
    ma, mb = a["model"]["language_model"], b["model"]["language_model"]
    for part in ("embedding", "encoder"):
        flat_a = {k: v for k, v in _leaves(ma[part])}
        flat_b = {k: v for k, v in _leaves(mb[part])}
        assert flat_a.keys() == flat_b.keys()
        for k in flat_a:
            assert torch.equal(flat_a[k], flat_b[k]), k
    sa, sb = a["optimizer"]["optimizer"]["state"], b["optimizer"]["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[i][key], sb[i][key]), (i, key)
    assert a["opt_param_scheduler"] == b["opt_param_scheduler"]
    assert a["args"].consumed_train_samples == b["args"].consumed_train_samples


def _leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_exit_interval_then_resume_is_exact(straight):
    """Also: async save, keep_last, and 2 data-loader workers (the reference used none)."""
    prefix, out, rd_ref = straight
    r = small_recipe(out, prefix, *DROPOUT, "checkpoint.save_interval=2", "checkpoint.keep_last=2",
                     "checkpoint.async_save=true", "data.num_workers=2", name="interrupted")
    assert train(r, exit_interval=3) == EXIT_REQUEUE
    rd = run_dir(r)
    status = json.load(open(os.path.join(rd, "train_status.json")))
    assert (status["status"], status["iteration"], status["exit_code"]) == ("preempted", 3, EXIT_REQUEUE)
    assert sorted(os.listdir(os.path.join(rd, "checkpoints"))) == ["iter_0000002", "iter_0000003",
                                                                    "latest_checkpointed_iteration.txt"]
    assert train(r) == EXIT_OK  # same recipe, same command: resumes at 3
    assert read_metrics(os.path.join(rd, "metrics.jsonl"))["start"][-1]["start"].endswith("at iteration 3")
    assert curves(rd) == curves(rd_ref)
    assert len(curves(rd)[0]) == N and len(curves(rd)[1]) == 2
    assert_same_final(rd, rd_ref)
    assert sorted(x for x in os.listdir(os.path.join(rd, "checkpoints")) if x.startswith("iter")) == \
        ["iter_0000008", "iter_0000010"]  # keep_last=2


@pytest.mark.dist
def test_sigterm_then_resume_is_exact(straight):
    prefix, out, rd_ref = straight
    sets = [f"run.output_root={out}", "run.name=signalled", f"data.data_path=[{prefix}]"]

    args = ["train", TINY]
    for s in sets + SMALL + DROPOUT:
        args += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    rd = os.path.join(str(out), "signalled")
    metrics = os.path.join(rd, "metrics.jsonl")
    with tempfile.NamedTemporaryFile("w+") as out_f, tempfile.NamedTemporaryFile("w+") as err_f:
        p = CliProcess(args, env, out_f.name, err_f.name)
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            if os.path.exists(metrics) and read_metrics(metrics)["train"]:
                break
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=240)
        stdout, stderr = out_f.read(), err_f.read()
    assert p.returncode == EXIT_REQUEUE, stderr[-3000:]
    status = json.load(open(os.path.join(rd, "train_status.json")))
    assert status["status"] == "preempted" and "SIGTERM" in status["reason"] and status["iteration"] < N
    assert "resume me" in stdout
    r2 = run_cli(args, env, timeout=300)
    assert r2.returncode == EXIT_OK, r2.stderr[-3000:]
    assert curves(rd) == curves(rd_ref)
    assert_same_final(rd, rd_ref)


def test_release_weights_start_and_schedule_mismatch(straight, capsys):
    prefix, out, rd_ref = straight
    # an imported 'release' checkpoint: the reference run's final weights under release/
    rel = os.path.join(str(out), "release_ckpt")
    shutil.copytree(os.path.join(rd_ref, "checkpoints", f"iter_{N:07d}"), os.path.join(rel, "release"))
    with open(os.path.join(rel, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release\n")
    r = small_recipe(out, prefix, "train.train_iters=2", "train.lr_warmup_iters=1", f"checkpoint.load={rel}",
                     name="from_release")
    assert train(r) == EXIT_OK
    m = read_metrics(os.path.join(run_dir(r), "metrics.jsonl"))
    assert m["start"][0]["start"].startswith("weights from") and m["train"][0]["iteration"] == 1
    assert m["train"][0]["loss"] < read_metrics(os.path.join(rd_ref, "metrics.jsonl"))["train"][0]["loss"] - 0.5
    # resuming the reference run with another peak LR: refused with the differing key (exit 2)
    r_bad = small_recipe(out, prefix, *DROPOUT, "train.lr=0.01", f"train.train_iters={N + 2}", name="straight")
    assert train(r_bad) == EXIT_BAD_RECIPE
    assert "max_lr" in capsys.readouterr().err


def test_exit_duration_saves_and_asks_for_requeue(straight):
    """train.exit_duration_minutes (the wall-time guard's own clock): save at the first check, exit 3."""
    prefix, out, _ = straight
    r = small_recipe(out, prefix, "train.exit_duration_minutes=0.0001", name="walltime")
    assert train(r) == EXIT_REQUEUE
    status = json.load(open(os.path.join(run_dir(r), "train_status.json")))
    assert status["status"] == "preempted" and status["iteration"] == 1 and "wall-time" in status["reason"]
    assert load_checkpoint(os.path.join(run_dir(r), "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1,
                           pp_size=1)[0] == 1
