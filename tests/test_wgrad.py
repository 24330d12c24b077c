"""Gradient-accumulation fusion (hpcmeg/fused/wgrad.py + the buffer's sunk weights): the sink path
against the plain one, eager and compiled, one process and DP2 / the distributed optimizer on gloo.

With fp32 operands (CPU) the sink computes the same mm as autograd's weight gradient and adds it
to a zeroed main grad, so one micro batch agrees bitwise; across micro batches both add in the
same order. The fused model's other gradients (dx through the sink's matmul, the bias sums) are
written differently from autograd's own, so whole-model comparisons allow fp32 round-off.
Tolerances: tests/TOLERANCES.md's cases, named at each comparison.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.fused import wgrad
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from hpcmeg.model.gpt import GPT
from hpcmeg.parallel.context import context_for
from hpcmeg.parallel.grad_buffer import ParamAndGradBuffer
from hpcmeg.train.build import wgrad_fusion
from hpcmeg.train.optim import AdamWConfig, build_optimizer
from hpcmeg.train.step import TrainStep

VOCAB = 128


def fused_gpt(layers: int = 2, seed: int = 0, fused: bool = True, ce: str = "grad_in_forward") -> GPT:
    torch.manual_seed(seed)
    return build_gpt(GPTConfig(layers, 32, 4, 128, 16, VOCAB, hidden_dropout=0.0, attention_dropout=0.0, fused=fused,
                         fused_ce=ce))


def micro_batches(n: int, rows: int = 2, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n * rows, 17), generator=g)
    return [(x[i:i + rows, :-1].contiguous(), x[i:i + rows, 1:].contiguous()) for i in range(0, n * rows, rows)]


def test_linear_sink_adds_the_weight_gradient_and_returns_none():
    torch.manual_seed(0)
    lin = nn.Linear(8, 12)
    flat = torch.full((300,), 0.0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    for _ in range(2):  # accumulates: the second backward adds the same gradient again
        wgrad.linear(x, lin.weight, lin.bias, (flat, 64)).square().sum().backward()
    assert lin.weight.grad is None
    dx, db = x.grad.clone(), lin.bias.grad.clone()
    x.grad = lin.bias.grad = None
    F.linear(x, lin.weight, lin.bias).square().sum().backward()
    w = lin.weight.grad
    assert torch.equal(flat[64:64 + 96].view(12, 8), w + w)
    assert torch.count_nonzero(flat[:64]) == 0 and torch.count_nonzero(flat[160:]) == 0  # nothing else written
    # dx through the sink's own matmul and db its own row sum, against autograd's: case 5
    torch.testing.assert_close(dx, 2 * x.grad)
    torch.testing.assert_close(db, 2 * lin.bias.grad)
    assert wgrad.linear(x, lin.weight, lin.bias, None).grad_fn.name() != "_LinearSinkBackward"


def test_embedding_sink_adds_the_weight_gradient_and_returns_none():
    """Repeated ids add their rows; two backward passes accumulate; autograd gets no weight gradient."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 6)
    ids = torch.tensor([[1, 3, 1], [9, 1, 0]])
    flat = torch.zeros(100)
    for _ in range(2):
        wgrad.embedding(ids, emb.weight, (flat, 20)).square().sum().backward()
    assert emb.weight.grad is None
    F.embedding(ids, emb.weight).square().sum().backward()
    w = emb.weight.grad
    # index_add_ of the same rows in the same order against autograd's embedding backward: case 5
    torch.testing.assert_close(flat[20:80].view(10, 6), 2 * w)
    assert torch.count_nonzero(flat[:20]) == 0 and torch.count_nonzero(flat[80:]) == 0
    assert torch.count_nonzero(w[2]) == 0 and torch.count_nonzero(w[1]) == 6  # untouched / repeated rows
    torch.library.opcheck(torch.ops.hpcmeg.embedding_grad_accumulate_.default,
                          (torch.zeros(100), torch.randn(2, 3, 6), ids, 20, 10))


def test_wgrad_op_passes_opcheck():
    flat = torch.zeros(200)
    dy, x = torch.randn(6, 4), torch.randn(6, 5)
    torch.library.opcheck(torch.ops.hpcmeg.wgrad_accumulate_.default, (flat, dy, x, 8))


def _grads(fusion: bool, n_micro: int, compile: bool = False, fused: bool = True, ce: str = "grad_in_forward"):
    m = fused_gpt(fused=fused, ce=ce)
    buf, opt = build_optimizer(m, AdamWConfig(1e-2), bucket_numel=3000, wgrad_fusion=fusion)
    ts = TrainStep(m, buf, opt, "fp32", grad_clip=0.0, device="cpu", compile=compile)
    hist = []
    for step in range(2):
        res = ts.run(micro_batches(n_micro, seed=step))
        hist.append(res.loss)
        assert all(p.grad is None for p in m.parameters())
    views = {n: buf.grad_data[slice(*buf.locate(p))].clone() for n, p in m.named_parameters()}
    return buf, views, {k: v.clone() for k, v in m.state_dict().items()}, hist


