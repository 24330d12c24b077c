"""hpcmeg/kernels/attention.py: the Triton flash attention (forward, backward, keep-mask bits)
against its plain PyTorch twins in Triton's CPU interpreter; the twins against autograd and
against PyTorch SDPA; the custom op (opcheck); the model with attention_backend='triton' against
the default backend, eager and under torch.compile.

The kernels compiled for the GPU are checked by bench/dev/attention_probe.py on the H200.
Tolerances: tests/TOLERANCES.md's cases, named at each comparison.
"""

import pytest
import torch
import torch.nn.functional as F

from hpcmeg.kernels import attention as ta
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt
from helpers import compile_for_hopper, run_in_triton_interpreter

_INTERPRETER_CHECK = r"""
import torch
from hpcmeg.kernels import attention as ta

seed = torch.tensor([123456789012345], dtype=torch.int64)
S, BH = 256, 3
need = torch.arange(S // 16).view(1, -1) <= (torch.arange(S) // 16).view(-1, 1)  # words the kernels read
want = ta.reference_bits(seed, BH, S, 0.3)[:, need]
# the default tiles, then taller and wider ones and shorter rows on more warps
for bl in (ta.DEFAULT_LAUNCH, ta.Launch(bits_rows=128, bits_groups=4), ta.Launch(bits_rows=32, bits_groups=8, bits_warps=8)):
    bits = ta.keep_bits(seed, BH, S, 0.3, bl)
    assert torch.equal(bits[:, need], want), ("keep bits", bl)
# thresholds with the top bit set and the extremes (the packing compares bytes 4 at a time)
for p in (0.05, 0.499, 0.5, 0.6, 0.99):
    assert torch.equal(ta.keep_bits(seed, 1, 128, p)[:, need[:128, :8]], ta.reference_bits(seed, 1, 128, p)[:, need[:128, :8]]), p

torch.manual_seed(0)
B, S, H, D = 2, 128, 2, 16
# several blocks per row, tiles of one or two keep words per row (16 or 32 columns)
small = ta.Launch(fwd_m=32, fwd_n=16, dkv_n=32, dkv_m=16, dq_m=32, dq_n=16)
# one diagonal block per program (its rows span S); 4 keep words per tile row forward, 8 in dK/dV, 2 in dQ
wide = ta.Launch(fwd_m=128, fwd_n=64, dkv_n=128, dkv_m=32, dq_m=128, dq_n=32)
# every tiling with dropout; without it (DROPOUT=False only skips the keep-word loads and the scaling,
# the tiles' loops are the same code) the default tiles alone: the interpreter costs ~1.5 s a pass
for p, tilings in ((0.0, (ta.DEFAULT_LAUNCH,)), (0.2, (small, ta.DEFAULT_LAUNCH, wide))):
    for blocks in tilings:
        qkv = torch.randn(B, S, H, 3 * D)
        out, lse, bits = ta.forward(qkv, seed, p, blocks)
        # case 2, 10x wider: the kernels take exp2 of scores scaled by log2(e) block by block with an
        # online max (each rescale one rounding more, the scaled argument's rounding times |score| ~ 10
        # in the exponent), the twin softmax in one pass; measured <= 3e-6 against 1e-4
        torch.testing.assert_close(out, ta.reference(qkv, seed, p), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, ta._reference_lse2(qkv), atol=1e-4, rtol=1e-4)  # the same online pass
        do = torch.randn_like(out)
        g, db = ta.backward(do, qkv, out, lse, bits, p, blocks, bias_grad=True)
        g32 = ta._reference_dqkv32(do, qkv, seed, p)
        # as out, plus the softmax backward's cancellation (P recomputed from lse, dS summed over the
        # key and query blocks): measured 2.9e-6 against 1e-4
        torch.testing.assert_close(g, g32, atol=1e-4, rtol=1e-4)
        # the QKV bias gradient from the kernels' row-block sums: dqkv summed over batch and sequence
        # (256 rows of O(1) terms in another grouping, case 2: sqrt(256) u times their ~200 total
        # magnitude is ~2e-4 where a sum cancels, hence atol 1e-3; measured 1.3e-5)
        torch.testing.assert_close(db, ta.reference_bias_grad(g32, torch.float32), atol=1e-3, rtol=1e-4)
        assert db.shape == (H * 3 * D,)
        g2, none = ta.backward(do, qkv, out, lse, bits, p, blocks)  # without: the same dqkv, no bias sums
        assert torch.equal(g2, g) and none.numel() == 0
print("ok")
"""


