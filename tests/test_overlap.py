"""The data-parallel reduction overlapped with the backward (hpcmeg/parallel/overlap.py): with each
transformer layer compiled on its own and the sunk weights reported by markers, a bucket's
collective starts while earlier layers' backward still runs; the sums are the same as without.

The timeline is recorded in one process (the buffer decides when to launch whatever the data-parallel
size; at DP 1 a launch is the decision alone); DP 2 on gloo checks that the reported launches give
the same gradients as one process, bit for bit (fp32, eager).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch._dynamo.utils

from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.parallel import overlap
from hpcmeg.parallel.context import context_for
from hpcmeg.train.optim import AdamWConfig, build_optimizer
from hpcmeg.train.step import TrainStep
from test_wgrad import fused_gpt, micro_batches

BUCKET = 20_000  # about one layer of the tiny model per bucket


def _record(buf) -> list[tuple]:
    """(event, what) in the order the buffer saw them: 'done' = a layer's sunk weights reported,
    'launch' = a bucket's reduction started."""
    events = []
    launch, done = buf._launch, buf.sunk_done
    buf._launch = lambda b: (events.append(("launch", b)), launch(b))[1]
    buf.sunk_done = lambda ps: (events.append(("done", len(ps))), done(ps))[1]
    return events


def _step(compile_layers: bool, compile: bool = True, layers: int = 4):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    m = fused_gpt(layers=layers)
    buf, opt = build_optimizer(m, AdamWConfig(1e-3), bucket_numel=BUCKET, wgrad_fusion=True)
    if compile_layers or not compile:
        overlap.report_sunk_weights(m, buf)
    step = TrainStep(m, buf, opt, precision="fp32", compile=compile, device="cpu", compile_layers=compile_layers)
    events = _record(buf)
    result = step.run(micro_batches(1))
    return buf, events, result, buf.grad_data.clone()


def test_buckets_start_during_the_backward_when_layers_compile_alone():
    buf, events, result, grads = _step(compile_layers=True)
    sunk_layer_buckets = [i for i, bk in enumerate(buf.buckets) if bk.sunk and len(bk.params) > 1]
    assert len(sunk_layer_buckets) >= 2
    last_layer_done = max(i for i, e in enumerate(events) if e[0] == "done")  # layer 0's backward, the last
    assert sum(e[0] == "done" for e in events) == 4  # one report per layer
    early = [e[1] for e in events[:last_layer_done] if e[0] == "launch"]
    assert early and early[0] == 0  # the first bucket started before the layers' backward ended
    assert [e[1] for e in events if e[0] == "launch"] == list(range(len(buf.buckets)))  # in index order
    # the layers share their compiled code: the first (which computes its own input LayerNorm),
    # the middle ones and the last (which ends in the final LayerNorm) are three graphs, not four
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
    eager = _step(compile_layers=False, compile=False)
    assert [e[0] for e in eager[1]].count("done") == 4  # eager layers report the same way
    assert result.loss == pytest.approx(eager[2].loss, rel=1e-5)
    # the main grads (every sunk weight's written by its GEMMs inside the compiled backward) agree:
    # the same math, other reduction orders (tests/TOLERANCES.md case 2)
    torch.testing.assert_close(grads, eager[3], rtol=1e-5, atol=1e-5)


def _dp_case(rank, world, report):
    import torch.distributed as dist

    m = fused_gpt(layers=3)
    ctx = context_for(ParallelDims(world), rank, rank, "cpu")
    buf, opt = build_optimizer(m, AdamWConfig(1e-2), ctx, bucket_numel=BUCKET, wgrad_fusion=True)
    if report:
        overlap.report_sunk_weights(m, buf)
    step = TrainStep(m, buf, opt, precision="fp32", device="cpu", dp_size=world)
    events = _record(buf)
    mbs = micro_batches(2 * world)[rank::world]  # this rank's two micro batches of each step
    hist = []
    for _ in range(2):
        events.clear()
        hist.append(step.run(mbs).grad_norm)
    dist.barrier()
    dones = [i for i, e in enumerate(events) if e[0] == "done"]
    return {"hist": hist, "weights": {k: v.clone() for k, v in m.state_dict().items()},
            "early": report and any(e[0] == "launch" for e in events[:dones[-1]])}


@pytest.mark.dist
def test_reported_launches_give_the_same_dp2_gradients_bit_for_bit(dist_pool):
    plain, reported = (dist_pool(2).run(_dp_case, r) for r in (False, True))
    assert all(r["early"] for r in reported)  # the buckets did start inside the backward
    for a, b in zip(plain, reported):
        assert a["hist"] == b["hist"]
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_a_layer_forked_by_tensor_parallelism_stays_on_the_tp_stream_when_compiled_alone():
    """Sequence parallelism runs each layer's dropout on the TP RNG stream (hpcmeg/parallel/tensor.py
    enters it around every call of the layer); compiling the layer alone (compile_layers replaces
    its forward) keeps that: the default stream does not move, the TP stream does."""
    from hpcmeg.parallel.random import RNGStreams
    from hpcmeg.parallel.tensor import _fork_around_calls

    m = fused_gpt(layers=1)
    m.encoder.layers[0].dropout.p = 0.5
    rng = RNGStreams(7, 1, "cpu")
    _fork_around_calls(m.encoder.layers[0], rng)
    overlap.compile_layers(m, backend="eager")
    x = torch.randn(2, 16, 32)
    default, tp = torch.get_rng_state(), rng.state_dict()["model-parallel-rng"]
    m.encoder(x)
    assert torch.equal(torch.get_rng_state(), default)
    assert not torch.equal(rng.state_dict()["model-parallel-rng"], tp)
