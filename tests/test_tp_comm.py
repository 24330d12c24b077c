"""hpcmeg/parallel/comm.py: each tensor/sequence-parallel function against a one-process reference,
forward and backward, on real gloo process groups (world 2 and 4, including TP sub-groups of a
world-4 job), eager and under torch.compile(fullgraph=True); and a column-parallel -> row-parallel
MLP pair (f before, g after; with sequence parallelism gather / reduce-scatter) against the
unsharded pair.

Every rank builds the same full tensors from one seed and computes the reference itself, so the
reference involves no communication. Tolerances: copies, slices and gathers are compared bitwise;
sums over ranks (all-reduce, reduce-scatter, the row-parallel matmul split into tp partial
matmuls) differ from one process only by fp32 summation order: ~1e-7 relative per add, hence
rtol 1e-6 for plain sums and rtol 1e-5 / atol 1e-6 where a length-64 dot product is split into
partial dot products (the error of a dot product grows with its length times its terms' sizes).
Compiled vs eager: Inductor's CPU sin/cos/gelu may differ in the last bit, rtol 1e-6.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpcmeg.parallel import comm

pytestmark = pytest.mark.dist

EXACT = dict(rtol=0.0, atol=0.0)
SUM = dict(rtol=1e-6, atol=1e-7)
MATMUL = dict(rtol=1e-5, atol=1e-6)
_GROUPS: dict = {}  # (world, tp) -> this worker's TP groups, created once per worker process


def tp_group(rank: int, world: int, tp: int):
    """(group, group rank) of `rank` for TP groups of `tp` consecutive ranks (Megatron order);
    tp == world is the default group (None), as ParallelContext stores it."""
    if tp == world:
        return None, rank
    if (world, tp) not in _GROUPS:  # every rank creates every group, in the same order
        _GROUPS[(world, tp)] = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    return _GROUPS[(world, tp)][rank // tp], rank % tp


def tp_sizes(world: int) -> list[int]:
    return [world] if world == 2 else [world, 2]


def seq_chunk(x: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """Reference of comm.py's token-shard layout: the r-th 1/tp of the [b*s, ...] rows."""
    b, s = x.shape[:2]
    return x.reshape(b * s, *x.shape[2:]).chunk(tp, 0)[r].reshape(b, s // tp, *x.shape[2:])


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen)


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _comm_case(rank: int, world: int) -> list[str]:
    done = []
    for tp in tp_sizes(world):
        group, r = tp_group(rank, world, tp)
        assert comm.group_size(group) == tp and comm.group_rank(group) == r
        gen = torch.Generator().manual_seed(100 + tp)  # same tensors on every rank
        b, s, h = 2, 4 * tp, 8
        X, G = _rand(gen, b, s, h), _rand(gen, b, s, h)
        P = [_rand(gen, b, s, h) for _ in range(tp)]    # rank-dependent values, all known to all
        Q = [_rand(gen, b, s, h) for _ in range(tp)]    # rank-dependent upstream grads
        sum_P = sum(P[1:], P[0].clone())
        sum_Q = sum(Q[1:], Q[0].clone())

        x = _leaf(X)  # f: identity forward, all-reduce backward
        y = comm.copy_to_tp(x, group)
        torch.testing.assert_close(y, X, **EXACT)
        (y * Q[r]).sum().backward()
        torch.testing.assert_close(x.grad, sum_Q, **SUM)

        x = _leaf(P[r])  # g: all-reduce forward, identity backward
        y = comm.reduce_from_tp(x, group)
        torch.testing.assert_close(y, sum_P, **SUM)
        (y * G).sum().backward()
        torch.testing.assert_close(x.grad, G, **EXACT)

        x = _leaf(X)  # scatter / gather along the last dim
        y = comm.scatter_to_tp_last_dim(x, group)
        torch.testing.assert_close(y, X.chunk(tp, -1)[r], **EXACT)
        (y * G.chunk(tp, -1)[r]).sum().backward()
        torch.testing.assert_close(x.grad, G, **EXACT)
        x = _leaf(X.chunk(tp, -1)[r])
        y = comm.gather_from_tp_last_dim(x, group)
        torch.testing.assert_close(y, X, **EXACT)
        (y * G).sum().backward()
        torch.testing.assert_close(x.grad, G.chunk(tp, -1)[r], **EXACT)

        x = _leaf(X)  # split_seq: own token shard, grad all-gathered
        y = comm.split_seq(x, group)
        torch.testing.assert_close(y, seq_chunk(X, tp, r), **EXACT)
        (y * seq_chunk(G, tp, r)).sum().backward()
        torch.testing.assert_close(x.grad, G, **EXACT)
        xt = _leaf(X.transpose(0, 1).contiguous())  # a non-contiguous input [b, s, h] view
        yt = comm.split_seq(xt.transpose(0, 1), group)
        torch.testing.assert_close(yt, seq_chunk(X, tp, r), **EXACT)

        for partial in (True, False):  # gather_seq: grads reduce-scattered, or sliced
            x = _leaf(seq_chunk(X, tp, r))
            y = comm.gather_seq(x, group, grad_partial=partial)
            torch.testing.assert_close(y, X, **EXACT)
            (y * (Q[r] if partial else G)).sum().backward()
            torch.testing.assert_close(x.grad, seq_chunk(sum_Q if partial else G, tp, r),
                                       **(SUM if partial else EXACT))

        x = _leaf(P[r])  # reduce_scatter_seq: summed own shard, grad all-gathered
        y = comm.reduce_scatter_seq(x, group)
        torch.testing.assert_close(y, seq_chunk(sum_P, tp, r), **SUM)
        (y * seq_chunk(Q[r], tp, r)).sum().backward()
        torch.testing.assert_close(x.grad, _unshard([seq_chunk(Q[i], tp, i) for i in range(tp)]), **EXACT)

        flat = X.reshape(b * s, h)  # 2-D [N, h]: the same shards, N playing s
        torch.testing.assert_close(comm.split_seq(flat, group), seq_chunk(X, tp, r).reshape(-1, h), **EXACT)
        torch.testing.assert_close(comm.gather_seq(seq_chunk(X, tp, r).reshape(-1, h), group), flat, **EXACT)
        torch.testing.assert_close(comm.reduce_scatter_seq(P[r].reshape(b * s, h), group),
                                   seq_chunk(sum_P, tp, r).reshape(-1, h), **SUM)
        one = X[:1]  # b = 1: the token shard is the literal sequence range
        torch.testing.assert_close(comm.split_seq(one, group), one[:, r * (s // tp):(r + 1) * (s // tp)], **EXACT)
        with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
            comm.split_seq(X[:, :s - 1], group)
        done.append(f"tp{tp}")
    return done


def _unshard(shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of seq_chunk over all ranks' shards."""
    b, sl = shards[0].shape[:2]
    flat = torch.cat([t.reshape(b * sl, *t.shape[2:]) for t in shards], 0)
    return flat.reshape(b, sl * len(shards), *shards[0].shape[2:])


def _chain(X, P, group):
    """Every comm function in one graph (compile test)."""
    a = comm.scatter_to_tp_last_dim(comm.copy_to_tp(X, group), group) * 1.5
    a = comm.split_seq(comm.gather_from_tp_last_dim(a, group), group).sin()
    m = comm.gather_seq(a, group) * P                      # partial per rank
    o = comm.gather_seq(comm.reduce_scatter_seq(m, group).cos(), group, grad_partial=False)
    return comm.reduce_from_tp(o * P, group)


def _compiled_chain_case(rank: int, world: int, backend: str) -> list[float]:
    errs = []
    for tp in tp_sizes(world):
        group, r = tp_group(rank, world, tp)
        gen = torch.Generator().manual_seed(7)
        X, G = _rand(gen, 2, 2 * tp, 4 * tp), _rand(gen, 2, 2 * tp, 4 * tp)
        P = [_rand(gen, *X.shape) for _ in range(tp)][r]
        outs = []
        for fn in (_chain, torch.compile(_chain, fullgraph=True, backend=backend)):
            x, p = _leaf(X), _leaf(P)
            y = fn(x, p, group)
            (y * G).sum().backward()
            outs.append((y.detach(), x.grad, p.grad))
        for e, c in zip(*outs):
            torch.testing.assert_close(c, e, **SUM)
            errs.append(float((c - e).abs().max()))
    return errs


def _pair(x, w1, b1, w2, b2, group, sequence_parallel: bool):
    """Column-parallel h->f + GELU + row-parallel f->h (Megatron's MLP), this rank's shards."""
    x = comm.gather_seq(x, group) if sequence_parallel else comm.copy_to_tp(x, group)
    out = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)
    out = comm.reduce_scatter_seq(out, group) if sequence_parallel else comm.reduce_from_tp(out, group)
    return out + b2


def _both_pairs(tensors_tp, tensors_sp, group):
    """The pair without and with sequence parallelism in one graph (one compile covers
    all-reduce, all-gather and reduce-scatter, forward and backward)."""
    return _pair(*tensors_tp, group, False), _pair(*tensors_sp, group, True)


def _pair_case(rank: int, world: int, compiled: bool) -> list[float]:
    """Both pairs vs the unsharded pair: output, input grad, every weight grad (sliced)."""
    if compiled:
        torch._inductor.config.compile_threads = 1  # no compile-worker pool on 2 shared cores
    errs = []
    for tp in tp_sizes(world):
        group, r = tp_group(rank, world, tp)
        gen = torch.Generator().manual_seed(11 + tp)
        b, s, h, f = 2, 8, 16, 64
        X, G = _rand(gen, b, s, h), _rand(gen, b, s, h)
        W1, b1, W2, b2 = _rand(gen, f, h) * 0.3, _rand(gen, f), _rand(gen, h, f) * 0.2, _rand(gen, h)
        ref = [_leaf(t) for t in (X, W1, b1, W2, b2)]
        y_ref = F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2]), approximate="tanh"), ref[3], ref[4])
        (y_ref * G).sum().backward()
        shards = (W1.chunk(tp, 0)[r], b1.chunk(tp, 0)[r], W2.chunk(tp, 1)[r], b2)
        mine_tp = [_leaf(t) for t in (X, *shards)]
        mine_sp = [_leaf(t) for t in (seq_chunk(X, tp, r), *shards)]
        fn = torch.compile(_both_pairs, fullgraph=True) if compiled else _both_pairs
        y_tp, y_sp = fn(mine_tp, mine_sp, group)
        ((y_tp * G).sum() + (y_sp * seq_chunk(G, tp, r)).sum()).backward()
        for sp, y, mine in ((False, y_tp, mine_tp), (True, y_sp, mine_sp)):
            part = (lambda t: seq_chunk(t, tp, r)) if sp else (lambda t: t)
            b2_grad = mine[4].grad
            if sp:  # the row-parallel bias saw only this rank's tokens: SP's TP all-reduce of it
                b2_grad = comm.all_reduce(b2_grad, comm.group_name(group)) if tp > 1 else b2_grad
            checks = [(y, part(y_ref)), (mine[0].grad, part(ref[0].grad)),
                      (mine[1].grad, ref[1].grad.chunk(tp, 0)[r]), (mine[2].grad, ref[2].grad.chunk(tp, 0)[r]),
                      (mine[3].grad, ref[3].grad.chunk(tp, 1)[r]), (b2_grad, ref[4].grad)]
            for got, want in checks:
                got, want = got.detach(), want.detach()
                torch.testing.assert_close(got, want, **MATMUL)
                errs.append(float((got - want).abs().max() / want.abs().max()))  # error / scale
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_comm_functions_match_one_process_reference(dist_pool, world):
    assert dist_pool(world).run(_comm_case) == [[f"tp{t}" for t in tp_sizes(world)]] * world


