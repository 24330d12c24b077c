"""Each fast op of hpcmeg/fused/ops.py against its plain twin in hpcmeg/model/ops.py (fp32, CPU).

The GPU/bf16 side of the same check is bench/gpu_agreement.py (run on the H200).
Tolerances: tests/TOLERANCES.md's cases, named at each comparison.
"""
import dataclasses

import pytest
import torch

from hpcmeg.fused import linear_ce as fused_ce
from hpcmeg.fused import ops as fused
from hpcmeg.model import ops
from hpcmeg.model.config import GPTConfig
from hpcmeg.fused.model import build_gpt

# case 2 (fp32, reordered): fused/compiled ops against the plain ones, the same math with other
# reduction orders (LayerNorm's row statistics, softmax sums, GEMMs) and tanh/exp implementations
TOL = dict(rtol=1e-5, atol=1e-5)


def _grads(fn, *inputs):
    """Outputs and input gradients of fn under a fixed random upstream gradient."""
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in ins if t.grad is not None]


def _assert_same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **TOL)


def test_layer_norm_and_bias_gelu():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 48) * 3 + 1, torch.randn(48), torch.randn(48)
    for name, args in [("layer_norm", (x, w, b)), ("bias_gelu", (x, b))]:
        extra = (1e-5,) if name == "layer_norm" else ()
        fo, fg = _grads(lambda *t: getattr(fused, name)(*t, *extra), *args)
        po, pg = _grads(lambda *t: getattr(ops, name)(*t, *extra), *args)
        _assert_same(fo + fg, po + pg)
    # tanh-GELU, not erf-GELU: the two differ by ~1e-3 near |x|~2, far above the tolerance
    y = torch.linspace(-4, 4, 101)
    assert (ops.bias_gelu(y, torch.zeros(1)) - torch.nn.functional.gelu(y)).abs().max() > 1e-4


def test_linear_bias_gelu():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 48), torch.randn(96, 48) * 0.2, torch.randn(96)
    fo, fg = _grads(fused.linear_bias_gelu, x, w, b)
    po, pg = _grads(ops.linear_bias_gelu, x, w, b)
    assert len(fg) == 3
    _assert_same(fo + fg, po + pg)


