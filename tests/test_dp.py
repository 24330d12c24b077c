"""Data parallelism: `hpcmeg train recipes/codeparrot_tiny.yaml` on 2 gloo processes (accumulation 1;
under torchrun once, started directly elsewhere) matches 1 process (accumulation 2) at the same
global batch.

The two runs see the same samples per step (Megatron's sampler slices each global batch across
ranks) and the same initial weights (same seed); only the reduction order of the gradient
average differs (DDP all-reduce vs accumulation), so the curves agree to float32 round-off.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from hpcmeg.checkpoint.store import load_checkpoint
from hpcmeg.train.metrics import read_metrics
from helpers import (SMALL, TINY_RECIPE as TINY, Ranks, free_port, run_ranks, stdlib_dataset, stop_after_first_log,
                     torchrun_cmd)

pytestmark = pytest.mark.dist


def _run(nproc: int, out, prefix, name: str, extra: list[str], torchrun: bool = False) -> tuple[str, str]:
    """`hpcmeg train` on nproc local ranks (started directly, or under torchrun: one test keeps that path)."""
    sets = [f"run.output_root={out}", f"run.name={name}", f"data.data_path=[{prefix}]", *extra]
    args = ["train", TINY] + [x for s in sets for x in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    if torchrun:
        p = subprocess.run(torchrun_cmd(nproc, *args), env=env, capture_output=True, text=True, timeout=600)
    else:
        p = run_ranks(nproc, args, env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return os.path.join(str(out), name), p.stdout


def _compare(rd1: str, rd2: str, stdout2: str, iters: int) -> None:
    m1, m2 = (read_metrics(os.path.join(rd, "metrics.jsonl")) for rd in (rd1, rd2))
    assert (m1["start"][0]["data_parallel_size"], m1["start"][0]["grad_accum_steps"]) == (1, 2)
    assert (m2["start"][0]["data_parallel_size"], m2["start"][0]["grad_accum_steps"]) == (2, 1)
    l1 = [x["loss"] for x in m1["train"]]
    l2 = [x["loss"] for x in m2["train"]]
    assert len(l1) == len(l2) == iters
    assert l1[-1] < l1[0] - 0.1  # it moved: the comparison is not between two flat lines
    # measured: identical grad norms, losses equal to the last bit of float32 (the mean is taken
    # in float64 over 2 ranks vs 1): far tighter than this bound
    assert l2 == pytest.approx(l1, rel=1e-6, abs=1e-6)
    v1, v2 = ([x["val_loss"] for x in m["eval"]] for m in (m1, m2))
    assert v1 and v2 == pytest.approx(v1, rel=1e-6, abs=1e-6)
    # rank 0 alone prints metric lines
    assert stdout2.count(f"iteration {iters:>{len(str(iters))}}/{iters}") == 1
    _, s1 = load_checkpoint(os.path.join(rd1, "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1, pp_size=1)
    _, s2 = load_checkpoint(os.path.join(rd2, "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1, pp_size=1)
    w1 = s1["model"]["language_model"]["encoder"]
    w2 = s2["model"]["language_model"]["encoder"]
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)
    assert s2["args"].data_parallel_size == 2 and s2["args"].consumed_train_samples == s1["args"].consumed_train_samples


def test_two_process_dp_matches_one_process(tmp_path):
    """The tiny recipe with the model and sequence shrunk to keep this under a minute."""
    prefix = stdlib_dataset(tmp_path / "data")
    extra = [*SMALL, "train.train_iters=10", "train.eval_interval=5", "train.eval_iters=2"]
    extra = [e for e in extra if not e.startswith("cluster.")]  # the recipe's own 2-rank cluster
    rd1, _ = _run(1, tmp_path, prefix, "one", extra)
    rd2, out2 = _run(2, tmp_path, prefix, "two", extra, torchrun=True)  # the torchrun launch path
    _compare(rd1, rd2, out2, 10)


def _rank_worker(rank, port, out, prefix, mode, result_dir):
    """One of 2 gloo ranks of `hpcmeg train` (in-process entry.train, like torchrun would run it)."""
    import json
    import math

    from hpcmeg.recipe import load_recipe
    from hpcmeg.train.entry import train

    torch.set_num_threads(1)
    extra = [e for e in SMALL if not e.startswith("cluster.")]
    extra += ["train.log_interval=5", "train.eval_interval=0", "checkpoint.save_interval=0",
              f"train.train_iters={12 if mode == 'nan' else 5000}"]
    r = load_recipe(TINY, [f"run.output_root={out}", f"run.name={mode}", f"data.data_path=[{prefix}]", *extra])
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    seen = {}

    def on_built(trainer):
        seen["trainer"] = trainer
        if mode == "nan" and rank == 1:  # rank 1 only, on iteration 7 (no log/eval/save boundary)
            trainer.model.encoder.register_forward_hook(
                lambda m, i, o: o * math.nan if trainer.state.iteration + 1 == 7 else o)
        open(os.path.join(result_dir, f"ready{rank}"), "w").close()

    code = train(r, environ=env, on_built=on_built)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"code": code, "iteration": seen["trainer"].state.iteration}, f)


def _two_ranks(tmp_path, mode, signal_rank1_after_s=None):
    import json
    import signal
    import time

    import torch.multiprocessing as mp

    from preloaded import context

    prefix = stdlib_dataset(tmp_path / "data")
    res_dir = tmp_path / f"res-{mode}"
    res_dir.mkdir()
    context()  # the forkserver the ranks fork from: torch imported once per session, not per rank
    ctx = mp.start_processes(_rank_worker, args=(free_port(), str(tmp_path), prefix, mode, str(res_dir)), nprocs=2,
                             join=False, start_method="forkserver")
    if signal_rank1_after_s is not None:
        deadline = time.time() + 120
        metrics = tmp_path / mode / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
            time.sleep(0.1)  # rank 0 logged iteration 5: both ranks are stepping
        time.sleep(signal_rank1_after_s)
        os.kill(ctx.processes[1].pid, signal.SIGTERM)
    while not ctx.join(timeout=300):
        pass
    return [json.loads((res_dir / f"rank{r}.json").read_text()) for r in range(2)], tmp_path / mode


def test_two_ranks_stop_together_when_only_rank1_gets_sigterm(tmp_path):
    """The per-iteration agreement (computed on the device, all-reduced, read one iteration later):
    rank 0 never sees a signal, yet both ranks save the same iteration and ask for a requeue."""
    import json

    from hpcmeg.megatron.names import EXIT_REQUEUE

    res, rd = _two_ranks(tmp_path, "signal", signal_rank1_after_s=0.5)
    assert [x["code"] for x in res] == [EXIT_REQUEUE, EXIT_REQUEUE]
    it = res[0]["iteration"]
    assert res[1]["iteration"] == it and 5 <= it < 5000
    status = json.loads((rd / "train_status.json").read_text())
    assert status["status"] == "preempted" and status["iteration"] == it and "stop requested on another rank" in status["reason"]
    assert (rd / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(it)


def test_two_ranks_stop_together_on_a_nan_on_rank1(tmp_path):
    """NaN in rank 1's forward on iteration 7 (not a log boundary: found one iteration later):
    both ranks stop with the error naming iteration 7, and nothing was saved."""
    import json

    from hpcmeg.megatron.names import EXIT_ERROR

    res, rd = _two_ranks(tmp_path, "nan")
    assert [x["code"] for x in res] == [EXIT_ERROR, EXIT_ERROR]
    status = json.loads((rd / "train_status.json").read_text())
    assert status["status"] == "failed" and "non-finite loss or gradient at iteration 7" in status["reason"]
    assert not (rd / "checkpoints" / "latest_checkpointed_iteration.txt").exists()


def _final(rd: str):
    return load_checkpoint(os.path.join(rd, "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1, pp_size=1)


def _assert_same_state(a: dict, b: dict, optimizer: bool = True) -> None:
    wa, wb = a["model"]["language_model"]["encoder"], b["model"]["language_model"]["encoder"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ea, eb = a["model"]["language_model"]["embedding"], b["model"]["language_model"]["embedding"]
    assert all(torch.equal(ea[t]["weight"], eb[t]["weight"]) for t in ea)
    if optimizer:
        sa, sb = a["optimizer"]["optimizer"]["state"], b["optimizer"]["optimizer"]["state"]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in ("exp_avg", "exp_avg_sq"))


def _interrupted(nproc: int, out, prefix, name: str, extra: list[str]) -> str:
    """`hpcmeg train` on nproc ranks, SIGTERM to every rank once rank 0 logged a step, then again."""
    sets = [f"run.output_root={out}", f"run.name={name}", f"data.data_path=[{prefix}]", *extra]
    args = ["train", TINY] + [x for s in sets for x in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    p = Ranks(nproc, args, env)
    err = stop_after_first_log(p, os.path.join(str(out), name, "metrics.jsonl"))
    status = json.load(open(os.path.join(str(out), name, "train_status.json")))
    assert status["status"] == "preempted", (p.returncode(), err[-3000:])
    r = run_ranks(nproc, args, env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return os.path.join(str(out), name)


def test_distributed_optimizer_resume_is_exact_and_resumes_at_dp1(tmp_path):
    """DP2 with the distributed optimizer (dropout on, so the RNG restore matters): stopped by SIGTERM
    and resumed, it equals the uninterrupted run bit for bit (curves, weights, Adam moments). Its
    iteration-4 checkpoint (optimizer gathered from the shards) then resumes at DP1 without the
    distributed optimizer and at DP2 with it: the same weights bit for bit (fp32, dropout 0: the two
    micro batches' gradients are summed once either way)."""
    import shutil

    prefix = stdlib_dataset(tmp_path / "data")
    base = [e for e in SMALL if not e.startswith("cluster.")] + [
        "train.train_iters=8", "train.eval_interval=4", "train.eval_iters=1", "checkpoint.save_interval=4",
        "checkpoint.keep_last=null"]
    zero = ["parallel.distributed_optimizer=true"]
    dropout = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    rd_ref, _ = _run(2, tmp_path, prefix, "ref", base + zero + dropout)
    rd_int = _interrupted(2, tmp_path, prefix, "int", base + zero + dropout)
    m_ref, m_int = (read_metrics(os.path.join(rd, "metrics.jsonl")) for rd in (rd_ref, rd_int))
    assert m_int["start"][-1]["start"].startswith("resumed") and m_ref["start"][0]["distributed_optimizer"]
    key = [(x["iteration"], x["loss"], x["grad_norm"]) for x in m_ref["train"]]
    assert [(x["iteration"], x["loss"], x["grad_norm"]) for x in m_int["train"]] == key
    (i_ref, s_ref), (i_int, s_int) = _final(rd_ref), _final(rd_int)
    assert i_ref == i_int == 8 and s_ref["args"].use_distributed_optimizer
    _assert_same_state(s_ref, s_int)
    # the iteration-4 checkpoint, resumed at DP1 (no distributed optimizer) and at DP2 (with it)
    for name in ("dp1", "dp2"):
        ck = tmp_path / name / "checkpoints"
        shutil.copytree(os.path.join(rd_ref, "checkpoints", "iter_0000004"), ck / "iter_0000004")
        (ck / "latest_checkpointed_iteration.txt").write_text("4\n")
    rd1, _ = _run(1, tmp_path, prefix, "dp1", base)
    rd2, _ = _run(2, tmp_path, prefix, "dp2", base + zero)
    m1, m2 = (read_metrics(os.path.join(rd, "metrics.jsonl")) for rd in (rd1, rd2))
    assert [x["iteration"] for x in m1["train"]] == [5, 6, 7, 8]
    assert [x["loss"] for x in m2["train"]] == pytest.approx([x["loss"] for x in m1["train"]], rel=1e-6)
    assert [x["grad_norm"] for x in m2["train"]] == pytest.approx([x["grad_norm"] for x in m1["train"]], rel=1e-6)
    _assert_same_state(_final(rd1)[1], _final(rd2)[1])
    assert json.loads(open(os.path.join(rd1, "train_status.json")).read())["status"] == "finished"
