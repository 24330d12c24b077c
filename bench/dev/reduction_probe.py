"""Which host ops launch the aten reduce_kernel calls inside the compiled backward?

Compiles a 2-layer GPT at 124M widths (micro batch 12, seq 1024, bf16 parameters, dropout 0.1, the
trainer's fused path) WITHOUT CUDA graphs, so Inductor's fallback calls are visible as host ops, and
lists, for forward+backward, every host op that launched a non-Triton kernel with its shapes and
kernel names (and the Triton LayerNorm kernels), then fwd+bwd ms; then the same for candidate
formulations of the LayerNorm. Also dumps Inductor's output code lines that call aten/extern kernels.
--variants a,b,...: only those Inductor settings (VARIANTS below), e.g. the mix-order reduction's split.
Usage: python bench/dev/reduction_probe.py --out DIR [--variants current,no_mix_order,split64]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from hpcmeg.fused import ops as fused  # noqa: E402
from hpcmeg.model import ops
from hpcmeg.model.config import GPTConfig  # noqa: E402
from hpcmeg.fused.model import build_gpt  # noqa: E402


def probe(tag, out):
    torch.manual_seed(0)
    cfg = GPTConfig(2, 768, 12, 3072, 1024, 50304, hidden_dropout=0.1, attention_dropout=0.1, fused=True)
    m = build_gpt(cfg).cuda().to(torch.bfloat16)
    f = torch.compile(m)
    x = torch.randint(0, 50257, (12, 1024), device="cuda")

    def step():
        f(x, x).float().sum().backward()
        for p in m.parameters():
            p.grad = None
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    import tempfile
    import profile_step
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as t:
        prof.export_chrome_trace(t.name)
        ev = json.load(open(t.name))["traceEvents"]
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    by = profile_step._launching_ops(ev, kernels)
    agg = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        if (k["name"].startswith("triton") and "layer_norm" not in k["name"]) or any(
                w in k["name"] for w in ("nvjet", "cudnn", "gemm", "_ce_fwd", "_keep_mask", "_keep_bits", "_attn_")):
            continue
        agg[k["name"][:100]][0] += 1
        agg[k["name"][:100]][1] += k.get("dur", 0)
    res = [dict(kernel=n, calls=c, us=round(d, 1), ops=by.get(next(k["name"] for k in kernels if k["name"].startswith(n)), []))
           for n, (c, d) in sorted(agg.items(), key=lambda x: -x[1][1])]
    for r in res:
        print(tag, json.dumps(r)[:600], flush=True)
    from triton.testing import do_bench
    ms = do_bench(step, warmup=5, rep=40)
    print(tag, f"fwd+bwd {ms:.3f} ms", flush=True)
    res.append(dict(fwd_bwd_ms=round(ms, 4)))
    torch._dynamo.reset()
    return res


# Inductor settings to try (the aten sums turned out to be the final stage of Inductor's mix-order
# reduction: the LN backward kernel writes [rows/split_size, 768] fp32 partials of dw/db, then the
# wrapper calls `partials.sum(dim=0)`; split_size is 16 at 12288 rows on 132 SMs)
VARIANTS = {
    "current": {},
    "no_split": {"split_reductions": False},
    "no_mix_order": {"triton.mix_order_reduction": False},
    "split32": {"triton.mix_order_reduction_split_size": 32},
    "split64": {"triton.mix_order_reduction_split_size": 64},
    "split128": {"triton.mix_order_reduction_split_size": 128},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default=None, help=f"comma list of {list(VARIANTS)}: those only, then stop")
    a = ap.parse_args()
    import torch._inductor.config as icfg
    report = {}
    for name in (a.variants.split(",") if a.variants else ["current", "no_split"]):
        with icfg.patch(VARIANTS[name]):
            report[name] = probe(name, a.out)
    if a.variants:
        with open(os.path.join(a.out, "reduction_probe_variants.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        return
    # candidate: the LayerNorm as its plain fp32 formula (autograd of primitives under Inductor)
    orig_ln, orig_bdaln = fused.layer_norm, fused.bias_dropout_add_layer_norm

    def bdaln_plain_ln(x, bias, residual, p, training, w, b, eps, out_grad=True):
        o = fused.bias_dropout_add(x, bias, residual, p, training)
        return o, ops.layer_norm(o, w, b, eps)
    fused.layer_norm, fused.bias_dropout_add_layer_norm = ops.layer_norm, bdaln_plain_ln
    try:
        report["plain_ln"] = probe("plain_ln", a.out)
    finally:
        fused.layer_norm, fused.bias_dropout_add_layer_norm = orig_ln, orig_bdaln
    with open(os.path.join(a.out, "reduction_probe.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    # Inductor's generated wrappers: every line calling a non-Triton kernel (aten fallbacks, extern mm)
    import glob
    import re
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_" + os.environ.get("USER", "root"))
    lines = collections.Counter()
    for fn in glob.glob(os.path.join(cache, "**", "*.py"), recursive=True):
        for ln in open(fn, errors="replace"):
            code = ln.strip()
            if code.startswith("#") or "import" in code:  # graph comments and imports: not calls
                continue
            if re.search(r"aten\.|extern_kernels\.|torch\.ops\.", code):
                lines[re.sub(r"buf\d+|arg\d+_\d+|primals_\d+|tangents_\d+|getitem_\d+|\d+", "#", code)[:200]] += 1
    with open(os.path.join(a.out, "reduction_probe_wrapper_lines.txt"), "w") as fh:
        for ln, n in lines.most_common(200):
            fh.write(f"{n:5d} {ln}\n")


if __name__ == "__main__":
    main()