def test_comm_functions_compiled_fullgraph_equal_eager(dist_pool):
    """Every function in one graph, traced without a graph break (Dynamo + AOT autograd with the
    aot_eager backend, world 2: a world-4 compile costs ~90 s of 4 processes on 2 cores and traces
    the same code; sub-groups are covered eagerly above). Inductor's lowering of the collectives
    is the compiled pair test below."""
    errs = dist_pool(2).run(_compiled_chain_case, "aot_eager", timeout=300)
    assert len(errs) == 2 and all(len(e) == 3 for e in errs)


@pytest.mark.parametrize("world", [2, 4])
def test_column_row_parallel_pair_matches_unsharded(dist_pool, world):
    errs = dist_pool(world).run(_pair_case, False)
    assert max(max(e) for e in errs) < 1e-6  # largest error relative to the tensor's scale (measured 3e-7)


def test_column_row_parallel_pair_compiled_inductor(dist_pool):
    """The same pairs under torch.compile(fullgraph=True) with Inductor (world 2)."""
    errs = dist_pool(2).run(_pair_case, True, timeout=300)
    assert max(max(e) for e in errs) < 1e-6


def test_size_one_group_is_the_identity_without_communication():
    """No torch.distributed in this process: every function returns its input object."""
    assert not dist.is_initialized() and comm.group_size(None) == 1 and comm.group_rank(None) == 0
    x = torch.randn(2, 3, 4, requires_grad=True)
    for fn in (comm.copy_to_tp, comm.reduce_from_tp, comm.scatter_to_tp_last_dim, comm.gather_from_tp_last_dim,
               comm.split_seq, comm.gather_seq, comm.reduce_scatter_seq):
        assert fn(x, None) is x, fn.__name__
