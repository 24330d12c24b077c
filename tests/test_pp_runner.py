"""The pipeline runner and P2P (hpcmeg/parallel/pipeline/) on real gloo process groups.

A toy model (8 blocks of Linear(16, 16) + tanh, fp32, init from a seed) is cut into Megatron's
chunks and trained one step under 1F1B and the interleaved schedule; the summed loss and every
parameter's gradient must equal the one-process model's accumulated over the same micro batches.
Tolerance: bitwise. Each block runs the same CPU kernels on the same [mb, s, h] tensors in both
runs (one thread, as the pool sets), the gradient flowing into a stage is the same tensor the
one-process backward computes at that layer, and each parameter accumulates its micro batches in
the same order 0..M-1 (the schedule's backward order per chunk), so no sum is reordered.
Measured: max |difference| 0.0 for losses and gradients in every case below.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.parallel.pipeline.p2p import PipelineP2P
from hpcmeg.parallel.pipeline.runner import StepTimer, run_schedule
from hpcmeg.parallel.pipeline.schedule import chunk_layers, make_schedule, no_pipeline

LAYERS, MB, SEQ, HID = 8, 2, 3, 16


def toy_model(seed: int) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(LAYERS):
        lin = nn.Linear(HID, HID)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(HID, HID, generator=g) * HID ** -0.5)
            lin.bias.copy_(torch.randn(HID, generator=g) * 0.1)
        blocks.append(nn.Sequential(lin, nn.Tanh()))
    return nn.Sequential(*blocks)


def micro_batches(M: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    return [{"x": torch.randn(MB, SEQ, HID, generator=g), "y": torch.randn(MB, SEQ, HID, generator=g)}
            for _ in range(M)]


def loss_fn(out: torch.Tensor, mb: dict, M: int) -> torch.Tensor:
    return ((out - mb["y"]) ** 2).sum() / (M * MB * SEQ * HID)  # normalised over the whole step


def reference(M: int, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process: a loop over micro batches, grads accumulated in .grad."""
    model, batches = toy_model(seed), micro_batches(M, seed)
    total = None
    for mb in batches:
        loss = loss_fn(model(mb["x"]), mb, M)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def _pipeline_case(rank: int, world: int, pp: int, vpp: int, M: int, seed: int) -> dict:
    """One step on every rank; PP groups from the rank grid (world // pp of them, same data)."""
    import torch.distributed as dist

    dims = ParallelDims(world, pp=pp)
    pp_rank = dims.coords(rank).pp
    groups = dims.groups()["pp"]
    mine, group = next(m for m in groups if rank in m), None
    if pp < world:
        for members in groups:  # every rank creates every group, in the same order
            pg = dist.new_group(ranks=members)
            group = pg if rank in members else group
    full = toy_model(seed)
    layers = [list(chunk_layers(LAYERS, pp, vpp, pp_rank, v)) for v in range(vpp)]
    chunks = [nn.Sequential(*[copy.deepcopy(full[i]) for i in ls]) for ls in layers]
    p2p = PipelineP2P(mine, pp_rank, (MB, SEQ, HID), torch.float32, "cpu", group)
    done, timer = [], StepTimer("cpu")
    loss = run_schedule(make_schedule(pp, pp_rank, M, vpp), chunks, micro_batches(M, seed),
                        lambda out, mb: loss_fn(out, mb, M), p2p, first_input=lambda mb: mb["x"],
                        after_backward=lambda c, mb: done.append((c, mb)), on_action=timer)
    grads = {}
    for ls, chunk in zip(layers, chunks):
        for local, i in enumerate(ls):
            for name, p in chunk[local].named_parameters():
                grads[f"{i}.{name}"] = p.grad.clone()
    t = timer.result()
    if pp < world:
        dist.barrier()
    return {"loss": loss, "grads": grads, "done": done, "timing": (t.step_s, t.compute_s, t.bubble)}


CASES = [(2, 2, 1, 1), (2, 2, 1, 2), (2, 2, 1, 4), (2, 2, 1, 5), (2, 2, 2, 2), (2, 2, 2, 4),
         (4, 4, 1, 8), (4, 4, 2, 4), (4, 4, 2, 8), (4, 2, 1, 4)]


@pytest.mark.parametrize("world,pp,vpp,M", CASES)
def test_pipeline_step_equals_one_process(dist_pool, world, pp, vpp, M):
    seed = 7 + M
    results = dist_pool(world).run(_pipeline_case, pp, vpp, M, seed, timeout=60)
    ref_loss, ref_grads = reference(M, seed)
    got: dict[str, torch.Tensor] = {}
    for rank, res in enumerate(results):
        _, dp_rank, pp_rank = ParallelDims(world, pp=pp).coords(rank)
        if pp_rank == pp - 1:
            assert torch.equal(res["loss"], ref_loss), f"rank {rank}: loss {res['loss']} vs {ref_loss}"
        else:
            assert res["loss"] is None
        want_done = {(v, mb) for v in range(vpp) for mb in range(M)}
        assert sorted(res["done"]) == sorted(want_done) and len(res["done"]) == len(want_done)
        for v in range(vpp):  # each chunk's backwards run in micro-batch order (the accumulation order)
            assert [mb for c, mb in res["done"] if c == v] == list(range(M))
        step_s, compute_s, bubble = res["timing"]
        assert 0 < compute_s <= step_s and 0 <= bubble <= 1
        for name, g in res["grads"].items():
            assert name not in got or dp_rank > 0, f"{name} on two stages"
            assert torch.equal(g, ref_grads[name]), f"rank {rank} {name}: max diff {(g - ref_grads[name]).abs().max()}"
            got[name] = g
    assert sorted(got) == sorted(ref_grads)


def test_no_pipeline_runs_without_p2p_and_equals_the_loop():
    M, seed = 3, 11
    model, done = toy_model(seed), []
    loss = run_schedule(no_pipeline(M), [model], micro_batches(M, seed), lambda o, mb: loss_fn(o, mb, M),
                        first_input=lambda mb: mb["x"], after_backward=lambda c, mb: done.append(mb))
    ref_loss, ref_grads = reference(M, seed)
    assert torch.equal(loss, ref_loss) and done == [0, 1, 2]
    assert all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters())


def test_p2p_refuses_a_tensor_of_another_shape_or_dtype_before_the_wire():
    p2p = PipelineP2P([0, 1], 0, (MB, SEQ, HID), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"exchange \(2, 3, 16\) torch.float32"):
        p2p.send(torch.zeros(MB, SEQ + 1, HID), 1)
    with pytest.raises(ValueError, match="bfloat16"):
        p2p.send(torch.zeros(MB, SEQ, HID, dtype=torch.bfloat16), 1)
    with pytest.raises(ValueError, match="cannot talk to pipeline rank 0"):
        p2p.recv(0)


def test_runner_reports_a_schedule_that_leaves_tensors_behind():
    from hpcmeg.parallel.pipeline.schedule import Action

    model = toy_model(0)
    with pytest.raises(RuntimeError, match="left tensors unused: .*0, 0"):
        run_schedule([Action("F", 0, 0, 0)], [model], micro_batches(1, 0), lambda o, mb: loss_fn(o, mb, 1),
                     first_input=lambda mb: mb["x"])
