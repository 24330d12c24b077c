"""The fused path on the GPU against its plain twins (tests/test_fused_ops.py is the CPU/fp32 side).

Each op of hpcmeg/fused/ops.py has one fast implementation and a plain PyTorch twin in
hpcmeg/model/ops.py; this checks them against each other where only a GPU runs the fast one.
Parts (--parts, run in the order given; each part's rows are on disk as soon as it ends):
  ops       each fused op in bf16 on CUDA against its twin in fp64 on the upcast inputs
            (||out - ref|| / ||ref|| of outputs and input gradients, below 2e-2, NaN never): LayerNorm,
            bias-GELU, linear-bias-GELU, the MLP with its GELU recomputed, bias-dropout-add +
            LayerNorm, causal attention per SDPA backend, the Triton attention on the QKV GEMM's
            layout, the Triton cross-entropy forward (the vocabulary-parallel loss's logsumexp);
  model     the fused GPT compiled under bf16 autocast against the plain fp32 GPT (loss and
            gradients), and TrainStep eager / compiled / compiled + CUDA graphs over 4 steps of 2
            micro batches (the curves agree within bf16 noise: CUDA graphs do not corrupt the
            accumulated gradients);
  dropout   the Philox keep-mask and its packed bits against their twins bit for bit, the keep
            fraction, their cost in the compiled bias-dropout-add + LayerNorm, the compiled step with
            dropout reproducible for a seed and close to the plain model's (torch's dropout), and
            bucketed gradient accumulation against its per-parameter twin;
  wgrad     gradient-accumulation fusion (weight-gradient GEMMs into the fp32 main grad) on against
            off through the compiled, CUDA-graphed step, and the cross-entropy
            'backward_in_forward' against 'grad_in_forward' there, with no CUDA-graph skip;
  ce        the grad-in-forward cross-entropy kernel against its twin, both LM-head losses
            ('grad_in_forward', 'backward_in_forward' with its loss weights) against the fp64 path,
            and their time and peak memory at 124M's LM-head shape;
  attention the Triton attention against cuDNN's SDPA through the compiled, CUDA-graphed step
            (attention dropout 0: the same hidden-dropout masks on both sides; then 0.1).
Writes <out>/gpu_agreement.json (after each part) and prints one line per check; needs CUDA.
Usage: python bench/gpu_agreement.py [--parts ops,model,dropout,wgrad,ce,attention] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hpcmeg.fused import ops as fused  # noqa: E402
from hpcmeg.model import ops
from hpcmeg.model.config import GPTConfig  # noqa: E402
from hpcmeg.fused.model import build_gpt  # noqa: E402
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
    w2 = torch.randn(h, 4 * h, device="cuda") * 0.015
    compare("mlp[recompute_gelu]", lambda *t: fused.mlp(*t, recompute_gelu=True), ops.mlp, [x, w4, b4, w2], rows)
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
    # the Triton attention on the QKV GEMM's layout [b, s, heads, 3 * head_dim], as the model calls it
    qkv = torch.randn(b, s, nh, 3 * 64, device="cuda")

    def split_attention(t):
        return ops.causal_attention(*t.split(64, dim=-1), 0.0, True)
    compare("causal_attention_qkv[triton]", lambda t: fused.causal_attention_qkv(t, 0.0, True, "triton"),
            split_attention, [qkv], rows)
    if fused.HAVE_TRITON_CE:  # the Triton CE forward alone, at GPT-2's vocabulary, against its twin
        from hpcmeg.kernels import cross_entropy as triton_ce
        lg = (torch.randn(4096, 50304, device="cuda") * 3).to(torch.bfloat16)
        lb = torch.randint(0, 50304, (4096,), device="cuda")
        errs = [rel(a, b) for a, b in zip(triton_ce.ce_forward(lg, lb), triton_ce.reference(lg, lb))]
        rows.append(dict(check="triton_ce.ce_forward vs reference (bf16 logits, V=50304)",
                         max_rel_err=max(errs), ok=max(errs) < 1e-5))
        print(f"triton_ce.ce_forward                     max rel err {max(errs):.2e}", flush=True)


def model_checks(rows):
    cfg = GPTConfig(4, 256, 4, 1024, 256, 1024, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    plain = build_gpt(cfg).cuda()
    fast = build_gpt(dataclasses.replace(cfg, fused=True)).cuda()
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
        m = build_gpt(dataclasses.replace(cfg, fused=True)).cuda()
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
    """The Triton keep-mask and its packed bits (what the residual branches save) against their
    bit-exact PyTorch twins; their cost in the compiled bias-dropout-add + LayerNorm; the compiled
    model under CUDA graphs with dropout reproducible for a seed and close to the plain model (torch's
    dropout); bucketed gradient accumulation against the per-parameter twin through the whole
    compiled step."""
    if fused.HAVE_TRITON_DROPOUT:
        from hpcmeg.kernels import dropout as triton_dropout
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
            if shape[-1] % triton_dropout.PER_CALL == 0:  # the packed mask: the same bits, eight to a byte
                kb = triton_dropout.keep_bits(seed, list(shape), p)
                ok = torch.equal(kb, triton_dropout.pack_bits(r)) and torch.equal(
                    triton_dropout.unpack_bits(kb, list(shape)), k)
                rows.append(dict(check=f"triton keep-bits {shape} p={p} vs the packed twin (bitwise)", ok=ok))
                print(f"keep-bits {shape} p={p}: {'ok' if ok else 'FAIL'}", flush=True)
        # the cost where it matters: compiled bias-dropout-add + LayerNorm, forward + backward, at
        # 124M's activation shape, with dropout (packed keep bits) and without
        from triton.testing import do_bench
        x = torch.randn(12, 1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        res, bias = torch.randn_like(x), torch.randn(768, device="cuda", dtype=torch.bfloat16)
        w, lb = torch.ones(768, device="cuda", dtype=torch.bfloat16), torch.zeros(768, device="cuda", dtype=torch.bfloat16)
        times = {}
        for p in (0.1, 0.0):
            f = torch.compile(lambda a, p=p: fused.bias_dropout_add_layer_norm(a, bias, res, p, True, w, lb, 1e-5))

            def step(f=f):
                o, h = f(x)
                (o.float().sum() + h.float().sum()).backward()
            times[f"p={p}"] = do_bench(step, warmup=10, rep=100)
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

    def curve(fused_model=True, accumulate="bucketed", drop=True):
        torch.manual_seed(0)
        c = dataclasses.replace(cfg, fused=fused_model)
        if not drop:
            c = dataclasses.replace(c, hidden_dropout=0.0, attention_dropout=0.0)
        m = build_gpt(c).cuda()
        buf, opt = build_optimizer(m, AdamWConfig(1e-3), param_dtype=torch.bfloat16, accumulate=accumulate)
        st = TrainStep(m, buf, opt, "bf16", 1.0, compile=True, device="cuda")  # default: CUDA graphs
        out = [(r.loss, r.grad_norm) for r in (st.run(mbs) for _ in range(4))]
        torch._dynamo.reset()
        return out, buf.param_data.clone()
    a, _ = curve()
    b, _ = curve()
    plain, _ = curve(fused_model=False)  # ops.py's dropout: torch's, other masks
    dl = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(a, plain))
    ok = a == b and dl < 2e-2
    rows.append(dict(check="compiled+CUDA graphs, dropout 0.1: fused model reproducible; vs the plain model",
                     max_rel_err=dl, ok=ok, curves={"fused": a, "fused_again": b, "plain": plain}))
    print(f"dropout reproducible={a == b}, loss rel vs the plain model {dl:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    f, pf = curve(drop=False)
    q, pq = curve(accumulate="per_param", drop=False)
    diff = rel(pf.float(), pq.float())
    ok = diff < 1e-3 and max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(f, q)) < 1e-3
    rows.append(dict(check="bucketed vs per_param accumulation, compiled step, 4 steps x 2 micro batches",
                     max_rel_err=diff, bitwise=torch.equal(pf, pq), ok=ok))
    print(f"accumulation bucketed vs per_param: params rel {diff:.2e} bitwise={torch.equal(pf, pq)} "
          f"{'ok' if ok else 'FAIL'}", flush=True)


def ce_checks(rows):
    """The LM head's loss (hpcmeg/fused/linear_ce.py): the grad-in-forward kernel
    (triton_ce.ce_forward_grad_) against its twin at GPT-2's vocabulary; 'grad_in_forward' and
    'backward_in_forward' (its backward GEMMs run in the forward on the loss weights the caller will
    backpropagate) against the plain fp64 loss and gradients; and forward + backward time and peak
    memory of LM head + loss at 124M's shape (12 x 1024 tokens, h 768, bf16, compiled as in the
    model) for both."""
    from triton.testing import do_bench

    from hpcmeg.kernels import cross_entropy as triton_ce
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
    # 'backward_in_forward': the caller promises to backpropagate exactly loss_weights
    lw = torch.rand(labels.shape, device="cuda")
    res = {}
    for tag, dt in (("fast", torch.bfloat16), ("ref", torch.float64)):
        x, w = (t.to(dt).requires_grad_(True) for t in (hid, W))
        loss = (fused.linear_cross_entropy(x, w, labels, impl="backward_in_forward", loss_weights=lw)
                if tag == "fast" else ops.linear_cross_entropy(x, w, labels))
        (loss.double() * lw.double()).sum().backward()
        res[tag] = (loss.detach(), x.grad, w.grad)
    errs = [rel(f, r) for f, r in zip(res["fast"], res["ref"])]
    ok = all(e < TOL for e in errs)
    rows.append(dict(check="linear_cross_entropy[backward_in_forward] with loss weights vs fp64 (loss, grads)",
                     max_rel_err=max(errs), ok=ok))
    print(f"{'linear_cross_entropy[backward_in_forward]':40s} max rel err {max(errs):.2e} {'ok' if ok else 'FAIL'}",
          flush=True)
    h = torch.randn(12, 1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(50304, 768, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, 50304, (12, 1024), device="cuda")
    ones = torch.ones(y.shape, device="cuda")  # d sum / d loss: the weights a .sum() backpropagates
    times = {}
    for impl in ("grad_in_forward", "backward_in_forward"):
        f = torch.compile(lambda a, c, impl=impl: fused.linear_cross_entropy(a, c, y, impl=impl,
                                                                           loss_weights=ones).sum())

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
    """Gradient-accumulation fusion (hpcmeg/fused/wgrad.py) through the compiled, CUDA-graphed step:
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
        m = build_gpt(dataclasses.replace(cfg, fused_ce=ce)).cuda()
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
    m = build_gpt(cfg).cuda()
    buf, opt = build_optimizer(m, AdamWConfig(1e-3), param_dtype=torch.bfloat16, grad_dtype=torch.float32,
                               wgrad_fusion=True)
    st = TrainStep(m, buf, opt, "bf16", 1.0, compile=True, device="cuda")
    skips = sum(counters["inductor"].get(k, 0) for k in list(counters["inductor"]) if "cudagraph_skip" in k)
    out = [(r.loss, r.grad_norm) for r in (st.run(mbs) for _ in range(4))]
    skips = sum(counters["inductor"].get(k, 0) for k in list(counters["inductor"]) if "cudagraph_skip" in k) - skips
    params = buf.param_data.float().clone()
    torch._dynamo.reset()
    return out, params, skips


