"""hpcmeg/kernels/gelu.py: the Triton tanh-GELU forward and backward (dh and the bias gradient)
against their plain PyTorch twins in Triton's CPU interpreter (fp32, bf16, fp16; ragged shapes,
several dbias partial rows); the twins against ops.bias_gelu, F.gelu and autograd; the custom ops
(opcheck, CPU path).

The kernels compiled for the GPU are checked (and timed) by bench/dev/gelu_probe.py on the H200.
Tolerances: tests/TOLERANCES.md's cases, named at each comparison.
"""

import pytest
import torch
import torch.nn.functional as F

from hpcmeg.model import ops
from hpcmeg.kernels import gelu as tg
from helpers import run_in_triton_interpreter

_INTERPRETER_CHECK = r"""
import warnings
import torch
warnings.filterwarnings("ignore", "overflow", RuntimeWarning)  # numpy's exp2 -> inf for very negative h
from hpcmeg.model import ops
from hpcmeg.kernels import gelu as tg

def within_one_ulp(a, b):
    # case 4. a, b in bf16/fp16: |a - b| <= one rounding step of b (2^-7 resp. 2^-10 of |b| bounds the
    # spacing): the interpreter casts fp32 -> bf16 by truncation, torch rounds to nearest. Plus 1e-5:
    # the fp32 twin's 1 + tanh(u) cancels for h ~ -5 (~1e-6 absolute off, the kernels are not)
    step = 2.0 ** -7 if b.dtype == torch.bfloat16 else 2.0 ** -10
    err = (a.float() - b.float()).abs()
    assert bool((err <= b.float().abs() * step + 1e-5).all()), err.max().item()

def check(shape, dtype, blocks=tg.DEFAULT_LAUNCH, rows=None, scale=3.0):
    h = (torch.randn(shape) * scale).to(dtype)
    dg = torch.randn(shape).to(dtype)
    g = tg.gelu_forward(h, blocks)
    dh, dbias = tg.gelu_backward(dg, h, blocks, rows)
    rg = tg.reference_forward(h)
    rdh, rdbias = tg.reference_backward(dg, h)
    assert g.shape == h.shape and g.dtype == dtype and dh.shape == h.shape and dh.dtype == dtype
    assert dbias.shape == (shape[-1],) and dbias.dtype == dtype  # the bias's dtype in the fused MLP
    if dtype == torch.float32:
        # case 2 vs the fp32 twins: their 1 + tanh(u) and 1 - tanh^2(u) cancel for |h| ~ 3..6, ~1e-6
        # absolute off there (the kernels' sigmoid form does not cancel); vs the fp64 formula: tight
        # (numpy's exp2 in fp32 against the exact value: a few u, under rtol 1e-5 / atol 1e-6)
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dh, rdh, rtol=1e-5, atol=1e-5)
        hd = h.double()
        torch.testing.assert_close(g.double(), ops.bias_gelu(hd, torch.zeros((), dtype=hd.dtype)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dh.double(), dg.double() * tg.gelu_grad(hd), rtol=1e-5, atol=1e-6)
    else:
        within_one_ulp(g, rg)
        within_one_ulp(dh, rdh)
    # dbias sums the fp32 dh before rounding on both sides, then rounds once: fp32 tolerance for
    # fp32 (case 2; atol 5e-5: sums of up to 200 rows of dh ~ 1 whose round-off adds up where the
    # sum cancels), one rounding step for bf16/fp16 (against the fp32 sums of the twin on fp32 copies)
    if dtype == torch.float32:
        torch.testing.assert_close(dbias, rdbias, rtol=1e-5, atol=5e-5)
    else:
        exact = tg.reference_backward(dg.float(), h.float())[1]
        within_one_ulp(dbias, exact.to(dtype))
    assert torch.equal(tg.gelu_backward(dg, h, blocks, rows)[1], dbias)  # deterministic

torch.manual_seed(0)
small = tg.Launch(fwd_block=256, bwd_f=64, bwd_rows=8, sum_f=32, sum_rows=4)
for shape in [(37, 200), (2, 9, 96), (64, 512), (5, 1000)]:
    check(shape, torch.float32)
# several partial rows of dbias: F > BLOCK_F, N > rows per tile, R > 1 (and > sum_rows: two sum steps)
assert tg.row_programs(64, 512, torch.device("cpu")) > 1
check((200, 600), torch.float32)
check((200, 600), torch.float32, small, rows=5)
check((3, 37, 200), torch.float32, small, rows=3)
check((37, 200), torch.float32, small, rows=40)  # more row programs than row tiles: empty partials
for dtype in (torch.bfloat16, torch.float16):
    check((64, 512), dtype)
    check((37, 200), dtype, small, rows=3)
# extremes: exp2 overflows to inf for very negative h; g, dh must stay finite and match the twin
h = torch.tensor([[-100.0, -30.0, -9.0, -1e-3, 0.0, 1e-3, 9.0, 30.0, 100.0]])
dg = torch.ones_like(h)
g, (dh, dbias) = tg.gelu_forward(h), tg.gelu_backward(dg, h)
assert torch.isfinite(g).all() and torch.isfinite(dh).all()
# case 2 (no cancellation: the extremes' GELU is 0, h, or a tiny product)
torch.testing.assert_close(g, tg.reference_forward(h), rtol=1e-5, atol=1e-6)
torch.testing.assert_close(dh, tg.reference_backward(dg, h)[0], rtol=1e-5, atol=1e-6)
# no rows: dh empty, dbias zeros
dh, dbias = tg.gelu_backward(torch.empty(0, 64), torch.empty(0, 64))
assert dh.shape == (0, 64) and torch.equal(dbias, torch.zeros(64))
print("ok")
"""


