"""The training loop on CPU: it learns, fp16 overflow is skipped, bf16 NaN stops, metrics + plot.

Data is real: Python standard-library sources tokenized with the GPT-2 BPE into a Megatron
.bin/.idx. The model is shrunk (hidden 32, seq 32) so steps take ~0.1 s on a 2-core box; the
vocabulary stays GPT-2's 50,304 rows, which dominates the cost.
`stdlib_dataset` and `small_recipe` are shared with test_resume.py and test_dp.py.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from hpcmeg.procenv import dist_env
from hpcmeg.recipe import load_recipe
from hpcmeg.train.build import attention_backend_for, build_trainer
from hpcmeg.megatron.names import EXIT_BAD_RECIPE, EXIT_ERROR, EXIT_OK
from hpcmeg.train.entry import train
from hpcmeg.train.metrics import read_metrics

from helpers import SMALL, TINY_RECIPE as TINY, run_dir, small_recipe, stdlib_dataset  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return stdlib_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One intra-op thread: CI boxes are small and shared; spinning OpenMP threads make it crawl."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_it_learns_fast(dataset, tmp_path):
    """40 steps x 8 samples x 32 tokens: measured 10.5 -> 5.3 (validation 4.5)."""
    r = small_recipe(tmp_path, dataset, "train.train_iters=40", "train.global_batch_size=8",
                     "train.micro_batch_size=8", "train.lr=0.006", "train.lr_warmup_iters=4",
                     "train.eval_interval=40", "train.eval_iters=2", "train.log_interval=4")
    assert train(r) == EXIT_OK
    m = read_metrics(os.path.join(run_dir(r), "metrics.jsonl"))
    first, last = m["train"][0]["loss"], m["train"][-1]["loss"]
    assert first > 10.0  # ~ln(50304) = 10.8 at init
    assert last < 6.0, f"loss {first:.2f} -> {last:.2f}"
    assert m["eval"][-1]["val_loss"] < 6.0


@pytest.mark.slow
def test_it_learns_tiny_recipe(dataset, tmp_path):
    """The tiny recipe's real model (4 x 128, seq 128, global batch 8) for 30 CPU steps (~1.8-2.4 s
    each: the 50,304-row head and its log-softmax).
    Measured at 30 steps: mean loss of steps 1-10 9.49, of steps 21-30 5.01, validation 4.98, so the
    bounds keep a margin of 0.5 (at 40 steps: 4.39 and 4.42; at 100: 3.94 and 3.99; at 25 steps the
    bound is met only just, 5.47 and 5.57 with warm-up 5); the demo runs the full 200."""
    r = load_recipe(TINY, [f"run.output_root={tmp_path}", f"data.data_path=[{dataset}]", "data.split=949,50,0",
                           "train.train_iters=30", "train.lr_warmup_iters=10", "train.eval_interval=30",
                           "checkpoint.save_interval=0", "cluster.cpu_tasks_per_node=1"])
    assert train(r) == EXIT_OK
    m = read_metrics(os.path.join(run_dir(r), "metrics.jsonl"))
    assert m["train"][0]["loss"] > 9.0  # log_interval 10: the mean of steps 1-10
    assert m["train"][-1]["loss"] < 5.5 and m["eval"][-1]["val_loss"] < 5.5


def test_metrics_checkpoint_and_plot(dataset, tmp_path):
    r = small_recipe(tmp_path, dataset)
    assert train(r) == EXIT_OK
    rd = run_dir(r)
    m = read_metrics(os.path.join(rd, "metrics.jsonl"))
    assert [x["iteration"] for x in m["train"]] == list(range(1, 9))
    rec = m["train"][-1]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s_per_gpu", "tflops_per_gpu", "step_time_s", "peak_mem_gib"):
        assert isinstance(rec[key], float) and rec[key] > 0, key
    assert rec["mfu"] is None and rec["consumed_samples"] == 32  # CPU: no peak -> MFU n/a
    assert m["train"][0]["lr"] == 0.0  # Megatron: the first warmup step runs at lr 0
    assert [e["iteration"] for e in m["eval"]] == [4, 8]
    assert m["start"][0]["n_params"] > 0 and m["start"][0]["data_parallel_size"] == 1
    # what this run computes with on this device: model.fused 'auto' is off on CPU, so none of the
    # GPU kernels (tests/test_user_trips.py: a fused CPU run names its PyTorch twins)
    assert m["start"][0]["kernels"] == "plain PyTorch ops (model.fused off)"
    assert os.listdir(os.path.join(rd, "tensorboard"))
    assert json.load(open(os.path.join(rd, "train_status.json")))["status"] == "finished"
    assert open(os.path.join(rd, "checkpoints", "latest_checkpointed_iteration.txt")).read().strip() == "8"
    from hpcmeg.checkpoint.store import load_checkpoint

    it, state = load_checkpoint(os.path.join(rd, "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1, pp_size=1)
    assert it == 8 and state["args"].consumed_train_samples == 32 and state["args"].padded_vocab_size == 50304
    assert state["hpcmeg"]["recipe"]["train"]["train_iters"] == 8
    assert state["opt_param_scheduler"]["num_steps"] == 32
    from hpcmeg.cli import main

    png = os.path.join(str(tmp_path), "curves.png")
    assert main(["plot", rd, "-o", png]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_fp16_overflow_is_skipped_and_scale_lowered(dataset, tmp_path):
    """Gradients forced to inf on iterations 3 and 4: both skipped (hysteresis 2: the second
    lowers the scale), the LR schedule does not advance, training continues to the end."""
    r = small_recipe(tmp_path, dataset, "train.precision=fp16", "train.initial_loss_scale=1024",
                     "train.eval_interval=0", "train.train_iters=6")
    trainer, ctx = build_trainer(r, dist_env({}))
    w = trainer.model.encoder.layers[0].mlp.dense_h_to_4h.weight
    w.register_hook(lambda g: g * math.inf if trainer.state.iteration + 1 in (3, 4) else g)
    try:
        out = trainer.run()
    finally:
        trainer.metrics.close()
        ctx.destroy()
    assert out.status == "finished" and out.iteration == 6
    t = {x["iteration"]: x for x in read_metrics(os.path.join(run_dir(r), "metrics.jsonl"))["train"]}
    assert [t[i]["skipped"] for i in range(1, 7)] == [0, 0, 1, 1, 0, 0]
    assert [t[i]["loss_scale"] for i in (2, 3, 4, 5)] == [1024, 1024, 1024, 512]
    assert t[5]["lr"] == t[3]["lr"]  # two skipped steps: the schedule stood still
    assert all(math.isfinite(t[i]["loss"]) for i in t) and t[6]["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.loss_scaler.scale == 512


def test_bf16_nan_stops_with_the_iteration(dataset, tmp_path, capsys):
    r = small_recipe(tmp_path, dataset, "train.precision=bf16", "checkpoint.save_interval=2")

    def inject(trainer):
        def poison(module, inputs, output):
            return output * math.nan if trainer.state.iteration + 1 == 3 else output
        trainer.model.encoder.register_forward_hook(poison)

    assert train(r, on_built=inject) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "non-finite loss or gradient at iteration 3" in err and "bf16" in err
    rd = run_dir(r)
    assert json.load(open(os.path.join(rd, "train_status.json")))["status"] == "failed"
    # the last good checkpoint (2) stays the latest: nothing was saved after the NaN
    assert open(os.path.join(rd, "checkpoints", "latest_checkpointed_iteration.txt")).read().strip() == "2"


def test_bad_recipe_exits_2(dataset, tmp_path, capsys):
    from hpcmeg.cli import main

    args = ["train", TINY, "--set", f"run.output_root={tmp_path}", "--set", f"data.data_path=[{dataset}]",
            "--set", "data.split=949,50,0", "--set", "cluster.cpu_tasks_per_node=1", "--set", "train.train_iters=5"]  # warmup 20 > 5 iters
    assert main(args) == EXIT_BAD_RECIPE
    assert "shorten the warmup" in capsys.readouterr().err
    assert main(args[:-2] + ["--set", "train.train_iters=50", "--set", "train.global_batch_size=6"]) == EXIT_BAD_RECIPE


def test_prepare_cache_then_train_hits_the_cache(dataset, tmp_path, capsys):
    from hpcmeg.cli import main

    sets = [f"run.output_root={tmp_path}", "run.name=t", f"data.data_path=[{dataset}]", *SMALL]
    assert main(["prepare-cache", TINY] + [x for s in sets for x in ("--set", s)]) == EXIT_OK
    assert "index cache ready" in capsys.readouterr().out
    cache = os.path.join(str(tmp_path), "t", "index-cache")
    before = {f: os.path.getmtime(os.path.join(cache, f)) for f in os.listdir(cache) if f.endswith(".npy")}
    assert len(before) == 6  # train + valid: document/sample/shuffle indices
    assert train(small_recipe(tmp_path, dataset)) == EXIT_OK
    after = {f: os.path.getmtime(os.path.join(cache, f)) for f in os.listdir(cache) if f.endswith(".npy")}
    assert after == before  # same requested counts -> same keys -> nothing rebuilt


def test_one_step_in_flight_keeps_logs_and_stops_exact(dataset, tmp_path, capsys):
    """The loop checks iteration k after queueing k+1 (no host sync per step). With log_interval 3
    every window's loss is the mean of the same per-step losses a log_interval-1 run logs, the
    weights are identical, and a NaN on a non-boundary iteration (3: not a log/eval/save one) is
    still reported as iteration 3 with nothing saved after the last good checkpoint."""
    per_step = small_recipe(tmp_path, dataset, "train.train_iters=9", name="every")
    windows = small_recipe(tmp_path, dataset, "train.train_iters=9", "train.log_interval=3", name="win")
    weights = {}
    for r in (per_step, windows):
        def keep(trainer, r=r):
            weights[r.run.name] = trainer.model
        assert train(r, on_built=keep) == EXIT_OK
    a = [x["loss"] for x in read_metrics(os.path.join(run_dir(per_step), "metrics.jsonl"))["train"]]
    b = read_metrics(os.path.join(run_dir(windows), "metrics.jsonl"))["train"]
    assert [x["iteration"] for x in b] == [3, 6, 9]
    for k, rec in enumerate(b):
        assert rec["loss"] == pytest.approx(sum(a[3 * k:3 * k + 3]) / 3, rel=1e-6)
    for (n1, p1), (n2, p2) in zip(weights["every"].named_parameters(), weights["win"].named_parameters()):
        assert torch.equal(p1, p2), n1

    r = small_recipe(tmp_path, dataset, "train.precision=bf16", "checkpoint.save_interval=2",
                     "train.log_interval=5", name="nan")

    def inject(trainer):
        def poison(module, inputs, output):
            return output * math.nan if trainer.state.iteration + 1 == 3 else output
        trainer.model.encoder.register_forward_hook(poison)

    assert train(r, on_built=inject) == EXIT_ERROR
    assert "non-finite loss or gradient at iteration 3" in capsys.readouterr().err
    assert open(os.path.join(run_dir(r), "checkpoints", "latest_checkpointed_iteration.txt")).read().strip() == "2"


def test_auto_attention_is_triton_on_hopper_with_16_bit_training_only():
    """The recipe's attention_backend 'auto' becomes hpcmeg's Triton attention where it was timed
    faster than cuDNN (compute capability 9.x, bf16/fp16); elsewhere (older or newer GPUs, fp32, CPU)
    it stays 'auto' (SDPA), and an explicit choice is never changed."""
    from hpcmeg.kernels import attention as triton_attention

    if triton_attention.triton is None:
        pytest.skip("no triton")
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert attention_backend_for("auto", gpu, "bf16", capability=(9, 0)) == "triton"
    assert attention_backend_for("auto", gpu, "fp16", capability=(9, 0)) == "triton"
    assert attention_backend_for("auto", gpu, "bf16", capability=(10, 0)) == "auto"  # Blackwell: never timed
    assert attention_backend_for("auto", gpu, "bf16", capability=(8, 0)) == "auto"
    assert attention_backend_for("auto", gpu, "fp32", capability=(9, 0)) == "auto"
    assert attention_backend_for("auto", cpu, "bf16") == "auto"
    assert attention_backend_for("cudnn", gpu, "bf16", capability=(9, 0)) == "cudnn"
    assert attention_backend_for("triton", cpu, "fp32") == "triton"
