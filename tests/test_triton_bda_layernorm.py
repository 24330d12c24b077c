"""hpcmeg/model/triton_bda_layernorm.py (layernorm_impl 'triton_forward'): the bias-dropout-add +
LayerNorm forward kernel against its plain twin in Triton's CPU interpreter (fp32 and bf16, no /
bool / packed keep, ragged shapes, several rows per program, with and without prefetch); the
custom op (opcheck); the kernel compiled for sm90; the fused model with 'triton_forward' against
'triton', eager and compiled.

The kernel compiled for the GPU is timed by bench/lease.sh's u1.3B stage (untimed so far).
Tolerances: tests/TOLERANCES.md's cases, named at each comparison.
"""

import dataclasses
import re

import pytest
import torch

from hpcmeg.model import triton_bda_layernorm as bda
from hpcmeg.model import triton_dropout as td
from hpcmeg.model import triton_layernorm as tln
from helpers import run_in_triton_interpreter

_INTERPRETER_CHECK = r"""
import torch
import torch.nn.functional as F
from hpcmeg.model import triton_bda_layernorm as bda
from hpcmeg.model import triton_layernorm as tln
from hpcmeg.model import triton_dropout as td
from hpcmeg.model.triton_dropout import pack_bits, unpack_bits

def inputs(shape, dtype, keep, wdtype=torch.float32):
    h = shape[-1]
    x = torch.randn(shape).to(dtype)
    residual = (torch.randn(shape) * 3 + 1).to(dtype)  # a mean and a scale far from LN's output
    mask = torch.rand(shape) > 0.2 if keep else None
    if keep == "bits":
        mask = pack_bits(mask)
    return (x, (0.5 * torch.randn(h)).to(wdtype), residual, mask, 1.25,
            (1 + 0.3 * torch.randn(h)).to(wdtype), torch.randn(h).to(wdtype), 1e-5)

torch.manual_seed(0)
n_checks = 0
cpu = torch.device("cpu")
few = tln.Launch(programs=3)
# fp32: the kernel against the twin. H = 100 (BLOCK_H 128, R 8) over 3 programs with a ragged tail,
# with and without prefetch; H = 96 for the packed mask (H % 8 == 0); a model width (BLOCK_H 1024,
# R 1); leading dims with the default plan
cases = [((37, 100), None, few), ((37, 100), "bool", few), ((37, 100), "bool", tln.Launch(programs=3, prefetch=False)),
         ((37, 96), "bits", few), ((39, 768), "bits", tln.Launch(programs=8)), ((2, 45, 256), "bool", tln.DEFAULT_LAUNCH)]
for shape, keep, launch in cases:
    args = inputs(shape, torch.float32, keep)
    out, y = bda.bda_layer_norm(*args, launch=launch)
    r_out, r_y = bda.reference_forward(*args)
    assert out.shape == y.shape == r_out.shape and out.dtype == y.dtype == torch.float32, (shape, keep)
    # out: residual + (x + bias) * keep * scale, the twin's operations in its order: equal to the bit
    # in practice (case 1), held to a few u; y: LayerNorm's row mean and variance summed in blocks of
    # BLOCK_H against torch's reduction, numpy's rsqrt against torch's (case 2; measured <= 1.5e-6)
    torch.testing.assert_close(out, r_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, r_y, rtol=1e-5, atol=1e-5)
    n_checks += 1
# the packed mask gives the bool mask's results bit for bit
args = inputs((39, 768), torch.float32, "bool")
packed = args[:3] + (pack_bits(args[3]),) + args[4:]
for a, b in zip(bda.bda_layer_norm(*packed), bda.bda_layer_norm(*args)):
    assert torch.equal(a, b)
n_checks += 1
# bf16 (fp32 or bf16 LN parameters): out is the fp32 sum rounded once, y the LayerNorm of that
# rounded out, rounded once. The interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest):
# one bf16 ulp either way, <= 2^-7 of the value (case 4; the 1.01 covers the fp32 values' case-2
# distance, the absolute terms values near 0: 1e-6 for out's exact sum, 1e-5 for y's case-2 error)
ulp = 2.0 ** -7 * 1.01
for wdtype in (torch.float32, torch.bfloat16):
    args = inputs((2, 45, 256), torch.bfloat16, "bits", wdtype)
    x, bias, residual, keep, scale, w, b, eps = args
    out, y = bda.bda_layer_norm(*args)
    assert out.dtype == y.dtype == torch.bfloat16
    m = unpack_bits(keep, list(x.shape))
    want_out = residual.float() + (x.float() + bias.to(torch.bfloat16).float()) * m * scale
    # (an fp32 bias is rounded to bf16 in the kernel too: toward zero in the interpreter)
    bound = (want_out.abs() + bias.float().abs() * scale) * ulp + 1e-6
    assert ((out.float() - want_out).abs() <= bound).all(), (wdtype, (out.float() - want_out).abs().max())
    want_y = F.layer_norm(out.float(), (256,), w.float(), b.float(), eps)
    assert ((y.float() - want_y).abs() <= want_y.abs() * ulp + 1e-5).all(), (wdtype, (y.float() - want_y).abs().max())
    n_checks += 1
# the kernel drawing its own mask: the packed bits are triton_dropout's for (seed, shape, p) bit for
# bit, and out, y are the twin's with them (several programs, ragged, with and without prefetch)
seed = torch.tensor([2 ** 61 + 12345], dtype=torch.int64)  # both 32-bit halves of the key in play
for shape, launch in (((37, 96), few), ((9, 768), tln.DEFAULT_LAUNCH), ((2, 5, 2048), tln.Launch(programs=4, prefetch=False))):
    x, bias, residual, _, _, w, b, eps = inputs(shape, torch.float32, None)
    for p in (0.1, 0.5, 0.0):
        out, y, bits = bda.bda_layer_norm_drawn(x, bias, residual, seed, p, w, b, eps, launch=launch)
        r_out, r_y, r_bits = bda.reference_forward_drawn(x, bias, residual, seed, p, w, b, eps)
        assert torch.equal(bits, r_bits) and torch.equal(bits, td.reference_keep_bits(seed, list(shape), p)), (shape, p)
        kept = unpack_bits(bits, list(shape)).float().mean().item()
        assert abs(kept - (1 - p)) < 0.05, (shape, p, kept)  # a fixed seed: no flakiness
        torch.testing.assert_close(out, r_out, rtol=1e-6, atol=1e-6)  # as in the fp32 cases above
        torch.testing.assert_close(y, r_y, rtol=1e-5, atol=1e-5)
        n_checks += 1
print("ok", n_checks)
"""