def test_kernels_match_the_twins_in_the_interpreter():
    run_in_triton_interpreter(_INTERPRETER_CHECK)


def test_forward_twin_is_bias_gelu_and_torch_gelu():
    torch.manual_seed(1)
    h = torch.randn(4, 7, 96) * 3
    g = tg.reference_forward(h)
    # the same tanh formula with the bias add of 0 (exact) and maybe another grouping of the
    # polynomial: a few u of |h| <= ~12 in absolute terms, atol 1e-6; torch's GELU kernel: case 2
    torch.testing.assert_close(g, ops.bias_gelu(h, torch.zeros(96)), rtol=0, atol=1e-6)
    torch.testing.assert_close(g, F.gelu(h, approximate="tanh"), rtol=1e-5, atol=1e-6)
    hb = h.bfloat16()
    gb = tg.reference_forward(hb)
    assert gb.dtype == torch.bfloat16
    assert torch.equal(gb, ops.bias_gelu(hb.float(), torch.zeros(96)).bfloat16())  # fp32 math, one rounding


U32 = 2.0 ** -24  # fp32's unit roundoff


def fp32_dh_error_bound(h, dg, dh):
    """|dg * gelu_grad(h) in fp32 - the exact value| <= this, element by element, on any CPU (h, dg the
    fp32 inputs and dh the exact value, as fp64). gelu_grad's operations each round with relative
    error <= u; the constants GELU_C, GELU_A3 rounded to fp32 add u each; so the argument of tanh is
    within 7u of its value. torch's fp32 tanh (SLEEF, MKL or libm, by CPU) is within 4 ulps (<= 8u
    for |t| < 1; SLEEF's and MKL's promise 1 ulp); the argument's error moves t by at most
    (1 - t^2) |arg| 7u <= 3.2u: t within 12u. Then 0.5 (1 + t) within 0.5 * 12u + u, 1 - t*t within
    2 * 12u + 2u, and the second term, a product with A = 0.5 |h| GELU_C (1 + 3 GELU_A3 h^2) (whose own
    roundings add 8u of it), within A (26u) + 8u A; the sum and the multiply by dg one u each:
    |error| <= u (|dg| (7 + 34 A + |g'|) + |dh|) <= u (|dg| (9 + 34 A) + |dh|). (Measured on 10^7
    samples: at most 0.16 of it; the cancelling 1 - t^2 near |h| ~ 3..6 made a fixed atol of 1e-6
    too small for some seeds: up to 1.9e-6 there.)"""
    a = 0.5 * h.abs() * ops.GELU_C * (1 + 3 * tg.GELU_A3 * h * h)
    return U32 * (dg.abs() * (9 + 34 * a) + dh.abs())


