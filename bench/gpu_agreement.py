"""GPU side of the fused-vs-plain agreement (tests/test_fused_ops.py is the CPU/fp32 side).

For each op of hpcmeg/model/fused.py: fresh random inputs on CUDA, the fused op in bf16 against
the plain twin of hpcmeg/model/ops.py in fp64 on the upcast inputs; metric ||out - ref|| / ||ref||
for outputs and input gradients; pass below 2e-2 (bf16 operands land 1e-3..1e-2), NaN never.
Then whole-model checks: GPT(fused) compiled under bf16 autocast vs the plain fp32 model
(loss and gradients), and TrainStep eager vs compile vs compile+CUDA graphs over 3 steps of 2
micro batches (the loss curves must agree within bf16 noise; this also checks that CUDA graphs
do not corrupt accumulated gradients); the Triton dropout mask; gradient-accumulation fusion on vs
off through the compiled, CUDA-graphed step; the cuBLASLt GELU epilogues (lt). Writes
<out>/gpu_agreement.json and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hpcmeg.model import fused, ops  # noqa: E402
from hpcmeg.model.config import GPTConfig  # noqa: E402
from hpcmeg.model.gpt import GPT  # noqa: E402
from hpcmeg.train.optim import AdamWConfig, build_optimizer  # noqa: E402
from hpcmeg.train.step import TrainStep  # noqa: E402

TOL = 2e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(name, fast_fn, ref_fn, inputs, rows, grad=True):
    """fast_fn on bf16 inputs vs ref_fn on fp64 copies; outputs and input grads."""
    g = torch.Generator(device="cuda").manual_seed(11)
    res = {}
    for tag, fn, dt in (("fast", fast_fn, torch.bfloat16), ("ref", ref_fn, torch.float64)):
        ins = [t.to(dt).detach().requires_grad_(grad) if t.is_floating_point() else t for t in inputs]
        out = fn(*ins)
        outs = out if isinstance(out, tuple) else (out,)
        if grad:
            up = [torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5 + i))
                  for i, o in enumerate(outs)]
            sum((o.double() * u.double()).sum() for o, u in zip(outs, up)).backward()
        res[tag] = [o.detach() for o in outs] + ([t.grad for t in ins if t.is_floating_point()] if grad else [])
    errs = [rel(a, b) for a, b in zip(res["fast"], res["ref"])]
    ok = all(e < TOL for e in errs)  # NaN compares False -> fails
    rows.append(dict(check=name, max_rel_err=max(errs), ok=ok))
    print(f"{name:40s} max rel err {max(errs):.2e} {'ok' if ok else 'FAIL'}", flush=True)
    del g


def op_checks(rows):
    torch.manual_seed(0)
    b, s, h, nh = 4, 512, 1024, 16
    x, r = torch.randn(b, s, h, device="cuda"), torch.randn(b, s, h, device="cuda")
    w, bias = torch.randn(h, device="cuda"), torch.randn(h, device="cuda")
    compare("layer_norm", lambda *t: fused.layer_norm(*t, 1e-5), lambda *t: ops.layer_norm(*t, 1e-5),
            [x, w, bias], rows)
    compare("bias_gelu", fused.bias_gelu, ops.bias_gelu, [x, bias], rows)
    w4, b4 = torch.randn(4 * h, h, device="cuda") * 0.03, torch.randn(4 * h, device="cuda")
    compare("linear_bias_gelu", fused.linear_bias_gelu, ops.linear_bias_gelu, [x, w4, b4], rows)
    compare("bias_dropout_add_layer_norm",
            lambda a, c, d, e, f: fused.bias_dropout_add_layer_norm(a, c, d, 0.1, False, e, f, 1e-5),
            lambda a, c, d, e, f: ops.bias_dropout_add_layer_norm(a, c, d, 0.1, False, e, f, 1e-5),
            [x, bias, r, w, bias], rows)
    q, k, v = (torch.randn(b, s, nh, 64, device="cuda") for _ in range(3))
    for be in ("auto", "cudnn", "flash", "efficient", "flash_attn"):
        if be == "flash_attn" and not fused.HAVE_FLASH_ATTN:
            continue
        try:
            compare(f"causal_attention[{be}]", lambda *t: fused.causal_attention(*t, 0.0, True, be),
                    lambda *t: ops.causal_attention(*t, 0.0, True), [q, k, v], rows)
        except RuntimeError as ex:
            rows.append(dict(check=f"causal_attention[{be}]", error=str(ex)[:200], ok=None))
            print(f"causal_attention[{be}] unavailable: {str(ex)[:120]}", flush=True)
    hid, W = torch.randn(b, s, h, device="cuda"), torch.randn(50304, h, device="cuda") * 0.02
    labels = torch.randint(0, 50304, (b, s), device="cuda")
    if fused.HAVE_TRITON_CE:  # the Triton CE forward alone, at GPT-2's vocabulary, against its twin
        from hpcmeg.model import triton_ce
        lg = (torch.randn(4096, 50304, device="cuda") * 3).to(torch.bfloat16)
        lb = torch.randint(0, 50304, (4096,), device="cuda")
        errs = [rel(a, b) for a, b in zip(triton_ce.ce_forward(lg, lb), triton_ce.reference(lg, lb))]
        rows.append(dict(check="triton_ce.ce_forward vs reference (bf16 logits, V=50304)",
                         max_rel_err=max(errs), ok=max(errs) < 1e-5))
        print(f"triton_ce.ce_forward                     max rel err {max(errs):.2e}", flush=True)
    for impl in ("fused", "fused_inductor", "compiled", "chunked"):
        compare(f"linear_cross_entropy[{impl}]",
                lambda a, c: fused.linear_cross_entropy(a, c, labels, impl=impl),
                lambda a, c: ops.linear_cross_entropy(a, c, labels), [hid, W], rows)


def model_checks(rows):
    cfg = GPTConfig(4, 256, 4, 1024, 256, 1024, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    plain = GPT(cfg).cuda()
    fast = GPT(dataclasses.replace(cfg, fused=True)).cuda()
    fast.load_state_dict(plain.state_dict())
    x = torch.randint(0, 1024, (8, 256), device="cuda")
    y = torch.randint(0, 1024, (8, 256), device="cuda")
    lp = plain(x, y)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lf = torch.compile(fast)(x, y)
    lp.mean().backward(); lf.mean().backward()
    errs = [rel(lf, lp)] + [rel(b.grad, a.grad) for a, b in zip(plain.parameters(), fast.parameters())]
    ok = all(e < 5e-2 for e in errs)
    rows.append(dict(check="GPT fused+compile bf16 vs plain fp32 (loss, grads)", max_rel_err=max(errs), ok=ok))
    print(f"GPT compiled bf16 vs plain fp32: loss rel {errs[0]:.2e}, worst grad rel {max(errs[1:]):.2e}", flush=True)

    curves = {}
    for name, comp, mode in (("eager", False, None), ("compile", True, None), ("compile_cg", True, "reduce-overhead")):
        torch.manual_seed(0)
        m = GPT(dataclasses.replace(cfg, fused=True)).cuda()
        buf, opt = build_optimizer(m, AdamWConfig(1e-3), param_dtype=torch.bfloat16)  # the trainer's bf16 path
        st = TrainStep(m, buf, opt, "bf16", 1.0, compile=comp, device="cuda", compile_mode=mode)
        g = torch.Generator(device="cuda").manual_seed(3)
        d = torch.randint(0, 1024, (4, 257), device="cuda", generator=g)
        mbs = [(d[:2, :-1], d[:2, 1:]), (d[2:, :-1], d[2:, 1:])]
        curves[name] = [(r.loss, r.grad_norm) for r in (st.run(mbs) for _ in range(4))]
        torch._dynamo.reset()
    for name in ("compile", "compile_cg"):
        dl = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(curves[name], curves["eager"]))
        dg = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(curves[name], curves["eager"]))
        ok = dl < 1e-2 and dg < 5e-2
        rows.append(dict(check=f"TrainStep {name} vs eager, 4 steps x 2 micro batches",
                         max_rel_err=max(dl, dg), ok=ok, curves={name: curves[name], "eager": curves["eager"]}))
        print(f"TrainStep {name} vs eager: loss rel {dl:.2e}, grad-norm rel {dg:.2e} {'ok' if ok else 'FAIL'}", flush=True)


def dropout_and_accumulation_checks(rows):
    """The Triton keep-mask against its bit-exact PyTorch twin; the compiled model with it under CUDA
    graphs (reproducible for a seed, close to torch's dropout); bucketed gradient accumulation
    against the per-parameter twin through the whole compiled step."""
    if fused.HAVE_TRITON_DROPOUT:
        from hpcmeg.model import triton_dropout
        for shape, p in (((12, 1024, 768), 0.1), ((3, 1001, 37), 0.5)):
            seed = triton_dropout.draw_seed(torch.device("cuda"))
            k = triton_dropout.keep_mask(seed, list(shape), p)
            r = triton_dropout.reference_keep_mask(seed, list(shape), p)
            n = k.numel()
            frac = k.float().mean().item()
            sigma = (p * (1 - p) / n) ** 0.5
            ok = torch.equal(k, r) and abs(frac - (1 - p)) < 6 * sigma
            rows.append(dict(check=f"triton keep-mask {shape} p={p} vs twin (bitwise), keep fraction",
                             keep_fraction=frac, ok=ok))
            print(f"keep-mask {shape} p={p}: equal={torch.equal(k, r)} keep {frac:.5f} {'ok' if ok else 'FAIL'}",
                  flush=True)
            if shape[-1] % 8 == 0:  # the packed mask ('triton_bits'): the same bits, eight to a byte
                kb = triton_dropout.keep_bits(seed, list(shape), p)
                ok = torch.equal(kb, triton_dropout.pack_bits(r)) and torch.equal(
                    triton_dropout.unpack_bits(kb, list(shape)), k)
                rows.append(dict(check=f"triton keep-bits {shape} p={p} vs the packed twin (bitwise)", ok=ok))
                print(f"keep-bits {shape} p={p}: {'ok' if ok else 'FAIL'}", flush=True)
        # the cost where it matters: compiled bias-dropout-add + LayerNorm, forward + backward, at
        # 124M's activation shape, Triton mask vs torch's dropout (Inductor's in-kernel draw) vs none
        from triton.testing import do_bench
        x = torch.randn(12, 1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        res, bias = torch.randn_like(x), torch.randn(768, device="cuda", dtype=torch.bfloat16)
        w, lb = torch.ones(768, device="cuda", dtype=torch.bfloat16), torch.zeros(768, device="cuda", dtype=torch.bfloat16)
        times = {}
        for impl, p in (("triton", 0.1), ("triton_bits", 0.1), ("native", 0.1), ("native", 0.0)):
            f = torch.compile(lambda a, impl=impl, p=p: fused.bias_dropout_add_layer_norm(
                a, bias, res, p, True, w, lb, 1e-5, dropout_impl=impl))

            def step(f=f):
                o, h = f(x)
                (o.float().sum() + h.float().sum()).backward()
            times[f"{impl} p={p}"] = do_bench(step, warmup=10, rep=100)
        seed = triton_dropout.draw_seed(torch.device("cuda"))
        times["keep_mask alone"] = do_bench(lambda: triton_dropout.keep_mask(seed, [12, 1024, 768], 0.1))
        times["keep_bits alone"] = do_bench(lambda: triton_dropout.keep_bits(seed, [12, 1024, 768], 0.1))
        rows.append(dict(check="timing: compiled bias-dropout-add+LN fwd+bwd [12,1024,768] bf16 (ms)",
                         times_ms=times, ok=None))
        print("bias-dropout-add+LN fwd+bwd ms:", {k: round(v, 4) for k, v in times.items()}, flush=True)
    cfg = GPTConfig(4, 256, 4, 1024, 256, 1024, hidden_dropout=0.1, attention_dropout=0.1, fused=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    d = torch.randint(0, 1024, (4, 257), device="cuda", generator=g)
    mbs = [(d[:2, :-1], d[:2, 1:]), (d[2:, :-1], d[2:, 1:])]

    def curve(dropout_impl="triton", accumulate="bucketed", drop=True):
        torch.manual_seed(0)
        c = dataclasses.replace(cfg, dropout_impl=dropout_impl)
        if not drop:
            c = dataclasses.replace(c, hidden_dropout=0.0, attention_dropout=0.0)
        m = GPT(c).cuda()
        buf, opt = build_optimizer(m, AdamWConfig(1e-3), param_dtype=torch.bfloat16, accumulate=accumulate)
        st = TrainStep(m, buf, opt, "bf16", 1.0, compile=True, device="cuda")  # default: CUDA graphs
        out = [(r.loss, r.grad_norm) for r in (st.run(mbs) for _ in range(4))]
        torch._dynamo.reset()
        return out, buf.param_data.clone()
    a, _ = curve()
    b, _ = curve()
    nat, _ = curve("native")
    dl = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(a, nat))
    ok = a == b and dl < 2e-2
    rows.append(dict(check="compiled+CUDA graphs, dropout 0.1: triton mask reproducible; vs native dropout",
                     max_rel_err=dl, ok=ok, curves={"triton": a, "triton_again": b, "native": nat}))
    print(f"dropout triton reproducible={a == b}, loss rel vs native {dl:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    bits, _ = curve("triton_bits")  # the same masks, saved packed: the same curve up to kernel rounding
    db = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(bits, a))
    ok = db < 1e-5
    rows.append(dict(check="compiled+CUDA graphs, dropout 0.1: triton_bits (packed masks) vs triton",
                     max_rel_err=db, ok=ok, curves={"triton_bits": bits}))
    print(f"dropout triton_bits vs triton: loss rel {db:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    f, pf = curve(drop=False)
    q, pq = curve(accumulate="per_param", drop=False)
    diff = rel(pf.float(), pq.float())
    ok = diff < 1e-3 and max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(f, q)) < 1e-3
    rows.append(dict(check="bucketed vs per_param accumulation, compiled step, 4 steps x 2 micro batches",
                     max_rel_err=diff, bitwise=torch.equal(pf, pq), ok=ok))
    print(f"accumulation bucketed vs per_param: params rel {diff:.2e} bitwise={torch.equal(pf, pq)} "
          f"{'ok' if ok else 'FAIL'}", flush=True)


def ce_checks(rows):
    """The grad-in-forward cross-entropy (triton_ce.ce_forward_grad_ + fused_ce._LinearCEGradInForward):
    the kernel against its twin at GPT-2's vocabulary, the LM-head loss and gradients against the
    plain fp64 path, and fwd+bwd time of the LM head + loss at 124M's shape (12 x 1024 tokens, h 768,
    bf16, compiled as in the model) for 'fused' vs 'grad_in_forward'."""
    from triton.testing import do_bench
    from hpcmeg.model import triton_ce
    lg = (torch.randn(4096, 50304, device="cuda") * 3).to(torch.bfloat16)
    lb = torch.randint(0, 50304, (4096,), device="cuda")
    a, b = lg.clone(), lg.clone()
    la, lr = triton_ce.ce_forward_grad_(a, lb), triton_ce.reference_grad_(b, lb)
    e_loss, e_grad = rel(la, lr), rel(a.float(), b.float())
    ok = e_loss < 1e-5 and e_grad < 1e-2
    rows.append(dict(check="triton_ce.ce_forward_grad_ vs reference_grad_ (bf16, V=50304)", loss_rel=e_loss,
                     grad_rel=e_grad, ok=ok))
    print(f"ce_forward_grad_: loss rel {e_loss:.2e} grad rel {e_grad:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    hid, W = torch.randn(4, 512, 1024, device="cuda"), torch.randn(50304, 1024, device="cuda") * 0.02
    labels = torch.randint(0, 50304, (4, 512), device="cuda")
    compare("linear_cross_entropy[grad_in_forward]",
            lambda x, w: fused.linear_cross_entropy(x, w, labels, impl="grad_in_forward"),
            lambda x, w: ops.linear_cross_entropy(x, w, labels), [hid, W], rows)
    h = torch.randn(12, 1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(50304, 768, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, 50304, (12, 1024), device="cuda")
    times = {}
    for impl in ("fused", "grad_in_forward"):
        f = torch.compile(lambda a, c, impl=impl: fused.linear_cross_entropy(a, c, y, impl=impl).sum())

        def step(f=f):
            f(h, w).backward()
            h.grad = w.grad = None
        times[impl] = do_bench(step, warmup=10, rep=50)
        torch.cuda.reset_peak_memory_stats()
        step()
        times[impl + " peak GB"] = torch.cuda.max_memory_allocated() / 1e9
    rows.append(dict(check="timing: LM head + loss fwd+bwd, [12x1024, 768] x [50304, 768] bf16 (ms)",
                     times_ms=times, ok=None))
    print("LM head + CE fwd+bwd ms:", {k: round(v, 4) for k, v in times.items()}, flush=True)


def wgrad_fusion_checks(rows):
    """Gradient-accumulation fusion (hpcmeg/model/wgrad.py) through the compiled, CUDA-graphed step:
    bf16 parameters, fp32 main grads, 4 steps x 2 micro batches, sink on vs off (the GEMM's fp32
    accumulation vs a bf16 gradient added: they differ by bf16 rounding of each micro batch's
    weight gradient); and whether Inductor skipped CUDA graphs for it (a backward mutation). Then
    fused_ce 'backward_in_forward' against the default 'grad_in_forward', both sunk: the output
    layer's main-grad accumulation moves into the forward (a forward mutation), no CUDA-graph skip
    allowed either."""
    from torch._dynamo.utils import counters
    cfg = GPTConfig(4, 256, 4, 1024, 256, 1024, hidden_dropout=0.0, attention_dropout=0.0, fused=True)
    g = torch.Generator(device="cuda").manual_seed(5)
    d = torch.randint(0, 1024, (4, 257), device="cuda", generator=g)
    mbs = [(d[:2, :-1], d[:2, 1:]), (d[2:, :-1], d[2:, 1:])]

    def curve(fusion, ce="grad_in_forward"):
        torch.manual_seed(0)
        m = GPT(dataclasses.replace(cfg, fused_ce=ce)).cuda()
        buf, opt = build_optimizer(m, AdamWConfig(1e-3), param_dtype=torch.bfloat16, grad_dtype=torch.float32,
                                   wgrad_fusion=fusion)
        st = TrainStep(m, buf, opt, "bf16", 1.0, compile=True, device="cuda")
        skips = sum(counters["inductor"].get(k, 0) for k in list(counters["inductor"]) if "cudagraph_skip" in k)
        out = [(r.loss, r.grad_norm) for r in (st.run(mbs) for _ in range(4))]
        skips = sum(counters["inductor"].get(k, 0) for k in list(counters["inductor"]) if "cudagraph_skip" in k) - skips
        grads = buf.grad_data.clone()
        torch._dynamo.reset()
        return out, buf.param_data.clone(), grads, skips, sum(bk.sunk for bk in buf.buckets)
    on, p_on, g_on, skips_on, n_sunk = curve(True)
    off, p_off, g_off, skips_off, _ = curve(False)
    dl = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(on, off))
    dp, dg = rel(p_on.float(), p_off.float()), rel(g_on, g_off)
    ok = n_sunk > 0 and dl < 1e-2 and dp < 1e-2 and dg < 2e-2 and skips_on == 0
    rows.append(dict(check="gradient-accumulation fusion on vs off, compiled+CUDA graphs, 4 steps x 2 micro",
                     loss_rel=dl, params_rel=dp, last_main_grads_rel=dg, cudagraph_skips=skips_on,
                     cudagraph_skips_off=skips_off, sunk_buckets=n_sunk, curves={"on": on, "off": off}, ok=ok))
    print(f"wgrad fusion on vs off: loss rel {dl:.2e} params rel {dp:.2e} main grads rel {dg:.2e} "
          f"cudagraph skips {skips_on} {'ok' if ok else 'FAIL'}", flush=True)
    bif, p_bif, g_bif, skips_bif, n_bif = curve(True, "backward_in_forward")
    dl = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(bif, on))
    dp, dg = rel(p_bif.float(), p_on.float()), rel(g_bif, g_on)
    ok = n_bif == n_sunk and dl < 1e-3 and dp < 1e-2 and dg < 1e-2 and skips_bif == 0
    rows.append(dict(check="cross-entropy backward_in_forward vs grad_in_forward, sunk, compiled+CUDA graphs",
                     loss_rel=dl, params_rel=dp, last_main_grads_rel=dg, cudagraph_skips=skips_bif,
                     sunk_buckets=n_bif, curves={"backward_in_forward": bif, "grad_in_forward": on}, ok=ok))
    print(f"backward_in_forward vs grad_in_forward: loss rel {dl:.2e} params rel {dp:.2e} main grads rel "
          f"{dg:.2e} cudagraph skips {skips_bif} {'ok' if ok else 'FAIL'}", flush=True)


def _graphed_curve(mbs, **cfg_kw):
    """4 compiled, CUDA-graphed steps of a 4-layer 124M-width fused GPT (bf16 parameters, fp32 main
    grads with gradient-accumulation fusion) on the micro batches mbs: ([(loss, grad norm)] per step,
    the final parameters as fp32, CUDA-graph skips counted by Inductor)."""
    from torch._dynamo.utils import counters
    cfg = GPTConfig(4, 768, 12, 3072, 1024, 1024, fused=True, **cfg_kw)
    torch.manual_seed(0)
    m = GPT(cfg).cuda()
    buf, opt = build_optimizer(m, AdamWConfig(1e-3), param_dtype=torch.bfloat16, grad_dtype=torch.float32,
                               wgrad_fusion=True)
    st = TrainStep(m, buf, opt, "bf16", 1.0, compile=True, device="cuda")
    skips = sum(counters["inductor"].get(k, 0) for k in list(counters["inductor"]) if "cudagraph_skip" in k)
    out = [(r.loss, r.grad_norm) for r in (st.run(mbs) for _ in range(4))]
    skips = sum(counters["inductor"].get(k, 0) for k in list(counters["inductor"]) if "cudagraph_skip" in k) - skips
    params = buf.param_data.float().clone()
    torch._dynamo.reset()
    return out, params, skips


def kernel_impl_checks(rows):
    """hpcmeg's own Triton kernels (LayerNorm backward, GELU, attention) against the Inductor / cuDNN
    paths through the compiled, CUDA-graphed step of the user's path (bf16 parameters, fp32 main grads
    with gradient-accumulation fusion, hidden dropout 0.1), 4 steps x 2 micro batches at a 124M-like
    width. Attention dropout 0 for the bitwise-comparable masks (the hidden-dropout seeds are drawn in
    the same order on both sides); then attention dropout 0.1 (the Triton and cuDNN masks differ:
    looser tolerance). Also: no CUDA-graph skips."""
    g = torch.Generator(device="cuda").manual_seed(5)
    d = torch.randint(0, 1024, (8, 1025), device="cuda", generator=g)
    mbs = [(d[:4, :-1], d[:4, 1:]), (d[4:, :-1], d[4:, 1:])]

    def curve(**kw):
        return _graphed_curve(mbs, hidden_dropout=0.1, **kw)

    old = dict(layernorm_impl="inductor", gelu_impl="inductor", attention_backend="cudnn")
    new = dict(layernorm_impl="triton", gelu_impl="triton", attention_backend="triton")
    for ad, tol in ((0.0, 1e-2), (0.1, 3e-2)):
        a, pa, skips = curve(attention_dropout=ad, **new)
        b, pb, _ = curve(attention_dropout=ad, **old)
        dl = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(a, b))
        dgn = max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(a, b))
        dp = rel(pa, pb)
        # with attention dropout the two attentions draw different masks: only the loss is comparable
        ok = dl < tol and skips == 0 and (ad > 0 or (dgn < 5 * tol and dp < tol))
        rows.append(dict(check=f"Triton LN/GELU/attention vs Inductor/cuDNN, compiled+CUDA graphs, attention dropout {ad}",
                         loss_rel=dl, grad_norm_rel=dgn, params_rel=dp, cudagraph_skips=skips,
                         curves={"triton": a, "inductor": b}, ok=ok))
        print(f"kernels vs inductor (attention dropout {ad}): loss rel {dl:.2e} grad-norm rel {dgn:.2e} "
              f"params rel {dp:.2e} cudagraph skips {skips} {'ok' if ok else 'FAIL'}", flush=True)


def _graph_ms(fn, reps: int = 10, iters: int = 20) -> float:
    """ms per fn() call: a CUDA graph of `reps` calls, replayed `iters` times between events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # warm-up outside the capture (heuristics, Triton compiles)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        graph.replay()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / (iters * reps)