def test_kernel_matches_the_twin_in_the_interpreter():
    run_in_triton_interpreter(_INTERPRETER_CHECK, expect="ok 18")


def test_custom_op_opcheck_and_cpu_path():
    from hpcmeg.model.triton_dropout import pack_bits
    torch.manual_seed(2)
    x, res = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    bias, w, b = torch.randn(24), torch.randn(24), torch.randn(24)
    keep = torch.rand(2, 5, 24) > 0.3
    for args in ((x, bias, res, None, 1.0, w, b, 1e-5), (x, bias, res, keep, 1 / 0.7, w, b, 1e-5),
                 (x.bfloat16(), bias, res.bfloat16(), pack_bits(keep), 2.0, w, b, 1e-5),
                 (x.bfloat16(), bias.bfloat16(), res.bfloat16(), keep, 2.0, w.bfloat16(), b.bfloat16(), 1e-5)):
        torch.library.opcheck(bda.bda_layer_norm_op, args)
        got = torch.ops.hpcmeg.bda_layer_norm(*args)  # CPU: the twin
        for g, r in zip(got, bda.reference_forward(*args)):
            assert torch.equal(g, r) and g.dtype == args[0].dtype
    with pytest.raises(ValueError, match="ln_bias"):
        bda.reference_forward(x, bias, res, None, 1.0, w, torch.randn(23), 1e-5)
    with pytest.raises(ValueError, match="packed keep"):
        bda.bda_layer_norm(x, bias, res, torch.zeros(2, 5, 2, dtype=torch.uint8), 1.0, w, b, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        bda.bda_layer_norm(x, bias, res.double(), None, 1.0, w, b, 1e-5)
    # the drawing op: its twin's bits are triton_dropout's
    seed = torch.tensor([77], dtype=torch.int64)
    for args in ((x, bias, res, seed, 0.1, w, b, 1e-5), (x.bfloat16(), bias, res.bfloat16(), seed, 0.3, w, b, 1e-5)):
        torch.library.opcheck(bda.bda_layer_norm_drawn_op, args)
        out, y, bits = torch.ops.hpcmeg.bda_layer_norm_drawn(*args)
        assert torch.equal(bits, td.reference_keep_bits(seed, list(x.shape), args[4]))
        r_out, r_y = bda.reference_forward(*args[:3], bits, td.keep_scale(args[4]), *args[5:])
        assert torch.equal(out, r_out) and torch.equal(y, r_y)
    with pytest.raises(ValueError, match="multiple of 8"):
        bda.reference_forward_drawn(x[..., :20], bias[:20], res[..., :20], seed, 0.1, w[:20], b[:20], 1e-5)


def test_kernel_compiles_for_hopper():
    """_bda_ln_fwd_kernel at 1.3B's launch (bf16, H = 2048, packed keep: 8 warps, one row per
    iteration, prefetch) compiles for sm90 with Triton's compiler: 16-byte loads of x and the
    residual and one 1-byte load of the mask per thread per row (each twice: this row and the
    prefetched one)."""
    pytest.importorskip("triton")
    from helpers import compile_for_hopper
    p = tln.plan(8192, 2048, torch.device("cpu"))
    assert (p.rows, p.warps) == (1, 8)
    types = dict(X="*bf16", RES="*bf16", KEEP="*u8", BIAS="*bf16", W="*bf16", B="*bf16", OUT="*bf16", Y="*bf16",
                 SEED="*bf16", N="i32", rows_per_prog="i32", eps="fp32", scale="fp32", thresh="i32")
    ptx = compile_for_hopper(bda._bda_ln_fwd_kernel, types, dict(
        H=2048, BLOCK_H=p.block_h, R=p.rows, HAS_KEEP=True, KEEP_BITS=True, PREFETCH=True, DRAW=False),
        num_warps=p.warps).asm["ptx"]
    loads = re.findall(r"ld\.global\.[\w.]+", ptx)
    assert loads.count("ld.global.b8") == 2, loads
    assert loads.count("ld.global.v4.b32") >= 4, loads
    # drawing the mask: no mask loads, one Philox call (10 rounds, 2 high multiplies each) and one
    # byte store per thread per row
    ptx = compile_for_hopper(bda._bda_ln_fwd_kernel, dict(types, SEED="*i64"), dict(
        H=2048, BLOCK_H=p.block_h, R=p.rows, HAS_KEEP=False, KEEP_BITS=False, PREFETCH=True, DRAW=True),
        num_warps=p.warps, aligned_ints=("N",)).asm["ptx"]
    assert "ld.global.b8" not in ptx and ptx.count("mul.hi.u32") == 20, ptx.count("mul.hi.u32")
    assert len(re.findall(r"st\.global\.b8", ptx)) == 1


def _tiny(**kw):
    from hpcmeg.model.config import GPTConfig
    return GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                     max_position_embeddings=64, padded_vocab_size=128, fused=True, hidden_dropout=0.1,
                     attention_dropout=0.0, **kw)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_model_with_the_forward_kernel_matches_triton(compiled):
    """The fused model (CPU, fp32: the op's twin) with layernorm_impl 'triton_forward' against
    'triton': the same loss and gradients, with dropout on (the same masks from the same seed)."""
    from hpcmeg.model.gpt import GPT
    tok = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    results = {}
    for impl in ("triton", "triton_forward"):
        m = GPT(_tiny(layernorm_impl=impl), init_seed=3)
        m.train()
        fn = torch.compile(m) if compiled else m
        torch.manual_seed(5)
        loss = fn(tok, tok).float().mean()
        loss.backward()
        results[impl] = (loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
    (l0, g0), (l1, g1) = results["triton"], results["triton_forward"]
    # on CPU both run the ops' twins, the same arithmetic in another grouping of ops: equal to the bit
    # in practice; the loss held to a few u, the gradients to case 2 (atol 1e-6: ~1e-3-sized gradients)
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=lambda s: f"{n}: {s}")
    with pytest.raises(ValueError, match="layernorm_impl"):
        dataclasses.replace(_tiny(), layernorm_impl="triton_fwd")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_drawing_forward_matches_the_drawn_bits(compiled):
    """_BiasDropoutAddLayerNorm given (seed, p) (the kernel draws the mask; here the op's twin) against
    the same given triton_dropout's bits of that seed: the same out, y and gradients of x, bias,
    residual and the LN parameters. (The model takes this path on CUDA only, with dropout_impl
    'triton_bits'; compiled with fullgraph: the op is one opaque node.)"""
    from hpcmeg.model import fused
    torch.manual_seed(4)
    x, res = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    bias, w, b = torch.randn(64), 1 + 0.1 * torch.randn(64), torch.randn(64)
    seed, p = torch.tensor([99], dtype=torch.int64), 0.2
    up = torch.randn(2, 16, 64)

    def run(draw):
        leaves = [t.clone().requires_grad_() for t in (x, bias, res, w, b)]
        xx, bb, rr, ww, lb = leaves
        if draw:
            fn = lambda: fused._BiasDropoutAddLayerNorm.apply(xx, bb, rr, None, td.keep_scale(p), ww, lb, 1e-5,
                                                               True, True, seed, p)
        else:
            keep = td.reference_keep_bits(seed, list(x.shape), p)
            fn = lambda: fused._BiasDropoutAddLayerNorm.apply(xx, bb, rr, keep, td.keep_scale(p), ww, lb, 1e-5,
                                                               True, True)
        out, y = torch.compile(fn, fullgraph=True)() if compiled else fn()
        (out * up + y * up.flip(-1)).sum().backward()
        return [out.detach(), y.detach()] + [t.grad for t in leaves]

    for a, r in zip(run(True), run(False)):
        assert torch.equal(a, r)
    assert float(run(True)[3].abs().sum()) > 0  # the bias got a gradient