def test_linear_cross_entropy_bf16_and_fp32():
    """The LM-head loss (grad_in_forward: the logits become their own gradient in the forward, the
    per-token scale folded into the backward's GEMMs) against autograd of F.cross_entropy on fp32
    logits, with a non-uniform upstream gradient (a loss mask) and repeated labels."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(4, 9, 32), torch.randn(300, 32) * 0.5
    labels = torch.randint(0, 300, (4, 9))
    labels[0, :3] = 7
    g = torch.rand(4, 9)
    # bf16, case 4: both sides form the logits from the same bf16 operands (fp32 accumulation, one
    # rounding each) and (softmax - onehot) * g in fp32; the fused side rounds the gradient to bf16
    # once before its GEMMs: bf16 products of sums over 300 logits, within rtol 2e-2 of the value
    for dt, tol in ((torch.float32, TOL), (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))):
        h1, w1 = hidden.to(dt).clone().requires_grad_(), weight.to(dt).clone().requires_grad_()
        h2, w2 = hidden.to(dt).clone().requires_grad_(), weight.to(dt).clone().requires_grad_()
        la = fused_ce.linear_cross_entropy(h1, w1, labels)
        lb = torch.nn.functional.cross_entropy((h2 @ w2.t()).float().flatten(0, 1), labels.flatten(),
                                               reduction="none").view(4, 9)
        assert la.dtype == torch.float32
        torch.testing.assert_close(la, lb, **tol)
        (la * g).sum().backward()
        (lb * g).sum().backward()
        assert h1.grad.dtype == dt and w1.grad.dtype == dt
        torch.testing.assert_close(h1.grad.float(), h2.grad.float(), **tol)
        torch.testing.assert_close(w1.grad.float(), w2.grad.float(), **tol)


_TRITON_CE_CHECK = r"""
import torch
from hpcmeg.kernels import cross_entropy as triton_ce
torch.manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    # V = 9000: two full 4096-column chunks and a 808-column tail; a row stride > V (a column slice)
    full = (torch.randn(5, 9100) * 4).to(dt)
    logits = full[:, :9000]
    labels = torch.tensor([0, 8999, 4095, 4096, 17])
    logits[1, 8999] = 30.0  # a large target logit in the tail chunk: the running max must rescale
    loss, lse = triton_ce.ce_forward(logits, labels)
    rl, rlse = triton_ce.reference(logits, labels)
    # case 2: logsumexp over 9000 columns in 4096-column chunks (an online max and rescaled sums) against
    # torch's one pass, numpy's exp/log against torch's
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, rl, rtol=1e-5, atol=1e-5)
    assert loss[1] < 0.01 and loss.dtype == torch.float32
    # the grad-in-forward kernel: same loss; the logits (only the first 9000 columns of each row)
    # overwritten by softmax - onehot as the twin writes them, the rest of the row untouched
    a, b = full.clone(), full.clone()
    gl = triton_ce.ce_forward_grad_(a[:, :9000], labels)
    rg = triton_ce.reference_grad_(b[:, :9000], labels)
    torch.testing.assert_close(gl, rg, rtol=1e-5, atol=1e-5)  # the same losses: case 2
    # the written gradient softmax - onehot: fp32 case 2 (atol 1e-6: the entries are probabilities,
    # most far below 1e-2, each exp(x - lse) a few roundings from the twin's); bf16 case 4 (the
    # interpreter truncates, the twin rounds to nearest: one bf16 ulp, <= 2^-7 of the value, under
    # rtol 2e-2; the atol is not needed by that bound)
    tol = dict(rtol=1e-5, atol=1e-6) if dt == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(a, b, **tol)
    assert torch.equal(a[:, 9000:], full[:, 9000:])
    # rows sum to 0 (softmax sums to 1, minus the onehot) up to rounding (u = 2^-24): each entry
    # exp(x - lse) carries lse's own rounding (ulp(lse) <= 2u |lse|) and that of x - lse (<= 2u |lse|
    # for x <= lse) times p, a few u of exp: over a row whose p sum to 1, <= 8u (|lse| + 1) (the
    # row with a logit of 30 has entries ~1e-6, and this absolute part is what its sum shows); bf16
    # entries are each within one ulp, <= 2^-7 of their value (the interpreter truncates: every
    # positive entry rounds down, a bias, not noise: 0.85 of a fixed 5e-3 seen here); the fp32 sum of
    # 9000 entries within 9000u of their total magnitude: < 2^-6 of it. A wrong row is ~1 off.
    row, u = a[:, :9000].float(), 2.0 ** -24
    assert (row.sum(-1).abs() <= 2.0 ** -6 * row.abs().sum(-1) + 8 * u * (lse.abs() + 1)).all(), row.sum(-1)