@pytest.mark.parametrize("n_micro,ce", [(1, "grad_in_forward"), (3, "grad_in_forward"), (3, "backward_in_forward")])
def test_sunk_buffer_layout_and_gradients_match_the_hook_path(n_micro, ce):
    """The linears and the tied word embedding are sunk: the output layer's GEMM and the embedding's
    index_add_ both add into its main grad."""
    buf, g_sink, w_sink, h_sink = _grads(True, n_micro, ce=ce)
    ref, g_ref, w_ref, h_ref = _grads(False, n_micro, ce=ce)
    sunk = [bk for bk in buf.buckets if bk.sunk]
    # qkv, dense, h->4h, 4h->h of each layer (+ the word embedding)
    assert sum(len(bk.params) for bk in sunk) == 4 * 2 + 1
    assert all(all(buf.is_sunk(p) == bk.sunk for p in bk.params) for bk in buf.buckets)  # never mixed
    assert not any(bk.sunk for bk in ref.buckets)
    for name in g_ref:
        # the last step's main grads: weights through the sink, the rest through hooks
        # case 2 (the header: dx and the bias sums written differently); atol 1e-7: these main grads
        # are of a mean loss and mostly ~1e-4..1e-2, so 1e-7 still covers a ~0 sum's round-off
        torch.testing.assert_close(g_sink[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert h_sink == pytest.approx(h_ref, rel=1e-6)  # the loss: a few ulps of case-2 difference
    for k in w_ref:
        # the weights after two Adam steps at lr 1e-2: Adam's g / sqrt(v) turns a case-2 difference in
        # a ~0 gradient into up to ~1e-3 of a step, i.e. ~1e-5 absolute: atol 2e-5
        torch.testing.assert_close(w_sink[k], w_ref[k], rtol=1e-5, atol=2e-5)


def test_compiled_sink_step_matches_eager_hooks():
    """torch.compile keeps the sink's mutation inside the compiled backward (the grad buffer is a module
    buffer: one static graph input), and the result is the eager hook path's. The compiled model also
    takes the grad-in-forward cross-entropy (its kernel's in-place write of an intermediate, under
    Inductor)."""
    _, g_c, w_c, h_c = _grads(True, 2, compile=True)
    _, g_e, w_e, h_e = _grads(False, 2)
    assert h_c == pytest.approx(h_e, rel=1e-5)  # compiled against eager: case 2 on the loss
    for name in g_e:  # case 3 (compiled model against eager); atol 1e-6 for main grads of a mean loss
        torch.testing.assert_close(g_c[name], g_e[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_sunk_weight_with_a_grad_is_an_error_and_the_fusion_needs_a_fused_cuda_model():
    m = fused_gpt(fused=False)
    w = m.encoder.layers[0].mlp.dense_h_to_4h.weight
    buf = ParamAndGradBuffer([("all", list(m.parameters()))], param_dtype=torch.float32,
                             grad_dtype=torch.float32, sunk=frozenset({id(w)}))
    (x, y), = micro_batches(1)
    buf.start_step(1)
    m(x, y).sum().backward()  # a plain model: autograd gives the sunk weight a .grad
    with pytest.raises(RuntimeError, match="sunk weight got a .grad"):
        buf.finish_grads()
    with pytest.raises(ValueError, match="wgrad_fusion needs a fused model"):
        build_optimizer(fused_gpt(fused=False), AdamWConfig(1e-3), wgrad_fusion=True)
    # the trainer's rule: a fused model with bf16/fp16 parameters on CUDA only
    assert not wgrad_fusion(fused_gpt(), torch.bfloat16)  # CPU
    assert not wgrad_fusion(fused_gpt(fused=False), torch.bfloat16)


def _run_sink(world: int, rank: int, distributed: bool, micro_per_rank: int, ce: str = "grad_in_forward"):
    m = fused_gpt(ce=ce)
    ctx = context_for(ParallelDims(world, distributed_optimizer=distributed), rank, rank, "cpu")
    buf, opt = build_optimizer(m, AdamWConfig(1e-2), ctx, bucket_numel=3000, wgrad_fusion=True)
    ts = TrainStep(m, buf, opt, "fp32", grad_clip=1.0, device="cpu", dp_size=world)
    hist = []
    for step in range(3):
        mbs = micro_batches(micro_per_rank * world, seed=step)  # this rank's contiguous block
        hist.append(ts.run(mbs[micro_per_rank * rank:micro_per_rank * (rank + 1)]).grad_norm)
    return hist, {k: v.clone() for k, v in m.state_dict().items()}


def _dp_sink_case(rank, world, distributed, ce):
    import torch.distributed as dist

    # the one-process reference runs here too: same thread count as the DP run (CPU SDPA's
    # results depend on how many threads split it)
    ref = _run_sink(1, 0, False, world, ce)
    out = _run_sink(world, rank, distributed, 1, ce)
    dist.barrier()
    return ref, out


@pytest.mark.dist
def test_dp2_with_sinks_equals_one_process_accumulating(dist_pool):
    """The sunk buckets reduce in finish_grads (all-reduce, or reduce-scatter for the distributed
    optimizer): DP2 x 1 micro batch == one process x 2. The tied word embedding is sunk (its bucket
    reduces last) and its main grad takes two additions per micro batch (the output layer's GEMM,
    then the embedding's rows), so one process sums ((h1 + e1) + h2) + e2 where DP2 sums
    (h1 + e1) + (h2 + e2): equal to fp32 round-off, not bitwise (and through the clipped global norm
    every weight follows within that round-off)."""
    for distributed in (False, True):
        for (ref_hist, ref_w), (hist, weights) in dist_pool(2).run(_dp_sink_case, distributed, "grad_in_forward"):
            # grad norms from main grads one fp32 rounding apart (the docstring): a few u
            assert hist == pytest.approx(ref_hist, rel=1e-6)
            for k, v in ref_w.items():  # Adam's g / sqrt(v) lifts round-off of ~0 gradients to
                # ~1 % of a step (lr 1e-2): 1e-4 absolute, and rtol 1e-4 likewise
                torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-4)