def attention_checks(rows):
    """The Triton attention (attention_backend 'triton', the one the trainer picks on Hopper) against
    cuDNN's SDPA through the compiled, CUDA-graphed step of the user's path (bf16 parameters, fp32
    main grads with gradient-accumulation fusion, hidden dropout 0.1), 4 steps x 2 micro batches at a
    124M-like width. Attention dropout 0 first (the hidden-dropout seeds are drawn in the same order on
    both sides, so the masks match); then attention dropout 0.1 (the two attentions draw different
    masks: only the loss is comparable, with a looser tolerance). No CUDA-graph skips either way."""
    g = torch.Generator(device="cuda").manual_seed(5)
    d = torch.randint(0, 1024, (8, 1025), device="cuda", generator=g)
    mbs = [(d[:4, :-1], d[:4, 1:]), (d[4:, :-1], d[4:, 1:])]
    for ad, tol in ((0.0, 1e-2), (0.1, 3e-2)):
        a, pa, skips = _graphed_curve(mbs, hidden_dropout=0.1, attention_dropout=ad, attention_backend="triton")
        b, pb, _ = _graphed_curve(mbs, hidden_dropout=0.1, attention_dropout=ad, attention_backend="cudnn")
        dl = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(a, b))
        dgn = max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(a, b))
        dp = rel(pa, pb)
        ok = dl < tol and skips == 0 and (ad > 0 or (dgn < 5 * tol and dp < tol))
        rows.append(dict(check=f"Triton attention vs cuDNN SDPA, compiled+CUDA graphs, attention dropout {ad}",
                         loss_rel=dl, grad_norm_rel=dgn, params_rel=dp, cudagraph_skips=skips,
                         curves={"triton": a, "cudnn": b}, ok=ok))
        print(f"attention triton vs cudnn (attention dropout {ad}): loss rel {dl:.2e} grad-norm rel {dgn:.2e} "
              f"params rel {dp:.2e} cudagraph skips {skips} {'ok' if ok else 'FAIL'}", flush=True)


