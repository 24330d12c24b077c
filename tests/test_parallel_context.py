"""tp-dp-pp rank grid (Megatron's order) and real gloo process groups built from it."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from hpcmeg.megatron.parallel_dims import ParallelDims


def test_megatron_docstring_example():
    # parallel_state.py's example: 16 GPUs, tp 2, pp 4 -> dp 2
    g = ParallelDims(16, tp=2, pp=4).groups()
    assert g["tp"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert g["dp"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"][:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert g["embedding"][:2] == [[0, 12], [1, 13]]  # first and last stage of each pipeline


@pytest.mark.parametrize("world,tp,pp", [(16, 2, 4), (8, 1, 1), (12, 3, 2), (8, 8, 1)])
def test_coords_invert_the_formula_and_groups_partition(world, tp, pp):
    dims = ParallelDims(world, tp=tp, pp=pp)
    dp = dims.dp
    for rank in range(world):
        t, d, p = dims.coords(rank)
        assert rank == t + tp * (d + dp * p) == dims.rank_of(t, d, p)
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp)):
        groups = dims.groups()[kind]
        assert sorted(r for grp in groups for r in grp) == list(range(world))
        assert all(len(grp) == size for grp in groups)
    assert dims.groups()["embedding"] == ([] if pp == 1 else [[g[0], g[-1]] for g in dims.groups()["pp"]])


def test_indivisible_world_is_a_problem_line():
    probs = ParallelDims(6, tp=4).problems(check_implemented=False)
    assert probs and probs[0][0] == "cluster.nodes" and "not divisible" in probs[0][1]


WORKER = r"""
import json, sys, torch
from hpcmeg.procenv import dist_env
from hpcmeg.parallel.context import init_distributed
from hpcmeg.megatron.parallel_dims import ParallelDims
e = dist_env()
ctx = init_distributed(ParallelDims(e.world_size, tp=2), rank=e.rank, local_rank=e.local_rank,
                       master_addr=e.master_addr, master_port=e.master_port, device="cpu")
m = ctx.all_reduce_max(ctx.rank * 10)
t = torch.tensor([float(ctx.rank)])
ctx.dp_mean_(t)  # dp group of rank r = {r % 2, r % 2 + 2}
ctx.barrier()
print(json.dumps({"rank": ctx.rank, "max": m, "dp_mean": t.item(), "members": ctx.members,
                  "coords": [ctx.tp_rank, ctx.dp_rank, ctx.pp_rank], "backend": ctx.backend}))
ctx.destroy()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_gloo_groups_four_ranks():
    port, world = _free_port(), 4
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    outs.sort(key=lambda o: o["rank"])
    for o in outs:
        r = o["rank"]
        assert o["backend"] == "gloo" and o["max"] == 30
        assert o["coords"] == [r % 2, r // 2, 0]
        assert o["members"]["tp"] == [r - r % 2, r - r % 2 + 1]
        assert o["members"]["dp"] == [r % 2, r % 2 + 2]
        assert o["dp_mean"] == pytest.approx((r % 2 + r % 2 + 2) / 2)
