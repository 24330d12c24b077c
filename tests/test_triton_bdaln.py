"""hpcmeg/model/triton_bdaln.py: the bias-dropout-add + LayerNorm forward that draws its own mask.
Its twin against the plain formula and triton_dropout's mask; the kernel against the twin in
Triton's CPU interpreter (bits equal, out and y to rounding) and compiled for sm90; the custom op
(opcheck); and fused.bias_dropout_add_layer_norm with dropout_impl 'fused' (the kernel's op, its
CPU twin here) through autograd against the plain formula with the same mask.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hpcmeg.model import fused, ops
from hpcmeg.model import triton_bdaln as tb
from hpcmeg.model import triton_dropout as td
from helpers import compile_for_hopper, run_in_triton_interpreter


def _inputs(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x, res = torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 2 + 0.5
    bias, w, b = torch.randn(h, generator=g), 1 + 0.3 * torch.randn(h, generator=g), torch.randn(h, generator=g)
    return [t.to(dtype) for t in (x, bias, res)] + [torch.tensor([1234 + seed], dtype=torch.int64), 0.1] + \
        [t.to(dtype) for t in (w, b)] + [1e-5]


def test_twin_is_the_plain_formula_with_the_mask_of_triton_dropout():
    x, bias, res, seed, p, w, b, eps = _inputs((2, 5, 48))
    out, y, bits = tb.reference_forward(x, bias, res, seed, p, w, b, eps)
    keep = td.reference_keep_mask(seed, [2, 5, 48], p)
    assert torch.equal(bits, td.pack_bits(keep)) and bits.shape == (2 * 5 * 48 // 8,)
    want = res + (x + bias) * keep * td.keep_scale(p)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, ops.layer_norm(want, w, b, eps), rtol=1e-5, atol=1e-5)
    assert 0.85 < keep.float().mean() < 0.95
    with pytest.raises(ValueError, match="H % 8"):
        tb.reference_forward(x[..., :44], bias[:44], res[..., :44], seed, p, w[:44], b[:44], eps)
    with pytest.raises(ValueError, match="p must be"):
        tb.reference_forward(x, bias, res, seed, 0.0, w, b, eps)


def test_custom_op_opcheck():
    for dtype in (torch.float32, torch.bfloat16):
        args = tuple(_inputs((3, 16), dtype))
        torch.library.opcheck(tb.bias_dropout_add_layer_norm, args)
        got = torch.ops.hpcmeg.bias_dropout_add_layer_norm(*args)  # CPU: the twin
        assert all(torch.equal(g, r) for g, r in zip(got, tb.reference_forward(*args)))
        assert got[0].dtype == got[1].dtype == dtype and got[2].dtype == torch.uint8


_INTERPRETER_CHECK = r"""
import torch
from hpcmeg.model import triton_bdaln as tb

def inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x, res = torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 2 + 0.5
    bias, w, b = torch.randn(h, generator=g), 1 + 0.3 * torch.randn(h, generator=g), torch.randn(h, generator=g)
    return [t.to(dtype) for t in (x, bias, res)] + [torch.tensor([2**61 + seed], dtype=torch.int64), 0.1] + \
        [t.to(dtype) for t in (w, b)] + [1e-5]

n = 0
# H = 64: 8 rows per program, 2 programs, the last one ragged; H = 24: 3 of 4 groups live (masked
# lanes); H = 768 as the GPU runs it: one row per program, 96 of 128 groups live
for shape in ((11, 64), (3, 5, 24), (3, 768)):
    for dtype in (torch.float32, torch.bfloat16):
        args = inputs(shape, dtype, n)
        out, y, bits = tb.forward(*args)
        r_out, r_y, r_bits = tb.reference_forward(*args)
        assert torch.equal(bits, r_bits), (shape, dtype)
        assert out.dtype == y.dtype == dtype and out.shape == y.shape == args[0].shape
        if dtype == torch.float32:
            assert torch.equal(out, r_out), (shape, (out - r_out).abs().max())
            torch.testing.assert_close(y, r_y, rtol=1e-5, atol=1e-5)
        else:  # the interpreter rounds fp32 -> bf16 toward zero, the twin to nearest: out within one
            # ulp, and y (the LayerNorm of that out) within a few ulps of its largest value
            assert ((out.float() - r_out.float()).abs() <= r_out.float().abs() * 2.0**-7 + 1e-6).all(), shape
            err = (y.float() - r_y.float()).abs().max().item()
            assert err <= 2.0**-6 * r_y.float().abs().max().item(), (shape, err)
        n += 1
