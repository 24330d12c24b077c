"""Parallel layouts through the real local Slurm cluster: `hpcmeg submit --stages train` on 2
emulated nodes, compared with one process training the same recipe in this test.
- TP2 x DP2 over 2 nodes x 2 tasks (TP inside a node, DP across): losses and norms rtol 1e-5.
- PP2 x DP2 over 2 nodes x 2 tasks (a stage per node): losses and norms rtol 1e-5.

- DP2 over 2 nodes x 1 task with the distributed optimizer (gloo between the two slurmd "nodes"):
  the losses equal the single process's (accumulation 2) to fp32 round-off of the logged DP mean,
  and the final weights bit for bit (the two micro batches' gradients are summed once either way;
  the norm is layout-independent, see hpcmeg/train/flat_adamw.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from conftest import REPO
from hpcmeg.checkpoint.store import load_checkpoint
from hpcmeg.megatron.names import EXIT_OK
from hpcmeg.train.entry import train
from hpcmeg.train.metrics import read_metrics
from cli_helpers import TINY, hpcmeg, sets, status

pytestmark = [pytest.mark.slurm, pytest.mark.dist]


def _weights(rd: str) -> dict[str, torch.Tensor]:
    it, st = load_checkpoint(os.path.join(rd, "checkpoints"), tp_rank=0, pp_rank=0, tp_size=1, pp_size=1)
    lm = st["model"]["language_model"]
    out = {f"encoder.{k}": v for k, v in lm["encoder"].items()}
    out.update({f"embedding.{t}.weight": v["weight"] for t, v in lm["embedding"].items()})
    return out


def _slurm_then_one_process(tmp_path, tiny_dataset, *, both=(), slurm=(), one=(), tasks_per_node, slurm_start,
                            one_start=None, rel, timeout=500):
    """The tiny recipe (6 iterations, a log line each, no checkpoints, plus ``both``) trained twice:
    `hpcmeg submit --stages train --wait` on 2 emulated nodes x ``tasks_per_node`` tasks (plus ``slurm``),
    then one process in this test (plus ``one``). Asserts the Slurm run COMPLETED, its start record has
    ``slurm_start`` (the one process's has ``one_start``), and both logged the same losses and gradient
    norms to ``rel``. Returns (Slurm run dir, its metrics, one-process run dir, its metrics)."""
    from hpcmeg.recipe import load_recipe

    over = TINY + [f"data.data_path=[{tiny_dataset}]", "train.train_iters=6", "train.log_interval=1",
                   "checkpoint.save_interval=0", *both]
    on_slurm = over + ["run.output_root=" + str(tmp_path / "slurm"), "cluster.nodes=2",
                       f"cluster.cpu_tasks_per_node={tasks_per_node}", *slurm]
    hpcmeg("submit", str(REPO / "recipes" / "codeparrot_tiny.yaml"), "--profile", "local-slurm", *sets(on_slurm),
           "--stages", "train", "--wait", cwd=tmp_path, timeout=timeout)
    rd = tmp_path / "slurm" / "codeparrot-tiny"
    assert status(rd)["stages"]["train"]["state"] == "COMPLETED"
    m = read_metrics(str(rd / "metrics.jsonl"))
    start = m["start"][0]
    assert {k: start[k] for k in slurm_start} == slurm_start

    r = load_recipe(str(REPO / "recipes" / "codeparrot_tiny.yaml"),
                    over + ["run.output_root=" + str(tmp_path / "one"), "cluster.cpu_tasks_per_node=1", *one])
    torch.set_num_threads(1)
    assert train(r) == EXIT_OK
    one_rd = tmp_path / "one" / "codeparrot-tiny"
    one_m = read_metrics(str(one_rd / "metrics.jsonl"))
    one_start = one_start or {}
    assert {k: one_m["start"][0][k] for k in one_start} == one_start
    assert [x["loss"] for x in m["train"]] == pytest.approx([x["loss"] for x in one_m["train"]], rel=rel)
    assert [x["grad_norm"] for x in m["train"]] == pytest.approx([x["grad_norm"] for x in one_m["train"]], rel=rel)
    return rd, m, one_rd, one_m


def test_dp2_on_two_nodes_with_distributed_optimizer_matches_one_process(slurm_cluster, tmp_path, tiny_dataset):
    rd, m, one_rd, _ = _slurm_then_one_process(
        tmp_path, tiny_dataset, both=["parallel.distributed_optimizer=true"],
        one=["parallel.distributed_optimizer=false"], tasks_per_node=1,
        slurm_start={"world_size": 2, "data_parallel_size": 2, "grad_accum_steps": 1},
        one_start={"grad_accum_steps": 2}, rel=1e-6, timeout=400)
    assert m["start"][0]["distributed_optimizer"] is True
    assert "--nodes=2" in (rd / "scripts" / "train.sbatch").read_text()
    assert sorted(p.name.split(".")[-2] for p in (rd / "logs" / "train").glob("train.*.r0.*.log")) == ["0", "1"]
    a, b = _weights(str(rd)), _weights(str(one_rd))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tp2_inside_a_node_dp2_across_nodes_matches_one_process(slurm_cluster, tmp_path, tiny_dataset):
    """2 emulated nodes x 2 tasks: TP groups are consecutive ranks ([0, 1] on node1, [2, 3] on node2),
    DP across the nodes. Padded vocabulary 50432 in both layouts (divisible by 256 at TP1, 128 x 2)."""
    rd, *_ = _slurm_then_one_process(
        tmp_path, tiny_dataset, both=["train.global_batch_size=4", "train.micro_batch_size=2"],
        slurm=["parallel.tensor=2", "model.make_vocab_size_divisible_by=128"],
        one=["model.make_vocab_size_divisible_by=256"], tasks_per_node=2,
        slurm_start={"world_size": 4, "tensor_parallel_size": 2, "data_parallel_size": 2}, rel=1e-5)
    assert sorted(p.name for p in (rd / "checkpoints" / "iter_0000006").iterdir() if p.name.startswith("mp_rank")) \
        == ["mp_rank_00", "mp_rank_01"]


def test_pp2_dp2_on_two_nodes_matches_one_process(slurm_cluster, tmp_path, tiny_dataset):
    """2 emulated nodes x 2 tasks, PP2 x DP2 (stage 0 on node1, stage 1 on node2: activations cross the
    'network'), 1F1B with 2 micro batches per DP rank, against one process with 4."""
    rd, *_ = _slurm_then_one_process(
        tmp_path, tiny_dataset,
        both=["train.global_batch_size=8", "train.micro_batch_size=2", "model.num_layers=2"],
        slurm=["parallel.pipeline=2"], tasks_per_node=2,
        slurm_start={"world_size": 4, "pipeline_parallel_size": 2, "data_parallel_size": 2}, rel=1e-5)
    assert sorted(p.name for p in (rd / "checkpoints" / "iter_0000006").iterdir() if p.name.startswith("mp_rank")) \
        == ["mp_rank_00_000", "mp_rank_00_001"]