def test_kernels_match_the_twins_in_the_interpreter():
    run_in_triton_interpreter(_INTERPRETER_CHECK)


def test_shipped_tiles_compile_to_wgmma_without_spills():
    """The default tiles at the head dims GPT-2's sizes use (64; 128 at 1.3B), compiled for sm90 as a
    launch specializes them (strides and the sequence length multiples of 16): every kernel on
    wgmma (Hopper's warpgroup MMA; a tile under 64 rows per warpgroup falls back to mma.sync) and
    without register spills. (Without the integer hints the loads compile to 2-byte scalars, no
    cp.async pipelining, and the 128 kernels spill: a static reading that misleads.)"""
    pytest.importorskip("triton")
    from helpers import ptxas_spill_bytes
    ptrs = dict(QKV="*bf16", O="*bf16", DO="*bf16", DQKV="*bf16", LSE="*fp32", DELTA="*fp32", BITS="*i16",
                PQ="*fp32", PKV="*fp32")
    ints = {n: "i32" for n in ("s_b", "s_s", "s_h", "o_b", "o_s", "o_h", "H", "S", "thresh")}
    types = {**ptrs, **ints, "keep_scale": "fp32", "qk_scale": "fp32", "sm_scale": "fp32"}
    aligned = ("s_b", "s_s", "s_h", "o_b", "o_s", "o_h", "S")
    b = ta.DEFAULT_LAUNCH
    for d in (64, 128):
        flags = dict(D=d, DROPOUT=True)
        for kernel, tiles, warps, stages in (
                (ta._attn_fwd_kernel, dict(BM=b.fwd_m, BN=b.fwd_n), b.fwd_warps, b.fwd_stages),
                (ta._attn_dkv_kernel, dict(BN=b.dkv_n, BM=b.dkv_m, BIAS_GRAD=True), b.bwd_warps, b.bwd_stages),
                (ta._attn_dq_kernel, dict(BM=b.dq_m, BN=b.dq_n, BIAS_GRAD=True), b.bwd_warps, b.bwd_stages)):
            k = compile_for_hopper(kernel, types, dict(flags, **tiles), warps, stages, aligned_ints=aligned)
            name = f"{kernel.fn.__name__} at head dim {d}"
            assert "wgmma.mma_async" in k.asm["ptx"], name
            assert "cp.async" in k.asm["ptx"], name  # the K/V (Q/dO) tiles pipelined into shared memory
            assert ptxas_spill_bytes(k) == 0, name


def test_kernels_compile_for_hopper():
    """What the GPU runs: the default tiles at head dim 64; wider backward iterations (dkv_m = dq_n =
    64) at head dim 128 (each fits an SM's shared memory)."""
    pytest.importorskip("triton")
    ptrs = dict(QKV="*bf16", O="*bf16", DO="*bf16", DQKV="*bf16", LSE="*fp32", DELTA="*fp32", BITS="*i16",
                PQ="*fp32", PKV="*fp32")
    ints = {n: "i32" for n in ("s_b", "s_s", "s_h", "o_b", "o_s", "o_h", "H", "S", "thresh")}
    types = {**ptrs, **ints, "keep_scale": "fp32", "qk_scale": "fp32", "sm_scale": "fp32"}
    other = ta.Launch(dkv_m=64, dq_n=64)
    for d, blocks in ((64, ta.DEFAULT_LAUNCH), (128, other)):
        flags = dict(D=d, DROPOUT=True)
        fwd = compile_for_hopper(ta._attn_fwd_kernel, types, dict(flags, BM=blocks.fwd_m, BN=blocks.fwd_n),
                                 blocks.fwd_warps, blocks.fwd_stages)
        flags["BIAS_GRAD"] = True  # the backward as the model runs it (the QKV bias gradient's row sums)
        assert fwd.metadata.shared <= 227 * 1024  # fits an H100/H200 SM
        for kernel, tiles in ((ta._attn_dkv_kernel, dict(BN=blocks.dkv_n, BM=blocks.dkv_m)),
                              (ta._attn_dq_kernel, dict(BM=blocks.dq_m, BN=blocks.dq_n))):
            k = compile_for_hopper(kernel, types, dict(flags, **tiles), blocks.bwd_warps, blocks.bwd_stages)
            assert k.metadata.shared <= 227 * 1024
        compile_for_hopper(ta._attn_bias_grad_kernel, dict(PQ="*fp32", PKV="*fp32", DBIAS="*bf16", NQ="i32",
                                                           NK="i32", H="i32"), dict(D=d, ROWS=32), 1)
    compile_for_hopper(ta._attn_bits_kernel, dict(seed_ptr="*i64", BITS="*i16", S="i32", thresh="i32"),
                       dict(R=64, G=8), 4)


