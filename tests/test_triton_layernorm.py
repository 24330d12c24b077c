"""hpcmeg/kernels/layernorm.py: the fused LayerNorm + residual + bias-dropout-add backward
kernels against their plain PyTorch twin in Triton's CPU interpreter (fp32 and bf16, ragged
shapes, several partial-sum rows); the twin against torch.autograd through ops.layer_norm with the
bias-dropout-add forward; the custom op (opcheck) and the launch plan.

The kernels compiled for the GPU are checked by bench/dev/layernorm_probe.py on the H200.
Tolerances: tests/TOLERANCES.md's cases, named at each comparison.
"""

import re

import pytest
import torch

from hpcmeg.model import ops
from hpcmeg.kernels import layernorm as tln
from helpers import run_in_triton_interpreter

_INTERPRETER_CHECK = r"""
import torch
from hpcmeg.kernels import layernorm as tln

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

def inputs(shape, dtype, res, keep, wdtype=torch.float32):
    x = (torch.randn(shape) * 2 + 0.5).to(dtype)  # a non-zero mean, so the centring matters
    dy, w = torch.randn(shape).to(dtype), (1 + 0.3 * torch.randn(shape[-1])).to(wdtype)
    return (dy, x, w, 1e-5, torch.randn(shape).to(dtype) if res else None,
            torch.rand(shape) > 0.2 if keep else None, 1.25)

def check_fp32(shape, res, keep, launch=tln.DEFAULT_LAUNCH):
    args = inputs(shape, torch.float32, res, keep)
    got, want = tln.layer_norm_backward(*args, launch=launch), tln.reference_backward(*args)
    for name, g, w in zip(("dx", "d_branch", "dw", "db", "dbias"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, shape, g.shape, w.shape, g.dtype, w.dtype)
        if w.numel():
            # case 2: the row statistics and the dw / db / dbias column sums over N rows in the kernels'
            # blocks and partial rows against torch's reductions. As a whole (relative norm) within
            # 1e-5; element by element rtol 1e-4, as dx = (dy w - mean(dy w) - xhat mean(dy w xhat)) / sigma
            # cancels in its two means, which lose up to ~10x more relative to dx than to its terms
            assert rel(g, w) < 1e-5, (name, shape, res, keep, rel(g, w))
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {shape}: {m}")
    return got, args

torch.manual_seed(0)
n_checks = 0
cpu = torch.device("cpu")
# H = 100 (BLOCK_H 128, R 8), N = 37 over 3 programs: 16 + 16 + 5 rows, 2 iterations each, ragged tail
few = tln.Launch(programs=3)
assert tln.plan(37, 100, cpu, few) == tln.Plan(128, 8, 4, 16, 3, True)
for res in (False, True):
    for keep in (False, True):
        check_fp32((37, 100), res, keep, few)
        n_checks += 1
check_fp32((37, 100), True, True, tln.Launch(programs=3, prefetch=False))  # loads after the stores
# no dropout but a bias before the add: dbias = sum_rows(dx), d_branch not written (it is dx)
args = inputs((37, 100), torch.float32, True, False)
got = tln.layer_norm_backward(*args, bias_grad=True, launch=few)
want = tln.reference_backward(*args, bias_grad=True)
# case 2 (a column sum in blocks); the twin's dbias against an fp64 sum of its own dx: one fp32 sum's round-off
assert got[1].numel() == 0 and got[4].shape == (100,) and rel(got[4], want[4]) < 1e-5, rel(got[4], want[4])
assert rel(want[4], want[0].double().sum(0)) < 1e-6
check_fp32((1, 37, 100), True, True)  # leading dims; default plan: 5 programs of 8 rows
# P = 129 partial rows (> the sum kernel's 128 per iteration: its second iteration a 1-row tail), one
# row per program (the interpreter's cost is per program iteration: 129 rows, not more)
p = tln.plan(129, 64, cpu, tln.Launch(rows=1, programs=200))
assert p.programs == 129 and p.programs > tln.SUM_BLOCK_P, p
got, args = check_fp32((129, 64), True, True, tln.Launch(rows=1, programs=200))
again = tln.layer_norm_backward(*args, launch=tln.Launch(rows=1, programs=200))
assert all(torch.equal(a, b) for a, b in zip(got, again)), "not deterministic"
# a model width as the GPU runs it (BLOCK_H 1024, R 1, prefetch): 8 programs of 5 rows, the last 4
assert tln.plan(39, 768, cpu, tln.Launch(programs=8)) == tln.Plan(1024, 1, 4, 5, 8, True)
check_fp32((39, 768), True, True, tln.Launch(programs=8))
n_checks += 4

# bf16 in and out (fp32 or bf16 weight) against the twin in fp32 on the same bf16 values. The
# interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest), so allow one bf16 ulp
# (case 4: <= 2^-7 of the value; 1.01 for the fp32 values' case-2 distance, 1e-6 for values near 0).
for wdtype in (torch.float32, torch.bfloat16):
    args = inputs((2, 45, 256), torch.bfloat16, True, True, wdtype)
    dy, x, w, eps, d_res, keep, scale = args
    got = tln.layer_norm_backward(*args)
    want = tln.reference_backward(dy.float(), x.float(), w.float(), eps, d_res.float(), keep, scale)
    for name, g, r in zip(("dx", "d_branch"), got[:2], want[:2]):
        assert g.dtype == torch.bfloat16 and g.shape == r.shape, name
        assert ((g.float() - r).abs() <= r.abs() * 2.0**-7 * 1.01 + 1e-6).all(), (name, wdtype, rel(g, r))
    # the sums in the weight's dtype: fp32 as summed, bf16 within one ulp of the fp32 sums
    for name, g, r in zip(("dw", "db", "dbias"), got[2:], want[2:]):
        assert g.dtype == wdtype, (name, g.dtype, wdtype)
        if wdtype == torch.float32:
            assert rel(g, r) < 1e-5, (name, rel(g, r))  # case 2, as the fp32 checks above
        else:
            assert ((g.float() - r).abs() <= r.abs() * 2.0**-7 * 1.01 + 1e-6).all(), (name, rel(g, r))
    n_checks += 1
# the mask packed eight to a byte (what the model saves on CUDA): the same results as the bool mask,
# bit for bit, in the twin and the kernels (several programs, a ragged tail, H = 96 and 768)
from hpcmeg.kernels.dropout import pack_bits
for shape, launch in (((37, 96), few), ((39, 768), tln.Launch(programs=8)), ((2, 45, 256), tln.DEFAULT_LAUNCH)):
    args = inputs(shape, torch.bfloat16, True, True)
    packed = args[:5] + (pack_bits(args[5]),) + args[6:]
    for fn in (tln.reference_backward, lambda *a: tln.layer_norm_backward(*a, launch=launch)):
        for g, w in zip(fn(*packed), fn(*args)):
            assert torch.equal(g, w), shape
    n_checks += 1
print("ok", n_checks)
"""


