"""Pipeline parallelism of the whole GPT on gloo process pools (fp32, dropout 0, CPU), through the
train job's own builders (hpcmeg/train/rank_model.py): stage chunks, the 1F1B / interleaved
schedule, the tied embedding summed over the embedding group, the norm over every stage.

- PP2 == PP1 for M in {1, 2, 4, 5} micro batches: the loss (logged mean) and every gradient after
  one step (lr 0: the reduced gradients stay in the buffer), the tied embedding's on both stages;
- PP4 with M 8 and PP2 x V2 (the interleaved schedule) == PP1;
- TP2 x PP2 (4 processes): the gradient norm equals TP1's; 5 steps with clipping equal 1 process;
- TP2 x PP2 x DP2 with the distributed optimizer (8 processes): 5 steps equal 1 process.
Tolerances: with one pipeline the per-chunk computation is the single process's, in the same micro
batch order, except the tied embedding (its two contributions are added in another order) and the
norm's stage sums: gradients rtol 1e-5 atol 1e-8, losses rtol 1e-6; with TP as in test_tp_model.py.
"""
from __future__ import annotations

import pytest
import torch

from helpers import random_batches
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.parallel.context import context_for
from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.train.optim import AdamWConfig
from hpcmeg.train.rank_model import rank_model, rank_optimizer, rank_step

pytestmark = pytest.mark.dist

SEQ, MB, LAYERS = 32, 2, 4
CFG = GPTConfig(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                max_position_embeddings=SEQ, padded_vocab_size=512, vocab_size=500, hidden_dropout=0.0,
                attention_dropout=0.0)


def batches(n: int, rows: int, seed: int = 11):
    return random_batches(n, rows, SEQ, 500, seed)


def global_grads(model, buffer) -> dict[str, torch.Tensor]:
    """This rank's reduced gradients by global parameter name (pipeline chunks renumber layers)."""
    chunks = model.chunks if hasattr(model, "chunks") else [model]
    out = {}
    for c in chunks:
        for name, p in c.named_parameters():
            a, b = buffer.locate(p)
            out[c.global_name(name)] = buffer.grad_data[a:b].view(p.shape).clone()
    return out


def global_weights(model, ctx, tp: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from hpcmeg.megatron.layout import tp_split_dim

    chunks = model.chunks if hasattr(model, "chunks") else [model]
    out = {}
    for c in chunks:
        for name, p in c.named_parameters():
            t, dim = p.detach(), tp_split_dim(name)
            if tp > 1 and dim is not None:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=ctx.tp_group)
                t = torch.cat(parts, dim)
            out[c.global_name(name)] = t.clone()
    return out


def _case(rank, world, tp, pp, vpp, M, steps, lr, distributed):
    dims = ParallelDims(world, tp=tp, pp=pp, vpp=vpp, distributed_optimizer=distributed)
    ctx = context_for(dims, rank, rank, "cpu")
    model, plan, rng = rank_model(CFG, dims, ctx, 3, "cpu")
    buf, opt = rank_optimizer(model, plan, ctx, AdamWConfig(lr, weight_decay=0.1), param_dtype=torch.float32,
                              grad_dtype=torch.float32)
    step = rank_step(model, buf, opt, dims, ctx, micro_batch=MB, seq_length=SEQ, act_dtype=torch.float32,
                     precision="fp32", grad_clip=1.0, device="cpu")
    hist = []
    for x, y in batches(steps, MB * M * dims.dp):
        mine = slice(ctx.dp_rank * MB * M, (ctx.dp_rank + 1) * MB * M)
        xs, ys = x[mine], y[mine]
        res = step.run([(xs[i:i + MB], ys[i:i + MB]) for i in range(0, MB * M, MB)])
        hist.append((res.loss, res.grad_norm))
    return {"hist": hist, "grads": global_grads(model, buf) if lr == 0 else None,
            "weights": global_weights(model, ctx, tp), "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank,
            "dp_rank": ctx.dp_rank,
            "bubble": getattr(step, "bubble", None)}


def reference(M: int, steps: int, lr: float):
    m = build_gpt(CFG, init_seed=3)
    dims = ParallelDims(1)
    ctx = context_for(dims, 0, 0, "cpu")
    buf, opt = rank_optimizer(m, _empty_plan(), ctx, AdamWConfig(lr, weight_decay=0.1), param_dtype=torch.float32,
                              grad_dtype=torch.float32)
    step = rank_step(m, buf, opt, dims, ctx, micro_batch=MB, seq_length=SEQ, act_dtype=torch.float32,
                     precision="fp32", grad_clip=1.0, device="cpu")
    hist = []
    for x, y in batches(steps, MB * M):
        res = step.run([(x[i:i + MB], y[i:i + MB]) for i in range(0, MB * M, MB)])
        hist.append((res.loss, res.grad_norm))
    return hist, global_grads(m, buf), {n: p.detach().clone() for n, p in m.named_parameters()}