def test_keep_mask_statistics_and_seed_dependence():
    seed = torch.tensor([42], dtype=torch.int64)
    keep = ta.reference_keep(seed, 4, 256, 0.1)
    t, scale = ta.dropout_threshold(0.1)
    assert t == 26 and scale == pytest.approx(256 / 230)
    assert abs(keep.float().mean().item() - (1 - t / 256)) < 0.005
    assert not torch.equal(keep, ta.reference_keep(torch.tensor([43]), 4, 256, 0.1))
    assert not torch.equal(keep[0], keep[1])  # heads draw different masks
    assert ta.reference_keep(seed, 1, 64, 0.0).all()
    unpacked = ((ta.reference_bits(seed, 4, 256, 0.1).to(torch.int32).unsqueeze(-1) >> torch.arange(16)) & 1)
    assert torch.equal(unpacked.bool().view(4, 256, 256), keep)
    with pytest.raises(ValueError, match="dropout p"):
        ta.dropout_threshold(1.0)


def test_twins_against_autograd_and_sdpa():
    torch.manual_seed(1)
    seed = torch.tensor([7], dtype=torch.int64)
    qkv = torch.randn(2, 128, 3, 48)
    do = torch.randn(2, 128, 3, 16)
    for p in (0.0, 0.25):
        x = qkv.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(ta.reference(x, seed, p), x, do)
        # case 2; rtol 1e-4: the softmax backward P * (dP - rowsum(dP * P)) cancels, written out here
        # and in autograd's own order (measured 2.4e-7 absolute)
        torch.testing.assert_close(ta.reference_backward(do, qkv, seed, p), g, atol=1e-5, rtol=1e-4)
    q, k, v = (t.transpose(1, 2) for t in qkv.split(16, dim=-1))
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(ta.reference(qkv, seed, 0.0), sdpa, atol=1e-5, rtol=1e-4)  # as above
    out, lse, bits = torch.ops.hpcmeg.flash_attention(qkv, seed, 0.25)  # CPU: the twin
    torch.testing.assert_close(out, ta.reference(qkv, seed, 0.25))  # case 1 (under case 5's default)
    assert bits.numel() == 0 and lse.shape == (6, 128)


def test_custom_op_opcheck_and_supports():
    seed = torch.tensor([77], dtype=torch.int64)
    torch.library.opcheck(ta.flash_attention, (torch.randn(1, 128, 2, 48, requires_grad=True), seed, 0.2))
    # with the QKV bias whose gradient the op returns
    torch.library.opcheck(ta.flash_attention, (torch.randn(1, 128, 2, 48, requires_grad=True), seed, 0.2,
                                               torch.randn(96, requires_grad=True)))
    assert ta.supports(torch.empty(1, 256, 2, 192))
    assert not ta.supports(torch.empty(1, 100, 2, 192))  # sequence not a multiple of 128
    assert not ta.supports(torch.empty(1, 128, 2, 3 * 24))  # head dim 24


def _model(**kw):
    cfg = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
               max_position_embeddings=128, padded_vocab_size=128, fused=True, hidden_dropout=0.0)
    return build_gpt(GPTConfig(**cfg, **kw), init_seed=1)


