"""Tensor (and sequence) parallelism of the whole GPT on gloo process pools (fp32, dropout 0, CPU).

- partition = checkpoint partition: after parallelize_tensor, rank r's state_dict is exactly the
  r-th split (convert/merge.split_tp, the reshard rule) of the TP1 model's, bitwise;
- TP2 == TP1: the loss and every gathered gradient at step 1, the gradient norm; then 5 AdamW
  steps with clipping through the real TrainStep + buffer + FlatAdamW;
- TP2 + sequence parallelism == TP2; TP2 x DP2 on 4 processes == 1 process; compiled == eager.
Tolerances, from the arithmetic: a TP rank computes partial dot products (a row-parallel layer sums
over h/tp features, then an all-reduce adds the tp partial sums), so sums run in another order:
fp32 round-off of ~1e-7 relative per op, ~1e-6 after a forward/backward (loss rtol 1e-6, gradients
rtol 1e-5 atol 1e-7, the design doc's bounds). After 5 Adam steps: losses and gradient norms rtol
1e-5; weights elementwise see assert_weights_close (Adam turns round-off in near-zero gradients
into steps of ~lr).
Vocabulary 500 pads to 512 at TP 1, 2 and 4 (make_vocab_size_divisible_by 128): one model for every
layout (with GPT-2's 50257 the padded size changes with TP, and the models differ).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from helpers import random_batches
from hpcmeg.convert.merge import split_tp
from hpcmeg.megatron.layout import tp_split_dim
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.model.gpt import GPT
from hpcmeg.parallel.context import context_for
from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.parallel.tensor import parallelize_tensor
from hpcmeg.train.optim import AdamWConfig, build_optimizer, param_roles
from hpcmeg.train.step import TrainStep

pytestmark = pytest.mark.dist

HEADS, SEQ, MB = 4, 32, 2
CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=HEADS, ffn_hidden_size=256, max_position_embeddings=SEQ,
           padded_vocab_size=512, vocab_size=500, hidden_dropout=0.0, attention_dropout=0.0)


def model(seed: int = 3, fused: bool = False) -> GPT:
    return build_gpt(GPTConfig(**CFG, fused=fused), init_seed=seed)


def batches(n: int, rows: int, seed: int = 11):
    return random_batches(n, rows, SEQ, 500, seed)


def gathered(name: str, t: torch.Tensor, group, tp: int) -> torch.Tensor:
    """The full tensor of a TP-sharded parameter (or gradient) from every rank's chunk."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# ------------------------------------------------------------------------------------ process cases

def _partition_case(rank, world):
    ctx = context_for(ParallelDims(world, tp=world), rank, rank, "cpu")
    m = model()
    full = {k: v.clone() for k, v in m.state_dict().items()}
    parallelize_tensor(m, ctx)
    want = split_tp(full, world, HEADS)[rank]
    got = m.state_dict()
    assert got.keys() == want.keys()
    return all(torch.equal(got[k], want[k]) for k in want)


def _grads_case(rank, world, tp, sp):
    """One forward/backward of the global batch; returns loss, gathered grads, and the grad norm."""
    ctx = context_for(ParallelDims(world, tp=tp, sequence_parallel=sp), rank, rank, "cpu")
    m = model()
    plan = parallelize_tensor(m, ctx, sequence_parallel=sp)
    (x, y), = batches(1, MB * ctx.dp_size)
    xs, ys = x[ctx.dp_rank * MB:(ctx.dp_rank + 1) * MB], y[ctx.dp_rank * MB:(ctx.dp_rank + 1) * MB]
    loss = m(xs, ys).mean()
    loss.backward()
    for p in m.parameters():  # under SP, LayerNorm and row-parallel bias grads are partial (the buffer sums them)
        if id(p) in plan.partial_grads:
            dist.all_reduce(p.grad, group=ctx.tp_group)
    grads = {n: gathered(n, p.grad, ctx.tp_group, tp) for n, p in m.named_parameters()}
    # the global norm the optimizer will compute, through the real buffer path
    m2 = model()
    plan2 = parallelize_tensor(m2, ctx, sequence_parallel=sp)
    roles = param_roles(partial=plan2.partial_grads, replicated=plan2.replicated)
    buf, opt = build_optimizer(m2, AdamWConfig(0.0), ctx, roles)
    step = TrainStep(m2, buf, opt, "fp32", grad_clip=0.0, device="cpu", dp_size=ctx.dp_size)
    res = step.run([(xs, ys)])
    return {"loss": loss.item(), "grads": grads, "norm": res.grad_norm}


def _train_case(rank, world, tp, sp, steps, distributed, compiled=False, sink=False):
    ctx = context_for(ParallelDims(world, tp=tp, sequence_parallel=sp, distributed_optimizer=distributed),
                      rank, rank, "cpu")
    m = model(fused=sink)
    plan = parallelize_tensor(m, ctx, sequence_parallel=sp)
    roles = param_roles(partial=plan.partial_grads, replicated=plan.replicated)
    buf, opt = build_optimizer(m, AdamWConfig(1e-3), ctx, roles, wgrad_fusion=sink)
    step = TrainStep(m, buf, opt, "fp32", grad_clip=1.0, device="cpu", dp_size=ctx.dp_size, compile=compiled)
    hist = []
    for x, y in batches(steps, MB * ctx.dp_size):
        xs, ys = x[ctx.dp_rank * MB:(ctx.dp_rank + 1) * MB], y[ctx.dp_rank * MB:(ctx.dp_rank + 1) * MB]
        r = step.run([(xs, ys)])
        hist.append((r.loss, r.grad_norm))
    weights = {n: gathered(n, p.detach(), ctx.tp_group, tp) for n, p in m.named_parameters()}
    return {"hist": hist, "weights": weights}