torch.library.opcheck(triton_ce.cross_entropy_lse, (torch.randn(6, 300), torch.randint(0, 300, (6,))))
torch.library.opcheck(triton_ce.cross_entropy_grad_, (torch.randn(6, 300), torch.randint(0, 300, (6,))))
print("ok")
"""


def test_triton_ce_forward_in_the_interpreter():
    """hpcmeg/kernels/cross_entropy.py's kernel run by Triton's CPU interpreter against its PyTorch twin
    (the same kernel compiled for the GPU is checked by bench/gpu_agreement.py on the H200)."""
    from helpers import run_in_triton_interpreter
    run_in_triton_interpreter(_TRITON_CE_CHECK)


def test_triton_ce_grad_kernel_compiles_for_hopper():
    """The grad-in-forward CE kernel compiles for sm90."""
    pytest.importorskip("triton")
    from helpers import compile_for_hopper

    from hpcmeg.kernels import cross_entropy as triton_ce
    types = dict(logits_ptr="*bf16", labels_ptr="*i64", loss_ptr="*fp32", stride_row="i32")
    k = compile_for_hopper(triton_ce._ce_fwd_grad_kernel, types, dict(V=50304, BLOCK=triton_ce.BLOCK), num_warps=8)
    assert k.metadata.shared <= 227 * 1024


def test_triton_ce_grad_kernel_reads_the_target_before_its_barriers():
    """The grad-in-forward CE kernel overwrites each row in its second sweep, one element per
    thread, while every thread reads the row's target logit: that read must come before the row's
    reductions, whose CTA barriers then order it before any write. Checked in the sm90 PTX (as a
    launch specializes it: 16-byte aligned pointers, the row stride a multiple of 16): the one
    unpredicated scalar bf16 load (the target; the chunk loads are predicated by the row's end)
    comes before the first bar.sync, and no store comes before that barrier."""
    pytest.importorskip("triton")
    import re

    from helpers import compile_for_hopper

    from hpcmeg.kernels import cross_entropy as triton_ce
    types = dict(logits_ptr="*bf16", labels_ptr="*i64", loss_ptr="*fp32", stride_row="i32")
    k = compile_for_hopper(triton_ce._ce_fwd_grad_kernel, types, dict(V=50304, BLOCK=triton_ce.BLOCK), num_warps=8)
    ptx = k.asm["ptx"].splitlines()
    target = [i for i, line in enumerate(ptx) if re.match(r"\s*ld\.global\.b16 ", line)]
    barriers = [i for i, line in enumerate(ptx) if "bar.sync" in line]
    stores = [i for i, line in enumerate(ptx) if "st.global" in line]  # the loss's and the logits'
    assert len(target) == 1 and barriers and stores, (target, barriers[:3])
    assert target[0] < barriers[0] < min(stores)


def test_bias_dropout_add_layer_norm_eval_and_train():
    torch.manual_seed(0)
    x, bias, res, w, b = torch.randn(2, 7, 32), torch.randn(32), torch.randn(2, 7, 32), torch.randn(32), torch.randn(32)
    fo, fg = _grads(lambda *t: fused.bias_dropout_add_layer_norm(*t[:3], 0.1, False, *t[3:], 1e-5), x, bias, res, w, b)
    po, pg = _grads(lambda *t: ops.bias_dropout_add_layer_norm(*t[:3], 0.1, False, *t[3:], 1e-5), x, bias, res, w, b)
    _assert_same(fo + fg, po + pg)
    # training: the same RNG stream gives the same dropout mask in both
    torch.manual_seed(3); f = fused.bias_dropout_add(x, bias, res, 0.3, True)
    torch.manual_seed(3); p = ops.bias_dropout_add(x, bias, res, 0.3, True)
    torch.testing.assert_close(f, p, **TOL)  # elementwise, the same mask: a rounding or two (case 5 would do)
    assert not torch.allclose(f, res + x + bias)  # dropout really dropped something
    torch.manual_seed(4); f = fused.dropout(x, 0.3, True)  # CPU: both are torch's dropout
    torch.manual_seed(4); p = ops.dropout(x, 0.3, True)
    assert torch.equal(f, p) and torch.equal(fused.dropout(x, 0.3, False), x)


def test_causal_attention_matches_math():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 33, 4, 16) for _ in range(3))
    fo, fg = _grads(lambda *t: fused.causal_attention(*t, 0.0, True), q, k, v)
    po, pg = _grads(lambda *t: ops.causal_attention(*t, 0.0, True), q, k, v)
    _assert_same(fo + fg, po + pg)
    # causality: changing the last position changes no earlier output
    k2 = k.clone(); k2[:, -1] += 5
    out2 = fused.causal_attention(q, k2, v, 0.0, False)
    torch.testing.assert_close(out2[:, :-1], fo[0][:, :-1], **TOL)  # SDPA's blocking may change with k: case 2


@pytest.mark.parametrize("impl", ["grad_in_forward", "backward_in_forward"])
def test_linear_cross_entropy(impl):
    torch.manual_seed(0)
    h, w = torch.randn(3, 10, 24), torch.randn(200, 24) * 0.3
    labels = torch.randint(0, 200, (3, 10))
    fo, fg = _grads(lambda a, b: fused.linear_cross_entropy(a, b, labels, impl=impl, chunk_tokens=7), h, w)
    po, pg = _grads(lambda a, b: ops.linear_cross_entropy(a, b, labels), h, w)
    assert fo[0].dtype == torch.float32 and fo[0].shape == (3, 10)
    _assert_same(fo + fg, po + pg)


def test_fused_model_equals_plain_model_fp32():
    cfg = GPTConfig(2, 64, 4, 256, 32, 128, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0); plain = build_gpt(cfg)
    fast = build_gpt(dataclasses.replace(cfg, fused=True)); fast.load_state_dict(plain.state_dict())
    x = torch.randint(0, 128, (2, 32)); y = torch.randint(0, 128, (2, 32))
    torch.testing.assert_close(fast(x), plain(x), **TOL)
    lp, lf = plain(x, y), fast(x, y)
    torch.testing.assert_close(lf, lp, **TOL)
    lp.mean().backward(); lf.mean().backward()
    for (n, a), b in zip(plain.named_parameters(), fast.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **TOL, msg=n)


@pytest.mark.slow
def test_inductor_compiled_fused_model_on_cpu():
    """The real fast path (torch.compile + Inductor-generated kernels) against the plain model."""
    cfg = GPTConfig(1, 32, 2, 128, 16, 64, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0); plain = build_gpt(cfg)
    fast = build_gpt(dataclasses.replace(cfg, fused=True)); fast.load_state_dict(plain.state_dict())
    x = torch.randint(0, 64, (2, 16)); y = torch.randint(0, 64, (2, 16))
    lf = torch.compile(fast)(x, y)
    lp = plain(x, y)
    torch.testing.assert_close(lf, lp, **TOL)
    lp.sum().backward(); lf.sum().backward()
    for (n, a), b in zip(plain.named_parameters(), fast.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **TOL, msg=n)


def test_triton_dropout_path_inside_the_compiled_model(monkeypatch):
    """The CUDA dropout path (hpcmeg::dropout_keep_mask + x * keep / (1 - p)) taken on CPU (the op
    runs its bit-exact twin there): the compiled GPT with a TrainStep of 2 micro batches traces it,
    reproduces its loss for a seed, and the loss moves with the seed; eager and compiled agree on
    the rule (a dropped element contributes nothing, kept ones are scaled by 1/(1-p)).
    The three runs are three fresh models and TrainSteps sharing one compiled graph (one trace:
    each further compile costs ~10 s on CPU), so the seed cannot be a constant baked into the trace."""
    from hpcmeg.fused.model import build_gpt
    from hpcmeg.kernels import dropout as dropout_kernel
    from hpcmeg.model.config import GPTConfig
    from hpcmeg.train.optim import AdamWConfig, build_optimizer
    from hpcmeg.train.step import TrainStep

    if not fused.HAVE_TRITON_DROPOUT:
        pytest.skip("triton is not installed")
    # the decision without side effects (a list it appended to would be a guard that changes on every
    # call: a recompile per step); the op's CPU body, looked up at run time, counts what the graph ran
    monkeypatch.setattr(fused, "_mask_kernel_for", lambda x: True)
    ran = []
    twin = dropout_kernel.reference_keep_mask
    monkeypatch.setattr(dropout_kernel, "reference_keep_mask", lambda *a: ran.append(a[1]) or twin(*a))
    x = torch.randn(3, 5, 8, requires_grad=True)
    torch.manual_seed(1)
    y = fused.dropout(x, 0.25, True)
    y.sum().backward()
    kept = y != 0
    # x * keep / (1 - p) against x / 0.75: one or two roundings apart (case 5)
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    torch.testing.assert_close(x.grad, kept.float() / 0.75)
    assert 0 < kept.sum() < kept.numel()

    cfg = GPTConfig(2, 32, 4, 64, 16, 64, hidden_dropout=0.2, attention_dropout=0.0, fused=True)
    d = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    mbs = [(d[:2, :-1], d[:2, 1:]), (d[2:, :-1], d[2:, 1:])]

    def losses(seed):
        torch.manual_seed(0)
        m = build_gpt(cfg)
        buf, opt = build_optimizer(m, AdamWConfig(1e-3))
        st = TrainStep(m, buf, opt, "fp32", compile=True, device="cpu")
        torch.manual_seed(seed)
        return [st.run(mbs).loss for _ in range(2)]
    torch._dynamo.reset()
    ran.clear()
    a, b, c = losses(5), losses(5), losses(6)
    torch._dynamo.reset()
    assert a == b and a != c
    assert ran and all(shape[-1] == 32 for shape in ran)  # the compiled steps ran the mask op, on [.., hidden]


def test_bias_dropout_add_layer_norm_function_with_a_mask():
    """fused._BiasDropoutAddLayerNorm (the one-pass Triton LayerNorm backward; its plain twin on CPU)
    against autograd of the written-out forward, with a given keep-mask and without one."""
    torch.manual_seed(0)
    x, bias, res = torch.randn(2, 7, 32), torch.randn(32), torch.randn(2, 7, 32)
    w, b = torch.randn(32), torch.randn(32)
    keep = torch.rand(2, 7, 32) > 0.3
    for k, scale in ((keep, 1 / 0.7), (None, 1.0)):
        fo, fg = _grads(lambda *t: fused._BiasDropoutAddLayerNorm.apply(t[0], t[1], t[2], k, scale, t[3], t[4], 1e-5),
                        x, bias, res, w, b)

        def plain(xx, bb, rr, ww, lb):
            branch = (xx + bb) if k is None else (xx + bb) * k * scale
            out = rr + branch
            return out, ops.layer_norm(out, ww, lb, 1e-5)
        po, pg = _grads(plain, x, bias, res, w, b)
        assert len(fg) == 5
        _assert_same(fo + fg, po + pg)


def test_packed_keep_bits_give_the_same_function():
    """_BiasDropoutAddLayerNorm with the keep-mask packed eight to a byte (what the model saves on CUDA)
    against the bool mask: the same outputs and gradients, bit for bit (the same values go through
    the same arithmetic), and only the packed mask is saved for the backward."""
    from hpcmeg.kernels import dropout as triton_dropout
    torch.manual_seed(0)
    x, bias, res = torch.randn(2, 7, 64), torch.randn(64), torch.randn(2, 7, 64)
    w, b = 1 + 0.1 * torch.randn(64), torch.randn(64)
    keep = torch.rand(2, 7, 64) > 0.3
    bits = triton_dropout.pack_bits(keep)
    assert bits.shape == (2, 7, 8) and bits.dtype == torch.uint8
    got = []
    for k in (keep, bits):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            o, g = _grads(lambda *t: fused._BiasDropoutAddLayerNorm.apply(t[0], t[1], t[2], k, 1 / 0.7, t[3], t[4],
                                                                          1e-5), x, bias, res, w, b)
        got.append(o + g)
        assert any(t is k for t in saved) and not any(t.dtype == torch.bool and t is not k for t in saved)
    for a, c in zip(*got):
        torch.testing.assert_close(a, c, rtol=0, atol=0)  # case 1: the same values, the same arithmetic


def test_bias_dropout_add_layer_norm_without_a_stream_gradient():
    """out_grad False (the last layer before the final LayerNorm): the new residual needs no gradient,
    and every input's gradient through y alone is the same as with out_grad True."""
    torch.manual_seed(0)
    x, bias, res = torch.randn(2, 7, 32), torch.randn(32), torch.randn(2, 7, 32)
    w, b = 1 + 0.1 * torch.randn(32), torch.randn(32)
    keep = torch.rand(2, 7, 32) > 0.2
    grads = []
    for out_grad in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, bias, res, w, b)]
        out, y = fused._BiasDropoutAddLayerNorm.apply(leaves[0], leaves[1], leaves[2], keep, 1.25, leaves[3],
                                                      leaves[4], 1e-5, out_grad)
        assert out.requires_grad == out_grad
        (y * torch.arange(32.0)).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, rtol=0, atol=0)  # case 1: out_grad only drops a term that is zero