print("ok", n)
"""


def test_kernel_matches_the_twin_in_the_interpreter():
    run_in_triton_interpreter(_INTERPRETER_CHECK, expect="ok 6")


def test_kernels_compile_for_hopper():
    """The forward kernel and the LayerNorm backward with packed bits compile for sm90 (H = 768)."""
    pytest.importorskip("triton")
    from hpcmeg.model import triton_layernorm as tln
    bg, r, warps = tb._plan(12288, 768)
    assert (bg, r, warps) == (128, 1, 4)
    ptr = dict(X="*bf16", BIAS="*bf16", RES="*bf16", W="*bf16", LB="*bf16", OUT="*bf16", Y="*bf16", BITS="*u8",
               seed_ptr="*i64", N="i32", t="i32", scale="fp32", eps="fp32")
    k = compile_for_hopper(tb._bdaln_fwd_kernel, ptr, dict(H=768, BG=bg, R=r), num_warps=warps)
    ptx = k.asm["ptx"]
    assert "mul.hi.u32" in ptx  # the Philox rounds are in the kernel
    # each thread's group of 8 bf16 columns: one 16-byte access per tensor (x, residual, bias,
    # weight, ln_bias in; out, y out), one byte of bits
    assert ptx.count("ld.global.v4.b32") == 5 and ptx.count("st.global.v4.b32") == 2, ptx.count("ld.global")
    assert ptx.count("st.global.b8") == 1
    p = tln.plan(12288, 768, torch.device("cpu"))
    types = dict(DY="*bf16", X="*bf16", W="*bf16", DRES="*bf16", KEEP="*u8", DX="*bf16", DBR="*bf16", PART="*fp32",
                 N="i32", rows_per_prog="i32", eps="fp32", scale="fp32")
    k = compile_for_hopper(tln._ln_bwd_kernel, types,
                           dict(H=768, BLOCK_H=p.block_h, R=p.rows, K=3, HAS_RES=True, HAS_KEEP=True, BIAS_SUM=True,
                                PREFETCH=True, KEEP_BITS=True), num_warps=p.warps)
    # the bits: one byte per thread (its 8 columns) per row loaded, prefetch included, expanded
    # in registers: no shared memory beyond the row sums' exchange of the bool-mask kernel
    ptx = k.asm["ptx"]
    assert ptx.count("ld.global.b8") == 2 and ptx.count("ld.shared.b8") == 0, ptx.count("ld.global.b8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_dropout_impl_through_autograd(monkeypatch, dtype):
    """fused.bias_dropout_add_layer_norm with dropout_impl 'fused' (the custom op; on CPU its twin):
    the forward and every gradient as autograd of the plain formula with the mask the op drew."""
    monkeypatch.setattr(fused, "_in_kernel_mask_for", lambda x, r, w, impl: impl == "fused")
    x, bias, res, _, p, w, b, eps = _inputs((2, 7, 32), dtype, seed=3)
    leaves = [t.clone().requires_grad_() for t in (x, bias, res, w, b)]
    torch.manual_seed(11)
    out, y = fused.bias_dropout_add_layer_norm(leaves[0], leaves[1], leaves[2], p, True, leaves[3], leaves[4], eps,
                                               dropout_impl="fused")
    torch.manual_seed(11)
    keep = td.reference_keep_mask(td.draw_seed("cpu"), [2, 7, 32], p)  # the seed the op drew
    g = torch.Generator().manual_seed(5)
    gy, gout = torch.randn(y.shape, generator=g).to(dtype), torch.randn(out.shape, generator=g).to(dtype)
    (y.float() * gy.float()).sum().add((out.float() * gout.float()).sum()).backward()
    ref = [t.detach().double().requires_grad_() for t in (x, bias, res, w, b)]
    r_out = ref[2] + (ref[0] + ref[1]) * keep * td.keep_scale(p)
    r_y = F.layer_norm(r_out, (32,), ref[3], ref[4], eps)
    (r_y * gy.double()).sum().add((r_out * gout.double()).sum()).backward()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), r_out.detach(), **tol)
    torch.testing.assert_close(y.double(), r_y.detach(), **tol)
    for name, a, r in zip(("x", "bias", "residual", "weight", "ln_bias"), leaves, ref):
        torch.testing.assert_close(a.grad.double(), r.grad, **tol, msg=lambda m: f"{name}: {m}")
    # dropped elements pass no gradient to x
    assert (leaves[0].grad[~keep] == 0).all()


def test_fused_dropout_impl_in_the_compiled_model(monkeypatch):
    """A fused GPT with dropout_impl 'fused' compiles (the op in the graph), reproduces its loss for a
    seed and moves with it; without the kernel (supports False) the same config runs the 'triton' path."""
    from hpcmeg.model.config import GPTConfig
    from hpcmeg.model.gpt import GPT
    if not fused.HAVE_TRITON_DROPOUT:
        pytest.skip("triton is not installed")
    calls = []
    monkeypatch.setattr(fused, "_in_kernel_mask_for", lambda x, r, w, impl: calls.append(impl) or impl == "fused")
    cfg = GPTConfig(2, 32, 4, 64, 16, 64, hidden_dropout=0.2, attention_dropout=0.0, fused=True, dropout_impl="fused")
    d = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))

    def loss(seed):
        torch.manual_seed(0)
        m = GPT(cfg).train()
        torch.manual_seed(seed)
        out = torch.compile(m)(d[:, :-1], d[:, 1:]).mean()
        out.backward()
        torch._dynamo.reset()
        return out.item(), m.encoder.layers[0].mlp.dense_4h_to_h.bias.grad.clone()
    (a, ga), (b, gb), (c, _) = loss(5), loss(5), loss(6)
    assert a == b and torch.equal(ga, gb) and a != c
    assert calls.count("fused") >= 4  # both branch ends of both layers
    plain = GPT(dataclasses.replace(cfg, fused=False))
    assert plain.encoder.layers[0].p == 0.2