def test_kernels_match_the_twin_in_the_interpreter():
    run_in_triton_interpreter(_INTERPRETER_CHECK, expect="ok 13")


def _autograd_grads(residual, a, bias, keep, scale, w, b, gy, g_res, eps):
    """Gradients of sum(y * gy) + sum(out * g_res) with out = residual + (a + bias) * keep * scale
    (or residual + a + bias without keep), y = ops.layer_norm(out, w, b, eps): fp32 autograd."""
    leaves = [t.clone().requires_grad_(True) for t in (residual, a, bias, w, b)]
    r_, a_, bias_, w_, b_ = leaves
    if keep is None:
        out, y = ops.bias_dropout_add_layer_norm(a_, bias_, r_, 0.0, False, w_, b_, eps)  # no dropout
    else:
        out = r_ + (a_ + bias_) * keep * scale
        y = ops.layer_norm(out, w_, b_, eps)
    loss = (y * gy).sum() + ((out * g_res).sum() if g_res is not None else 0)
    return out.detach(), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("with_keep", [False, True])
@pytest.mark.parametrize("with_res", [False, True])
def test_twin_matches_autograd_of_the_forward(with_keep, with_res):
    torch.manual_seed(1)
    shape, h, eps, scale = (3, 7, 48), 48, 1e-5, 1 / 0.9
    residual, a, gy = (torch.randn(shape) for _ in range(3))
    residual = residual * 3 + 1  # a mean and a scale far from LN's output
    bias, w, b = torch.randn(h), 1 + 0.3 * torch.randn(h), torch.randn(h)
    keep = torch.rand(shape) > 0.1 if with_keep else None
    g_res = torch.randn(shape) if with_res else None
    out, (g_r, g_a, g_bias, g_w, g_b) = _autograd_grads(residual, a, bias, keep, scale, w, b, gy, g_res, eps)
    dx, d_branch, dw, db, dbias = tln.reference_backward(gy, out, w, eps, g_res, keep, scale)
    # case 2: the written-out LayerNorm backward against autograd's (its own reduction order); dbias
    # sums 21 rows of both signs, so relative to the sum its round-off can be ~10x its terms': rtol 1e-4
    torch.testing.assert_close(dx, g_r, atol=1e-5, rtol=1e-5)  # the residual stream's gradient
    torch.testing.assert_close(dw, g_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(db, g_b, atol=1e-5, rtol=1e-5)
    if with_keep:
        torch.testing.assert_close(d_branch, g_a, atol=1e-5, rtol=1e-5)  # gradient of attn (+ bias)
        torch.testing.assert_close(dbias, g_bias, atol=1e-5, rtol=1e-4)
        assert (d_branch[~keep] == 0).all() and (d_branch[keep] != 0).all()
    else:  # no mask: the branch's gradient is dx itself, and the op returns no copy of it
        torch.testing.assert_close(g_a, g_r, atol=1e-5, rtol=1e-5)  # autograd both: case 2 at most
        assert d_branch.numel() == 0 and dbias.numel() == 0


def test_custom_op_opcheck_and_cpu_path():
    torch.manual_seed(2)
    dy, x = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    w = torch.randn(24)
    d_res, keep = torch.randn(2, 5, 24), torch.rand(2, 5, 24) > 0.3
    for args in ((dy, x, w, 1e-5, None, None, 1.0), (dy, x, w, 1e-5, d_res, keep, 1 / 0.7),
                 (dy.double(), x.double(), w, 1e-6, d_res.double(), None, 1.0),
                 (dy.bfloat16(), x.bfloat16(), w.bfloat16(), 1e-5, d_res.bfloat16(), keep, 2.0)):
        torch.library.opcheck(tln.layer_norm_backward_op, args)
        got = torch.ops.hpcmeg.layer_norm_backward(*args)  # CPU: the twin
        for g, r in zip(got, tln.reference_backward(*args)):
            assert torch.equal(g, r)
        assert got[0].dtype == args[0].dtype and got[2].dtype == got[4].dtype == args[2].dtype
        assert got[1].numel() == (0 if args[5] is None else dy.numel())


def test_plan_and_argument_checks():
    cuda_like = torch.device("cpu")  # off CUDA the plan assumes the H200's 132 SMs
    for n, h, warps, per_prog, programs in ((12288, 768, 4, 19, 647), (12288, 1024, 4, 19, 647),
                                            (8192, 2048, 8, 32, 256)):
        p = tln.plan(n, h, cuda_like)  # one row per iteration, 20 resident warps per SM
        assert (p.rows, p.warps, p.rows_per_prog, p.programs) == (1, warps, per_prog, programs), (n, h, p)
        assert p.block_h >= h and p.block_h & (p.block_h - 1) == 0 and p.prefetch
    for n in (1, 7, 263, 264, 265, 10_001):  # every row owned by exactly one program
        p = tln.plan(n, 100, cuda_like)
        assert p.rows_per_prog % p.rows == 0 and (p.programs - 1) * p.rows_per_prog < n <= p.programs * p.rows_per_prog
    empty = torch.empty(0, 8)  # no rows: no launch, zero sums
    dx, d_branch, dw, db, dbias = tln.layer_norm_backward(empty, empty, torch.ones(8), 1e-5,
                                                          keep=torch.empty(0, 8, dtype=torch.bool))
    assert dx.shape == d_branch.shape == (0, 8) and all(torch.equal(t, torch.zeros(8)) for t in (dw, db, dbias))
    dy = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        tln.reference_backward(dy, dy, torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="keep"):
        tln.layer_norm_backward(dy, dy, torch.randn(8), 1e-5, keep=torch.ones(4, 8))  # not bool
    with pytest.raises(ValueError, match="packed keep"):  # bits of a [4, 16] mask for [4, 8]
        tln.layer_norm_backward(dy, dy, torch.randn(8), 1e-5, keep=torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="d_res"):
        tln.layer_norm_backward(dy, dy, torch.randn(8), 1e-5, d_res=torch.randn(4, 9))


def test_row_kernel_compiles_for_hopper():
    """_ln_bwd_kernel at 124M's launch (bf16, H = 768, d_res and a bool or packed keep) compiles for
    sm90 with Triton's compiler, not only in its interpreter; the packed mask costs one 1-byte load
    per thread per row (the bool one an 8-byte load) and no extra shared-memory traffic."""
    pytest.importorskip("triton")
    from helpers import compile_for_hopper
    p = tln.plan(12288, 768, torch.device("cpu"))
    types = dict(DY="*bf16", X="*bf16", W="*fp32", DRES="*bf16", KEEP="*u8", DX="*bf16", DBR="*bf16",
                 PART="*fp32", N="i32", rows_per_prog="i32", eps="fp32", scale="fp32")
    ptx = {}
    for bits in (False, True):
        ptx[bits] = compile_for_hopper(tln._ln_bwd_kernel, types, dict(
            H=768, BLOCK_H=p.block_h, R=p.rows, K=3, HAS_RES=True, HAS_KEEP=True, KEEP_BITS=bits, BIAS_SUM=True,
            PREFETCH=True), num_warps=p.warps).asm["ptx"]
    loads = {b: re.findall(r"ld\.global\.[\w.]+", t) for b, t in ptx.items()}
    # two of each: the current rows and the prefetched ones
    assert loads[False].count("ld.global.v2.b32") == 2 and "ld.global.b8" not in loads[False], loads[False]
    assert loads[True].count("ld.global.b8") == 2 and "ld.global.v2.b32" not in loads[True], loads[True]
    shared = {b: len(re.findall(r"(?:ld|st)\.shared", t)) for b, t in ptx.items()}
    assert shared[True] == shared[False], shared