def fp32_dbias_error_bound(h, dg, dh):
    """The column sums of the fp32 dh over the leading dims: each term's bound plus the sum's own
    rounding, <= (n - 1) u sum|terms| in any order (n rows)."""
    n = h.numel() // h.shape[-1]
    terms = fp32_dh_error_bound(h, dg, dh).flatten(0, -2).sum(0)
    return terms + n * U32 * dh.abs().flatten(0, -2).sum(0)


def test_twin_derivative_and_bias_gradient_match_autograd():
    torch.manual_seed(2)
    x = (torch.randn(3, 11, 40, dtype=torch.float64) * 3).requires_grad_(True)
    b = torch.zeros(40, dtype=torch.float64, requires_grad=True)
    dg = torch.randn(3, 11, 40, dtype=torch.float64)
    dx, db = torch.autograd.grad(ops.bias_gelu(x, b), (x, b), dg)
    # fp64: the written-out derivative against autograd's, ~10 roundings of u = 2^-53 apart; 1e-12 is ~9000 u
    torch.testing.assert_close(dg * tg.gelu_grad(x.detach()), dx, rtol=1e-12, atol=1e-12)
    # fp32 math on the fp32-rounded inputs against the exact (fp64) derivative at those inputs: within
    # fp32_dh_error_bound element by element, the bias gradient within fp32_dbias_error_bound
    hf, dgf = x.detach().float(), dg.float()
    dh, dbias = tg.reference_backward(dgf, hf)  # fp32 math
    assert dh.dtype == torch.float32 and dbias.shape == (40,)
    h64, dg64 = hf.double(), dgf.double()
    want = dg64 * tg.gelu_grad(h64)
    assert ((dh.double() - want).abs() <= fp32_dh_error_bound(h64, dg64, want)).all()
    assert ((dbias.double() - want.sum((0, 1))).abs() <= fp32_dbias_error_bound(h64, dg64, want)).all()
    # bf16 inputs: dh is rounded to bf16, dbias is the fp32 sum of the unrounded values, rounded to bf16
    hb, dgb = x.detach().bfloat16(), dg.bfloat16()
    dhb, dbiasb = tg.reference_backward(dgb, hb)
    exact = dgb.double() * tg.gelu_grad(hb.double())
    assert dhb.dtype == dbiasb.dtype == torch.bfloat16  # dbias: the fp32 sum, rounded once
    # the fp32 sum s within E of the exact sum, then rounded once to nearest: half a bf16 ulp,
    # <= 2^-8 |s| <= 2^-8 (|exact| + E)
    e = fp32_dbias_error_bound(hb.double(), dgb.double(), exact)
    exact_sum = exact.sum((0, 1))
    assert ((dbiasb.double() - exact_sum).abs() <= 2.0 ** -8 * exact_sum.abs() + (1 + 2.0 ** -8) * e).all()
    rounded = exact.bfloat16().double().sum((0, 1))  # what summing the stored bf16 dh would give
    assert not ((rounded.bfloat16().double() - exact_sum).abs()
                <= 2.0 ** -8 * exact_sum.abs() + (1 + 2.0 ** -8) * e).all()  # so the check above tells them apart


def test_custom_ops_opcheck_and_cpu_path():
    torch.manual_seed(3)
    h, dg = torch.randn(2, 5, 48) * 2, torch.randn(2, 5, 48)
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(tg.gelu_tanh, (h.to(dtype),))
        torch.library.opcheck(tg.gelu_tanh_backward, (dg.to(dtype), h.to(dtype)))
    assert torch.equal(torch.ops.hpcmeg.gelu_tanh(h), tg.reference_forward(h))
    dh, dbias = torch.ops.hpcmeg.gelu_tanh_backward(dg, h)
    rdh, rdbias = tg.reference_backward(dg, h)
    assert torch.equal(dh, rdh) and torch.equal(dbias, rdbias) and dbias.shape == (48,)
    with pytest.raises(ValueError, match="one shape"):
        torch.ops.hpcmeg.gelu_tanh_backward(dg[:, :4], h)