def lt_checks(rows, out_dir: str):
    """gelu_impl 'cublaslt' (hpcmeg/model/cublaslt.py): whether the library loads and cuBLASLt offers
    its GELU epilogues on this GPU, both GEMMs against the fp64 twins at the MLP shapes of the three
    sizes, each timed against the GEMM + Triton GELU pass it replaces (CUDA-graph replays). Writes
    <out>/lt_ok when all of it agreed (bench/lease.sh then times gelu_impl cublaslt in the user path).
    ~20 s; the training step with it is lt_step_checks."""
    import warnings

    from hpcmeg.model import cublaslt
    lib = cublaslt.lt()
    rows.append(dict(check="cuBLASLt library", path=cublaslt.library_path(), ok=lib is not None))
    print("cuBLASLt library:", cublaslt.library_path(), flush=True)
    if lib is None:
        return
    g = torch.Generator(device="cuda").manual_seed(7)
    all_ok = True
    for size, (m_tok, k, n) in {"124M": (12288, 768, 3072), "355M": (12288, 1024, 4096),
                                "1.3B": (8192, 2048, 8192)}.items():
        x = torch.randn(m_tok, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        b = (0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
        dy = torch.randn(m_tok, k, device="cuda", generator=g).bfloat16()
        w2 = (torch.randn(k, n, device="cuda", generator=g) / n ** 0.5).bfloat16()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gl, hl = torch.ops.hpcmeg.linear_gelu_aux(x, w, b)
            dh, db = torch.ops.hpcmeg.linear_dgelu_bgrad(dy, w2, hl)
        used = not any("no algorithm" in str(c.message) for c in caught)
        gr, hr = cublaslt.reference_gelu_aux(x.double(), w.double(), b.double())
        dhr, dbr = cublaslt.reference_dgelu_bgrad(dy.double(), w2.double(), hl.double())
        errs = dict(g=rel(gl, gr), h=rel(hl, hr), dh=rel(dh, dhr), db=rel(db, dbr))
        times = dict(
            fwd_lt=_graph_ms(lambda: torch.ops.hpcmeg.linear_gelu_aux(x, w, b)),
            fwd_triton=_graph_ms(lambda: torch.ops.hpcmeg.gelu_tanh(torch.nn.functional.linear(x, w, b))),
            bwd_lt=_graph_ms(lambda: torch.ops.hpcmeg.linear_dgelu_bgrad(dy, w2, hl)),
            bwd_triton=_graph_ms(lambda: torch.ops.hpcmeg.gelu_tanh_backward(dy @ w2, hl)))
        ok = used and all(e < TOL for e in errs.values())
        all_ok &= ok
        rows.append(dict(check=f"cuBLASLt GELU epilogues {size} [{m_tok}, {k}] x [{k}, {n}]", epilogues_used=used,
                         rel_err=errs, ms=times, ok=ok))
        print(f"cuBLASLt {size}: used {used} errs {errs} ms {times} {'ok' if ok else 'FAIL'}", flush=True)
    if all_ok:
        with open(os.path.join(out_dir, "lt_ok"), "w") as f:
            f.write("cuBLASLt GELU epilogues agree with the twins\n")


def lt_step_checks(rows):
    """The compiled, CUDA-graphed step with gelu_impl 'cublaslt' and 'cublaslt_dgelu' against 'triton' (bf16 parameters,
    main-grad sinks, 4 steps x 2 micro batches at a 124M-like width): the loss curves and parameters
    agree within bf16 noise, and Inductor skips no CUDA graph for the ctypes calls."""
    g = torch.Generator(device="cuda").manual_seed(7)
    d = torch.randint(0, 1024, (8, 1025), device="cuda", generator=g)
    mbs = [(d[:4, :-1], d[:4, 1:]), (d[4:, :-1], d[4:, 1:])]
    b_, pb, _ = _graphed_curve(mbs, hidden_dropout=0.0, attention_dropout=0.0, gelu_impl="triton")
    # 'cublaslt' (the default) and 'cublaslt_dgelu' (its backward's GELU and fc1's bias gradient in
    # the GEMMs' epilogues too) against the Triton GELU
    for impl in ("cublaslt", "cublaslt_dgelu"):
        a, pa, skips = _graphed_curve(mbs, hidden_dropout=0.0, attention_dropout=0.0, gelu_impl=impl)
        dl = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(a, b_))
        dp = rel(pa, pb)
        ok = dl < 1e-2 and dp < 1e-2 and skips == 0
        rows.append(dict(check=f"gelu_impl {impl} vs triton, compiled+CUDA graphs, 4 steps x 2 micro", loss_rel=dl,
                         params_rel=dp, cudagraph_skips=skips, curves={impl: a, "triton": b_}, ok=ok))
        print(f"{impl} vs triton step: loss rel {dl:.2e} params rel {dp:.2e} skips {skips} {'ok' if ok else 'FAIL'}",
              flush=True)


def bda_ln_checks(rows):
    """layernorm_impl 'triton_forward' (hpcmeg/model/triton_bda_layernorm.py): the bias-dropout-add +
    LayerNorm forward kernel against its twin in fp64 at the three sizes' shapes (bf16, packed keep
    bits, p = 0.1), reading the bits and drawing them itself (then its bits against the keep-bits
    kernel's, bit for bit), each timed against Inductor's compiled plain ops, what it replaces, and
    the keep-bits kernel that the drawing one makes unnecessary (CUDA-graph replays). ~30 s."""
    from hpcmeg.model import triton_bda_layernorm as bda
    from hpcmeg.model import triton_dropout

    def plain(x, bias, res, keep, scale, w, b):
        branch = (x + bias.to(x.dtype)) * triton_dropout.unpack_bits(keep, list(x.shape)) * scale
        out = res + branch
        return out, torch.nn.functional.layer_norm(out, (out.shape[-1],), w, b, 1e-5)

    compiled = torch.compile(plain)
    g = torch.Generator(device="cuda").manual_seed(7)
    for size, (n, h) in {"124M": (12288, 768), "355M": (12288, 1024), "1.3B": (8192, 2048)}.items():
        x, res = (torch.randn(n, h, device="cuda", generator=g).bfloat16() for _ in range(2))
        bias, w, b = (torch.randn(h, device="cuda", generator=g).bfloat16() for _ in range(3))
        keep = torch.ops.hpcmeg.dropout_keep_bits(triton_dropout.draw_seed(x.device), [n, h], 0.1)
        scale = triton_dropout.keep_scale(0.1)
        out, y = torch.ops.hpcmeg.bda_layer_norm(x, bias, res, keep, scale, w, b, 1e-5)
        ro, ry = bda.reference_forward(x.double(), bias.double(), res.double(), keep, scale, w.double(),
                                       b.double(), 1e-5)
        errs = dict(out=rel(out, ro), y=rel(y, ry))
        # the kernel drawing the mask itself (what the model runs with triton_bits): the same bits
        # as the keep-bits kernel's from the same seed, and its outputs against fp64 with them
        seed = triton_dropout.draw_seed(x.device)
        d_out, d_y, d_bits = torch.ops.hpcmeg.bda_layer_norm_drawn(x, bias, res, seed, 0.1, w, b, 1e-5)
        same_bits = bool(torch.equal(d_bits, torch.ops.hpcmeg.dropout_keep_bits(seed, [n, h], 0.1)))
        ro, ry = bda.reference_forward(x.double(), bias.double(), res.double(), d_bits, scale, w.double(),
                                       b.double(), 1e-5)
        errs.update(drawn_out=rel(d_out, ro), drawn_y=rel(d_y, ry))
        times = dict(kernel=_graph_ms(lambda: torch.ops.hpcmeg.bda_layer_norm(x, bias, res, keep, scale, w, b, 1e-5)),
                     inductor=_graph_ms(lambda: compiled(x, bias, res, keep, scale, w, b)),
                     keep_bits=_graph_ms(lambda: torch.ops.hpcmeg.dropout_keep_bits(seed, [n, h], 0.1)),
                     drawn=_graph_ms(lambda: torch.ops.hpcmeg.bda_layer_norm_drawn(x, bias, res, seed, 0.1, w, b, 1e-5)))
        # per call, as the model runs it: before (bits kernel + Inductor) and with triton_forward (drawn)
        times["shipped_path"] = round(times["keep_bits"] + times["inductor"], 4)
        ok = all(e < TOL for e in errs.values()) and same_bits
        rows.append(dict(check=f"bias-dropout-add + LayerNorm forward kernel {size} [{n}, {h}]", rel_err=errs,
                         drawn_bits_equal=same_bits, ms=times, ok=ok))
        print(f"bda_layer_norm {size}: errs {errs} ms {times} {'ok' if ok else 'FAIL'}", flush=True)


def main():
    ap = argparse.ArgumentParser(description="fused-vs-plain agreement on the GPU")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--parts", default="ops,model,dropout,wgrad,ce,kernels,lt,ltstep",
                    help="comma list of ops, model, dropout, wgrad, ce, kernels, lt, ltstep, bdaln, "
                         "run in that order")
    a = ap.parse_args()
    table = {"ops": op_checks, "model": model_checks, "dropout": dropout_and_accumulation_checks,
             "wgrad": wgrad_fusion_checks, "ce": ce_checks, "kernels": kernel_impl_checks,
             "lt": lambda rows: lt_checks(rows, a.out), "ltstep": lt_step_checks, "bdaln": bda_ln_checks}
    parts = a.parts.split(",")  # run in the order given: a lease's timeout cuts the last ones
    unknown = [p for p in parts if p not in table]
    if unknown:
        raise SystemExit(f"gpu_agreement: unknown --parts {unknown}: want a comma list of {list(table)}")
    rows = []
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), flash_attn=fused.HAVE_FLASH_ATTN)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "gpu_agreement.json")
    for part in parts:
        fn = table[part]
        try:  # a crash in one part still leaves the others' rows
            fn(rows)
        except Exception as ex:
            rows.append(dict(check=part, error=repr(ex)[:400], ok=False))
            print(f"{part} failed:", repr(ex)[:400], flush=True)
        with open(path + ".tmp", "w") as f:  # after each part: a run cut short keeps what it checked
            json.dump(dict(env=env, tol=TOL, rows=rows), f, indent=1)
        os.replace(path + ".tmp", path)
    bad = [r["check"] for r in rows if r.get("ok") is False]
    print("ALL OK" if not bad else f"FAILED: {bad}", flush=True)

if __name__ == "__main__":
    main()