def test_model_with_triton_backend_matches_default_and_compiles():
    tok = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(0))
    a, b = _model(attention_dropout=0.0), _model(attention_dropout=0.0, attention_backend="triton")
    la, lb = a(tok, tok).mean(), b(tok, tok).mean()
    la.backward()
    lb.backward()
    # the twin against SDPA inside a model: the mean loss a few roundings apart (case 5), the gradients case 3
    torch.testing.assert_close(la, lb)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-5, rtol=1e-4, msg=n)
    # dropout: same seed, same loss; another seed, another mask; compiled == eager with torch's RNG
    c = _model(attention_dropout=0.3, attention_backend="triton")
    torch.manual_seed(5)
    l1 = c(tok, tok).mean()
    torch.manual_seed(5)
    assert torch.equal(c(tok, tok).mean(), l1)
    torch.manual_seed(6)
    assert not torch.equal(c(tok, tok).mean(), l1)
    import torch._inductor.config as ic
    with ic.patch(fallback_random=True):
        torch.manual_seed(5)
        lc = torch.compile(c, fullgraph=True)(tok, tok).mean()
        lc.backward()
        gc = [p.grad.clone() for p in c.parameters()]
        c.zero_grad()
        torch.manual_seed(5)
        c(tok, tok).mean().backward()
    torch.testing.assert_close(lc, l1)  # compiled against eager, the same masks: case 5 on the loss
    for g, p in zip(gc, c.parameters()):  # case 3
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)


def test_qkv_bias_gradient_comes_from_the_attention_op():
    """With the Triton backend the QKV GEMM adds its bias detached and the attention op returns the
    bias gradient (the kernels' row sums; on CPU the twin's): the same gradients as the default
    backend, also where the kernels refuse the shape (s = 64: SDPA with a zero add carries it)."""
    for s in (128, 64):
        tok = torch.randint(0, 128, (2, s), generator=torch.Generator().manual_seed(s))
        a, b = _model(attention_dropout=0.0), _model(attention_dropout=0.0, attention_backend="triton")
        a(tok, tok).mean().backward()
        b(tok, tok).mean().backward()
        for la, lb in zip(a.encoder.layers, b.encoder.layers):
            qa, qb = la.self_attention.query_key_value, lb.self_attention.query_key_value
            assert qb.bias.grad is not None and qb.bias.grad.abs().sum() > 0
            # case 3: the bias gradient summed by the attention op's twin, not by the GEMM's backward
            torch.testing.assert_close(qb.bias.grad, qa.bias.grad, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(qb.weight.grad, qa.weight.grad, atol=1e-5, rtol=1e-4)
        with torch.no_grad():  # no autograd: the bias stays in the GEMM, nothing to split
            torch.testing.assert_close(b(tok, tok), a(tok, tok), atol=1e-5, rtol=1e-4)  # logits: case 3


def test_qkv_bias_split_with_main_grad_sinks():
    """Gradient-accumulation fusion: the QKV weight's GEMM adds into its main grad while its bias
    (given detached) gets no sum there; the buffer's main grads equal the default backend's."""
    from hpcmeg.train.optim import AdamWConfig, build_optimizer
    from hpcmeg.train.step import TrainStep
    g = torch.Generator().manual_seed(9)
    mbs = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in
           (torch.randint(0, 128, (2, 129), generator=g) for _ in range(2))]
    grads = {}
    for backend in ("auto", "triton"):
        m = _model(attention_dropout=0.0, attention_backend=backend)
        buf, opt = build_optimizer(m, AdamWConfig(1e-3), bucket_numel=5000, wgrad_fusion=True)
        TrainStep(m, buf, opt, "fp32", grad_clip=0.0, device="cpu").run(mbs)
        grads[backend] = {n: buf.grad_data[slice(*buf.locate(p))].clone() for n, p in m.named_parameters()}
    for n, want in grads["auto"].items():  # case 3; atol 1e-6: main grads of a mean loss, mostly ~1e-3
        torch.testing.assert_close(grads["triton"][n], want, atol=1e-6, rtol=1e-4, msg=n)
    assert grads["triton"]["encoder.layers.0.self_attention.query_key_value.bias"].abs().sum() > 0
