"""ParallelDims (hpcmeg/megatron/parallel_dims.py): sizes, batch and model fit, accumulation, and the same
rules seen through `hpcmeg validate` (one line per problem, naming the recipe key) and the train job's
check of the processes actually running. No torch, no processes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from hpcmeg.megatron.parallel_dims import NOT_IMPLEMENTED, ParallelDims
from hpcmeg.recipe import RecipeError, derive, load_recipe

TINY = str(REPO / "recipes" / "codeparrot_tiny.yaml")


def keys(problems):
    return [k for k, _ in problems]


def test_sizes_batch_and_model_fit():
    assert ParallelDims(8, tp=2, pp=2).dp == 2
    assert keys(ParallelDims(6, tp=4).problems(check_implemented=False)) == ["cluster.nodes"]
    assert keys(ParallelDims(4, tp=0).problems()) == ["parallel.tensor"]
    assert keys(ParallelDims(2, sequence_parallel=True).problems()) == ["parallel.sequence_parallel"]
    assert keys(ParallelDims(4, pp=1, vpp=2).problems()) == ["parallel.virtual_pipeline"]
    assert ParallelDims(8).problems() == [] and ParallelDims(8, distributed_optimizer=True).problems() == []
    (k, text), = ParallelDims(8).batch_problems(190, 12)
    assert k == "train.global_batch_size" and "96" in text and "192" in text  # a multiple and a nearby value
    assert ParallelDims(8).grad_accum(192, 12) == 2
    with pytest.raises(ValueError):
        ParallelDims(8).grad_accum(190, 12)
    fit = ParallelDims(4, tp=4, pp=1, sequence_parallel=True).model_problems(
        num_layers=5, num_attention_heads=6, ffn_hidden_size=10, seq_length=30)
    assert keys(fit) == ["model.num_attention_heads", "model.ffn_hidden_size", "data.seq_length"]
    assert keys(ParallelDims(4, pp=2, vpp=2).model_problems(num_layers=6, num_attention_heads=4, ffn_hidden_size=8,
                                                           seq_length=8)) == ["model.num_layers"]


def test_not_implemented_layouts_are_refused_until_they_land():
    assert ParallelDims(4, tp=2, sequence_parallel=True).problems() == []  # tensor parallelism has landed
    assert ParallelDims(8, tp=2, pp=2, vpp=2).problems() == []  # and pipeline parallelism
    assert NOT_IMPLEMENTED == {}


def test_a_tensor_parallel_group_across_nodes_is_warned_about():
    # 2 nodes x 8 GPUs: TP8 and TP4 groups stay inside a node; TP16 spans both; TP 3 splits groups
    assert ParallelDims(16, tp=8).placement_warnings(8, nodes=2) == []
    assert ParallelDims(16, tp=4, pp=2).placement_warnings(8, nodes=2) == []
    (w,) = ParallelDims(16, tp=16).placement_warnings(8, nodes=2)
    assert "parallel.tensor=16" in w and "span nodes" in w
    assert ParallelDims(12, tp=3).placement_warnings(4, nodes=3) != []
    assert ParallelDims(8, tp=8).placement_warnings(8, nodes=1) == []  # one node: nothing to cross
    # and the group members really are one node's ranks when tp divides the ranks per node
    for tp in (1, 2, 4, 8):
        for group in ParallelDims(16, tp=tp).groups()["tp"]:
            assert len({rank // 8 for rank in group}) == 1


@pytest.mark.parametrize("sets,key", [
    (["parallel.tensor=2", "cluster.cpu_tasks_per_node=2", "model.num_attention_heads=3", "model.hidden_size=126"],
     "model.num_attention_heads"),
    (["parallel.pipeline=2", "cluster.cpu_tasks_per_node=2", "model.num_layers=3"], "model.num_layers"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["cluster.cpu_tasks_per_node=3"], "train.global_batch_size"),
    (["parallel.tensor=4", "cluster.cpu_tasks_per_node=2"], "cluster.nodes"),
])
def test_validate_gives_one_line_naming_the_key(sets, key):
    with pytest.raises(RecipeError) as e:
        load_recipe(TINY, sets)
    (line,) = e.value.problems
    assert line.startswith("--set") or key in line
    assert key in line


def test_validate_cli_refuses_an_interleaved_schedule_it_cannot_run(tmp_path):
    """PP2 x V2 needs a multiple of 2 micro batches per step (Megatron's rule): 3 is refused in one line
    naming train.global_batch_size and the counts that work (the inputs exist: nothing else is wrong)."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"content": "print(1)"}\n')
    r = subprocess.run([sys.executable, "-m", "hpcmeg.cli", "validate", TINY, "--set", "parallel.pipeline=2",
                        "--set", "parallel.virtual_pipeline=2", "--set", "cluster.cpu_tasks_per_node=2",
                        "--set", "train.global_batch_size=12", "--set", "train.micro_batch_size=4",
                        "--set", f"data.inputs=[{corpus}]", "--set", f"run.output_root={tmp_path}/runs"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "train.global_batch_size" in r.stderr and "use 2 or 4 micro batches" in r.stderr
    assert "Traceback" not in r.stderr


def test_derive_uses_the_same_dp_and_accumulation():
    r = load_recipe(TINY, ["cluster.cpu_tasks_per_node=2", "train.global_batch_size=16", "train.micro_batch_size=4",
                           "parallel.distributed_optimizer=true"])
    d = derive(r)
    assert (d.world_size, d.data_parallel_size, d.grad_accum_steps) == (2, 2, 2)


def test_the_running_processes_are_checked_by_the_same_rules():
    from hpcmeg.train.build import runtime_layout

    r = load_recipe(TINY, ["train.global_batch_size=8", "train.micro_batch_size=4"])
    dims, d = runtime_layout(r, 1)
    assert (dims.dp, d.grad_accum_steps, d.world_size) == (1, 2, 1)
    with pytest.raises(RecipeError) as e:
        runtime_layout(r, 3)
    (line,) = e.value.problems
    assert line.startswith("train.global_batch_size") and "3 processes are running" in line