def _empty_plan():
    from hpcmeg.parallel.tensor import TensorParallelPlan

    return TensorParallelPlan()


def check_grads(out, ref_grads):
    seen = set()
    for r in out:
        for name, g in r["grads"].items():
            key = "embedding.word_embeddings.weight" if name == "word_embeddings_for_head.weight" else name
            torch.testing.assert_close(g, ref_grads[key], rtol=1e-5, atol=1e-8, msg=lambda s, n=name: f"{n}: {s}")
            seen.add(key)
    assert seen == set(ref_grads)  # every parameter lives on some stage


def assert_weights_close(a: dict, b: dict, steps: int, lr: float):
    """As in test_tp_model.py: Adam's sign-like steps turn round-off in near-zero gradients into ~lr."""
    for k, v in a.items():
        ref = b["embedding.word_embeddings.weight" if k == "word_embeddings_for_head.weight" else k]
        d = (v - ref).abs()
        assert d.max() <= 2 * steps * lr, (k, d.max().item())
        off = int((d > 1e-5 + 1e-4 * ref.abs()).sum())
        assert k.endswith("query_key_value.bias") or off <= 2 + d.numel() // 1000, (k, off, d.max().item())


@pytest.mark.parametrize("M", [1, 2, 4, 5])
def test_pp2_1f1b_equals_one_process(dist_pool, M):
    ref_hist, ref_grads, _ = reference(M, 1, 0.0)
    out = dist_pool(2).run(_case, 1, 2, 1, M, 1, 0.0, False)
    for r in out:
        assert r["hist"][0][0] == pytest.approx(ref_hist[0][0], rel=1e-6)
        assert r["hist"][0][1] == pytest.approx(ref_hist[0][1], rel=1e-5)
    check_grads(out, ref_grads)
    assert out[0]["bubble"][1] == pytest.approx(1 / (M + 1))  # (pp - 1) / (vpp * M + pp - 1)
    assert 0 <= out[0]["bubble"][0] <= 1  # measured: a share of the step


def test_pp4_and_interleaved_pp2_v2_equal_one_process(dist_pool):
    ref_hist, ref_grads, _ = reference(8, 1, 0.0)
    out = dist_pool(4).run(_case, 1, 4, 1, 8, 1, 0.0, False)
    assert {r["pp_rank"] for r in out} == {0, 1, 2, 3}
    for r in out:
        assert r["hist"][0][0] == pytest.approx(ref_hist[0][0], rel=1e-6)
    check_grads(out, ref_grads)
    for M in (2, 4):
        ref_hist, ref_grads, _ = reference(M, 1, 0.0)
        out = dist_pool(2).run(_case, 1, 2, 2, M, 1, 0.0, False)
        for r in out:
            assert r["hist"][0][0] == pytest.approx(ref_hist[0][0], rel=1e-6)
        check_grads(out, ref_grads)


def test_tp2_pp2_norm_and_five_steps_equal_one_process(dist_pool):
    ref_hist, _, ref_w = reference(4, 5, 1e-3)
    out = dist_pool(4).run(_case, 2, 2, 1, 4, 5, 1e-3, False)
    for r in out:
        assert [h[1] for h in r["hist"]] == pytest.approx([h[1] for h in ref_hist], rel=1e-5)  # the global norm
        assert [h[0] for h in r["hist"]] == pytest.approx([h[0] for h in ref_hist], rel=1e-5)
        assert_weights_close(r["weights"], ref_w, 5, 1e-3)


@pytest.mark.slow
def test_tp2_pp2_dp2_distributed_optimizer_equals_one_process(dist_pool):
    ref_hist, _, ref_w = reference(4, 5, 1e-3)  # DP2 x M 2 = the single process's 4 micro batches
    out = dist_pool(8).run(_case, 2, 2, 1, 2, 5, 1e-3, True, timeout=600)
    for r in out:
        assert [h[1] for h in r["hist"]] == pytest.approx([h[1] for h in ref_hist], rel=1e-5)
        assert_weights_close(r["weights"], ref_w, 5, 1e-3)
    # each rank's loss is its DP rank's mean; the trainer logs their mean (equal token counts)
    by_dp = {r["dp_rank"]: [h[0] for h in r["hist"]] for r in out}
    assert [sum(x) / 2 for x in zip(by_dp[0], by_dp[1])] == pytest.approx([h[0] for h in ref_hist], rel=1e-5)
