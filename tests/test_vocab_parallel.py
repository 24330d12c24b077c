"""Vocabulary-parallel cross-entropy and embedding (hpcmeg/parallel/vocab_ce.py, vocab_embedding.py)
against the unsharded F.cross_entropy / nn.Embedding, on gloo process groups (world 2 and 4,
TP groups of 4 and of 2 inside a world of 4), eager and (world 2) compiled.

The vocabulary is docs/parallel-design.md B.10's: 500 real ids padded to 512 (the padded size
for tp 1, 2 and 4); the padding rows are real rows of the padded embedding, so they enter the
softmax, and the reference is F.cross_entropy over all 512 columns. Labels sit on every shard's
first and last row, the last real id (499) and a padding row (511); one token has a logit of 40
(the combine's max rescaling); a loss mask zeroes some tokens and the upstream gradient is
non-uniform.
Tolerances: fp32 loss and grads rtol 1e-6 / atol 1e-6 (the logsumexp of shard logsumexps sums
exp in another order: ~1e-7 relative on lse ~ 6-40); bf16 logits: the loss is still fp32
arithmetic on the same bf16 values (same bound); gradients are fp32 values rounded to bf16, so
a ~1e-7 difference can flip the last bf16 bit: rtol 2^-7. The embedding is compared bitwise
(each output row is one owner's row plus zeros; each owned weight-grad row sums the same
upstream rows in the same order). The LM head + loss: the GEMM's d weight and d hidden split over
the shards (and the sequence) sum in another grouping, rtol 1e-5 / atol 1e-6 (tests/TOLERANCES.md,
case 2, with gradients ~1e-2 in size).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpcmeg.fused import ops as fused
from hpcmeg.model import ops
from hpcmeg.parallel import comm
from hpcmeg.parallel.vocab_ce import (vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_plain,
                                      vocab_parallel_linear_cross_entropy)
from hpcmeg.parallel.vocab_embedding import VocabParallelEmbedding, vocab_parallel_embedding
from test_tp_comm import seq_chunk, tp_group, tp_sizes

pytestmark = pytest.mark.dist

V, V_REAL = 512, 500
FP32 = dict(rtol=1e-6, atol=1e-6)
BF16_GRAD = dict(rtol=2 ** -7, atol=1e-6)


def _labels(tp: int, b: int, s: int, gen) -> torch.Tensor:
    vl = V // tp
    edges = [x for r in range(tp) for x in (r * vl, (r + 1) * vl - 1)] + [V_REAL - 1, V - 1]
    y = torch.randint(0, V_REAL, (b * s,), generator=gen)
    y[:len(edges)] = torch.tensor(edges)
    return y.view(b, s)


def _mask_and_weights(b: int, s: int, gen):
    """A loss mask (some tokens 0) and non-uniform per-token weights: the loss is sum(loss * mask * w)."""
    mask = (torch.rand(b, s, generator=gen) > 0.3).float()
    mask[0, :2] = 0.0
    return mask, torch.rand(b, s, generator=gen) * 2


def _ce_case(rank: int, world: int) -> list[torch.Tensor]:
    """Per-token losses of every configuration (the parent checks they are replicated)."""
    losses = []
    for tp in tp_sizes(world):
        group, r = tp_group(rank, world, tp)
        gen = torch.Generator().manual_seed(3 + tp)
        b, s = 3, 12
        labels = _labels(tp, b, s, gen)
        mask, w = _mask_and_weights(b, s, gen)
        base = torch.randn(b, s, V, generator=gen) * 3
        base[1, 2, labels[1, 2]] = 40.0  # a dominant target logit
        for dt in (torch.float32, torch.bfloat16):
            full = base.to(dt)
            ref = full.clone().requires_grad_()
            lr = F.cross_entropy(ref.float().flatten(0, 1), labels.flatten(), reduction="none").view(b, s)
            (lr * mask * w).sum().backward()
            want_grad = ref.grad.chunk(tp, -1)[r]
            for fn in (vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_plain):
                mine = full.chunk(tp, -1)[r].clone().requires_grad_()
                loss = fn(mine, labels, group)
                assert loss.dtype == torch.float32 and loss.shape == (b, s)
                torch.testing.assert_close(loss, lr.detach(), **FP32)
                (loss * mask * w).sum().backward()
                assert mine.grad.dtype == dt
                torch.testing.assert_close(mine.grad.float(), want_grad.float(),
                                           **(FP32 if dt == torch.float32 else BF16_GRAD))
                assert not mine.grad[mask == 0].any()  # masked tokens: exactly zero gradient
                losses.append(loss.detach())
        # the custom-op route (torch.ops.hpcmeg.cross_entropy_lse; Triton on CUDA, its twin here)
        if fused.HAVE_TRITON_CE:
            mine = base.chunk(tp, -1)[r]
            torch.testing.assert_close(vocab_parallel_cross_entropy(mine, labels, group, use_triton=True),
                                       vocab_parallel_cross_entropy(mine, labels, group, use_triton=False), **FP32)
    return losses


def _both_heads(h_tp, h_sp, w, labels, group, plain: bool):
    """The vocabulary-parallel LM head + loss without and with sequence parallelism (one graph)."""
    return (vocab_parallel_linear_cross_entropy(h_tp, w, labels, group, sequence_parallel=False, plain=plain),
            vocab_parallel_linear_cross_entropy(h_sp, w, labels, group, sequence_parallel=True, plain=plain))


def _linear_ce_case(rank: int, world: int, compiled: bool) -> list[float]:
    """Hidden states + the local weight shard (the tied LM head), with and without sequence
    parallelism, fast and plain, vs the unsharded hpcmeg.model.ops.linear_cross_entropy."""
    from hpcmeg.model import ops
    if compiled:
        torch._inductor.config.compile_threads = 1  # no compile-worker pool on 2 shared cores
    errs = []
    for tp in tp_sizes(world):
        group, r = tp_group(rank, world, tp)
        gen = torch.Generator().manual_seed(21 + tp)
        b, s, h = 2, 4 * tp, 16
        H, W = torch.randn(b, s, h, generator=gen), torch.randn(V, h, generator=gen) * 0.5
        labels = _labels(tp, b, s, gen)
        mask, w = _mask_and_weights(b, s, gen)
        g = mask * w
        rh, rw = H.clone().requires_grad_(), W.clone().requires_grad_()
        lr = ops.linear_cross_entropy(rh, rw, labels)
        (lr * g).sum().backward()
        fn = torch.compile(_both_heads, fullgraph=True) if compiled else _both_heads
        for plain in ((False,) if compiled else (False, True)):
            h_tp, h_sp = H.clone().requires_grad_(), seq_chunk(H, tp, r).clone().requires_grad_()
            mw = W.chunk(tp, 0)[r].clone().requires_grad_()
            l_tp, l_sp = fn(h_tp, h_sp, mw, labels, group, plain)
            ((l_tp + l_sp) * g).sum().backward()
            for got, want in ((l_tp, lr), (l_sp, lr), (h_tp.grad, rh.grad), (h_sp.grad, seq_chunk(rh.grad, tp, r)),
                              (mw.grad, 2 * rw.grad.chunk(tp, 0)[r])):
                got, want = got.detach(), want.detach()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the header: case 2
                errs.append(float((got - want).abs().max() / want.abs().max()))
    return errs


def _embedding_case(rank: int, world: int) -> int:
    checked = 0
    for tp in tp_sizes(world):
        group, r = tp_group(rank, world, tp)
        gen = torch.Generator().manual_seed(5 + tp)
        b, s, h = 2, 4 * tp, 8
        ids = _labels(tp, b, s, gen)
        ids[1, :3] = ids[0, 0]  # repeated ids: their gradients add up in one row
        ref = torch.nn.Embedding(V, h)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(V, h, generator=gen))
        G = torch.randn(b, s, h, generator=gen)
        out = ref(ids)
        (out * G).sum().backward()
        for mode in ("all_reduce", "reduce_scatter", "none"):
            emb = VocabParallelEmbedding(ref.weight.detach().chunk(tp, 0)[r].clone(), group, reduce=mode)
            assert emb.num_embeddings == V
            y = emb(ids)
            if mode == "none":  # partial sums: exact once added over the group
                y = comm.reduce_from_tp(y, group)
            sp = mode == "reduce_scatter"
            torch.testing.assert_close(y, seq_chunk(out, tp, r) if sp else out, rtol=0, atol=0)
            (y * (seq_chunk(G, tp, r) if sp else G)).sum().backward()
            torch.testing.assert_close(emb.weight.grad, ref.weight.grad.chunk(tp, 0)[r], rtol=0, atol=0)
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_ce_matches_unsharded(dist_pool, world):
    per_rank = dist_pool(world).run(_ce_case)
    assert len(per_rank[0]) == 4 * len(tp_sizes(world))
    for losses in per_rank[1:]:  # the loss is replicated: the same bits on every rank
        for a, b in zip(losses, per_rank[0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_linear_ce_with_and_without_sequence_parallel(dist_pool, world):
    errs = dist_pool(world).run(_linear_ce_case, False)
    assert max(max(e) for e in errs) < 1e-6


def test_vocab_parallel_linear_ce_compiled(dist_pool):
    errs = dist_pool(2).run(_linear_ce_case, True, timeout=300)
    assert len(errs[0]) == 5 and max(max(e) for e in errs) < 1e-6


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_matches_nn_embedding(dist_pool, world):
    assert dist_pool(world).run(_embedding_case) == [3 * len(tp_sizes(world))] * world


def test_tp1_is_the_single_device_computation():
    """No process group: the fast CE is the single-device formula bit for bit (loss = logsumexp -
    target logit; gradient (softmax - onehot) * g, hpcmeg/model/ops.py), the embedding is
    nn.Embedding's lookup."""
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 6, 300), torch.randint(0, 300, (4, 6))
    a = logits.clone().requires_grad_()
    la = vocab_parallel_cross_entropy(a, labels, None)
    lb, lse = ops.cross_entropy_with_lse(logits, labels)
    assert torch.equal(la, lb)
    (la * labels).sum().backward()
    assert torch.equal(a.grad, ops.softmax_minus_onehot(logits, labels, lse) * labels.unsqueeze(-1))
    w = torch.randn(300, 8)
    assert torch.equal(vocab_parallel_embedding(labels, w, None), F.embedding(labels, w))
    with pytest.raises(ValueError, match="do not match"):
        vocab_parallel_cross_entropy(logits, labels[:, :3], None)