PARTS = {"ops": op_checks, "model": model_checks, "dropout": dropout_and_accumulation_checks,
         "wgrad": wgrad_fusion_checks, "ce": ce_checks, "attention": attention_checks}


def main(argv=None):
    ap = argparse.ArgumentParser(description="the fused path on the GPU against its plain twins")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma list of {', '.join(PARTS)}, run in the order given")
    a = ap.parse_args(argv)
    parts = a.parts.split(",")  # run in the order given: a lease's timeout cuts the last ones
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"gpu_agreement: unknown --parts {unknown}: want a comma list of {list(PARTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_agreement: no CUDA GPU here; run it on the GPU machine (bash bench/lease.sh checks)")
    rows = []
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), flash_attn=fused.HAVE_FLASH_ATTN)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "gpu_agreement.json")
    for part in parts:
        try:  # a crash in one part still leaves the others' rows
            PARTS[part](rows)
        except Exception as ex:
            rows.append(dict(check=part, error=repr(ex)[:400], ok=False))
            print(f"{part} failed:", repr(ex)[:400], flush=True)
        with open(path + ".tmp", "w") as f:  # after each part: a run cut short keeps what it checked
            json.dump(dict(env=env, tol=TOL, rows=rows), f, indent=1)
        os.replace(path + ".tmp", path)
    bad = [r["check"] for r in rows if r.get("ok") is False]
    print("ALL OK" if not bad else f"FAILED: {bad}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