def reference(steps: int, rows: int, fused: bool = False):
    """One process, the same global batches (accumulated when rows > MB)."""
    m = model(fused=fused)
    buf, opt = build_optimizer(m, AdamWConfig(1e-3))
    step = TrainStep(m, buf, opt, "fp32", grad_clip=1.0, device="cpu")
    hist = []
    for x, y in batches(steps, rows):
        r = step.run([(x[i:i + MB], y[i:i + MB]) for i in range(0, rows, MB)])
        hist.append((r.loss, r.grad_norm))
    return hist, {n: p.detach().clone() for n, p in m.named_parameters()}


def assert_weights_close(a, b, steps, lr=1e-3):
    """Adam's first steps are about lr x sign(gradient): an element whose gradient is round-off noise
    (the attention key biases, exactly zero in exact arithmetic; the odd element elsewhere) may move
    the other way in another layout, by up to 2 lr per step. So: every element within 2 x steps x lr,
    and all but 2 + n/1000 of a tensor's n within rtol 1e-4 / atol 1e-5 (measured: at most one element
    per tensor off, by up to 9e-5)."""
    for k in b:
        d = (a[k] - b[k]).abs()
        assert d.max() <= 2 * steps * lr, (k, d.max().item())
        off = int((d > 1e-5 + 1e-4 * b[k].abs()).sum())
        assert k.endswith("query_key_value.bias") or off <= 2 + d.numel() // 1000, (k, off, d.max().item())


# ------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("world", [2, 4])
def test_partition_is_the_checkpoint_partition(dist_pool, world):
    assert all(dist_pool(world).run(_partition_case))


def test_tp2_equals_tp1_at_step_one_and_sequence_parallel_equals_tp2(dist_pool):
    m = model()
    (x, y), = batches(1, MB)
    loss = m(x, y).mean()
    loss.backward()
    ref = {n: p.grad for n, p in m.named_parameters()}
    ref_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in ref.values()]).double()).item()
    for sp in (False, True):
        out = dist_pool(2).run(_grads_case, 2, sp)
        for r in out:
            assert r["loss"] == pytest.approx(loss.item(), rel=1e-6)
            assert r["norm"] == pytest.approx(ref_norm, rel=1e-5)
            for n, g in ref.items():
                torch.testing.assert_close(r["grads"][n], g, rtol=1e-5, atol=1e-7, msg=lambda s, n=n: f"{n}: {s}")
        assert out[0]["loss"] == out[1]["loss"]  # the vocabulary-parallel loss is replicated bit for bit


def test_tp2_five_steps_with_clipping_and_sp(dist_pool):
    ref_hist, ref_w = reference(5, MB)
    for sp in (False, True):
        out = dist_pool(2).run(_train_case, 2, sp, 5, False)
        for r in out:
            assert [h[0] for h in r["hist"]] == pytest.approx([h[0] for h in ref_hist], rel=1e-5)
            assert [h[1] for h in r["hist"]] == pytest.approx([h[1] for h in ref_hist], rel=1e-5)
            assert_weights_close(r["weights"], ref_w, steps=5)


def test_tp2_dp2_with_distributed_optimizer_equals_one_process(dist_pool):
    ref_hist, ref_w = reference(5, 2 * MB)
    out = dist_pool(4).run(_train_case, 2, True, 5, True)
    for r in out:
        means = [h[1] for h in r["hist"]]
        assert means == pytest.approx([h[1] for h in ref_hist], rel=1e-5)
        assert_weights_close(r["weights"], ref_w, steps=5)


def test_tp2_sp_with_gradient_accumulation_fusion_equals_one_process(dist_pool):
    """The weight-gradient sinks on TP shards (the layers keep calling linear on local weights; each
    shard's GEMM writes its own slice of the main grads), with sequence parallelism, against the
    one-process default."""
    ref_hist, ref_w = reference(3, MB, fused=True)
    for r in dist_pool(2).run(_train_case, 2, True, 3, False, False, True):
        assert [h[1] for h in r["hist"]] == pytest.approx([h[1] for h in ref_hist], rel=1e-5)
        assert_weights_close(r["weights"], ref_w, steps=3)


def test_compiled_tp2_equals_eager(dist_pool):
    eager = dist_pool(2).run(_train_case, 2, True, 2, False, False)
    compiled = dist_pool(2).run(_train_case, 2, True, 2, False, True)
    for e, c in zip(eager, compiled):
        assert [h[0] for h in c["hist"]] == pytest.approx([h[0] for h in e["hist"]], rel=1e-5)
        assert_weights_close(c["weights"], e["weights"], steps=2)  # Inductor fuses in another order


def test_tp1_is_untouched():
    m = model()
    before = copy.deepcopy(m.state_dict())
    ctx = context_for(ParallelDims(1), 0, 0, "cpu")
    plan = parallelize_tensor(m, ctx)
    assert plan.tp_size == 1 and not plan.replicated
    assert type(m.head).__name__ == "LMHead"  # no hooks anywhere, so the compiled step is the plain model's
    assert not any(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks for mod in m.modules())
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
