"""hpcmeg/kernels/attention.py on the GPU: agreement with its twin and with SDPA, and its time
against cuDNN SDPA at the model sizes' attention shapes, over a few tile configurations.

Agreement (bf16 kernels vs the fp32 twin on the same bf16 inputs; ||a - b|| / ||b||): output and
dqkv at dropout 0 and 0.1 (the twin has the kernels' exact keep-mask), and at dropout 0 against
SDPA. Time: both by median CUDA-graph replays (triton.testing.do_bench_cudagraph), as the compiled
model launches them (Inductor's CUDA graphs). Forward alone, backward alone and forward + backward
of attention as the model runs it, from qkv [b, s, heads, 3 * head_dim] to out and back to the
gradient of qkv. SDPA: the model's call (fused.causal_attention: q, k, v strided views of qkv, no
copy; cuDNN allocates out in q's token-major layout, so dO, the dense layer's gradient viewed back,
has out's strides as it does here) and torch.autograd.grad of qkv, which includes the
concatenation of dq, dk, dv (the compiled backward's cat kernel); its backward alone is fwd+bwd -
fwd. Triton: the kernels themselves. (Why CUDA graphs: an eager loop calling `.backward(do)` on
a leaf qkv was launch-bound and added AccumulateGrad's read-modify-write of the leaf's gradient,
which the model, whose qkv is the QKV GEMM's output, never runs: bench/results/history/
attention_probe_h200_s12.json read cuDNN flat at ~0.65 ms from 124M to 1.3B that way.)
Configurations: --fwd, --bwd and --bits list overrides of triton_attention.Launch (field=value,
'+'-joined; 'default' is DEFAULT_LAUNCH). The fastest pair at each size is reported as "best spec":
a Launch to try as DEFAULT_LAUNCH (the model runs that one launch; a change there is a source
edit, checked by tests/test_triton_attention.py and this probe's agreement rows).
Usage: python bench/dev/attention_probe.py --sizes 124M,1.3B [--fwd "default fwd_warps=8 ..."] [--bwd "..."]
       [--bits "bits_warps=8 ..."] [--p 0.1] [--no-sdpa] [--no-agreement] [--agree "default ..."]
Writes <out>/attention_probe[_<tag>].json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hpcmeg.kernels import attention as ta  # noqa: E402

SHAPES = {"124M": (12, 1024, 12, 64), "355M": (12, 1024, 16, 64), "1.3B": (8, 1024, 16, 128)}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graphed(fn, res: dict | None = None, key: str = "", iters: int = 20) -> float:
    """Median ms of fn replayed in a CUDA graph; events (an eager loop: host overhead included) if
    capture fails, noted in res[key + ' timing']."""
    from triton.testing import do_bench_cudagraph
    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print(f"  cuda-graph timing failed ({type(e).__name__}: {str(e)[:80]}); events", flush=True)
        if res is not None:
            res[f"{key} timing"] = f"events, capture failed: {type(e).__name__} {str(e)[:80]}"
        return timed(fn, iters)


def launch(spec: str) -> ta.Launch:
    """A '+'-joined list of Launch field=value overrides ('default': DEFAULT_LAUNCH)."""
    if spec == "default":
        return ta.DEFAULT_LAUNCH
    return dataclasses.replace(ta.DEFAULT_LAUNCH, **{k: int(v) for k, v in (kv.split("=") for kv in spec.split("+"))})


def best_spec(res: dict, p: float) -> str:
    """The fastest timed forward spec's fwd_* fields with the fastest backward spec's other fields,
    as one '+'-joined Launch spec (the forward reads only fwd_*, the backward the rest)."""
    def fastest(kind):
        timed = [(v, k.split("[", 1)[1][:-1]) for k, v in res.items()
                 if k.startswith(f"triton p={p} {kind} [") and isinstance(v, float)]
        return dataclasses.asdict(launch(min(timed)[1])) if timed else None
    fwd, bwd = fastest("fwd"), fastest("bwd")
    if fwd is None or bwd is None:
        return "default"
    base = dataclasses.asdict(ta.DEFAULT_LAUNCH)
    merged = {k: (fwd[k] if k.startswith("fwd_") else bwd[k]) for k in base}
    return "+".join(f"{k}={v}" for k, v in merged.items() if v != base[k]) or "default"


def with_best_bits(res: dict, p: float, spec: str) -> str:
    """spec with the keep-bits launch (Launch.bits_*) of the fastest --bits variant appended, when it
    beat the default launch's time by >= 5 % (the forward times above ran the default bits launch)."""
    default = res.get(f"triton p={p} keep bits")
    timed = [(v, k.split("[", 1)[1][:-1]) for k, v in res.items()
             if k.startswith(f"triton p={p} keep bits [") and isinstance(v, float)]
    if not timed or not isinstance(default, float) or min(timed)[0] >= 0.95 * default:
        return spec
    bits = {k: v for k, v in dataclasses.asdict(launch(min(timed)[1])).items() if k.startswith("bits_")}
    base = dataclasses.asdict(ta.DEFAULT_LAUNCH)
    extra = "+".join(f"{k}={v}" for k, v in bits.items() if v != base[k])
    return extra if spec == "default" else f"{spec}+{extra}"


def sdpa_step(qkv, p, backend):
    """The model's SDPA call (fused.causal_attention_qkv -> causal_attention): qkv [b, s, h, 3d] ->
    out [b, s, h, d], a view of SDPA's [b, h, s, d] output."""
    d = qkv.shape[-1] // 3
    q, k, v = (t.transpose(1, 2) for t in qkv.split(d, dim=-1))
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2)


def sdpa_fwd_bwd(x, do, p, backend):
    """Forward, then dqkv as autograd.grad returns it (dq, dk, dv concatenated into qkv's layout), not
    accumulated into x.grad: the model's qkv is an intermediate, its gradient feeds the QKV GEMMs."""
    return torch.autograd.grad(sdpa_step(x, p, backend), x, do)[0]


def agreement(b, s, h, d, rows, spec="default"):
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(b, s, h, 3 * d, device="cuda", generator=g).bfloat16()
    do = torch.randn(b, s, h, d, device="cuda", generator=g).bfloat16()
    seed = torch.tensor([1234567], dtype=torch.int64, device="cuda")
    for p in (0.0, 0.1):
        bl = launch(spec)
        out, lse, bits = ta.forward(qkv, seed, p, bl)
        dqkv, dbias = ta.backward(do, qkv, out, lse, bits, p, bl, bias_grad=True)  # as the model calls it
        ref_out = ta.reference(qkv.float(), seed, p)
        ref_g = ta.reference_backward(do.float(), qkv.float(), seed, p)  # fp32
        r = dict(check=f"triton [{spec}] vs twin p={p}", out=rel(out, ref_out), dqkv=rel(dqkv, ref_g),
                 dbias=rel(dbias, ta.reference_bias_grad(ref_g, torch.float32)),
                 lse=rel(lse, ta._reference_lse2(qkv.float())))
        if p == 0:
            x = qkv.clone().requires_grad_(True)
            so = sdpa_step(x, 0.0, SDPBackend.CUDNN_ATTENTION)
            so.backward(do)
            r.update(out_vs_cudnn=rel(out, so), dqkv_vs_cudnn=rel(dqkv, x.grad))
        else:  # the kept fraction, from the twin's mask (the kernels use the same)
            r["kept"] = ta.reference_keep(seed, 2, s, p).float().mean().item()
        r["ok"] = all(v < 2e-2 for k, v in r.items() if k not in ("check", "kept"))
        rows.append(r)
        print(json.dumps(r), flush=True)
        del ref_out, ref_g
        torch.cuda.empty_cache()


def timing(size, b, s, h, d, fwd_specs, bwd_specs, iters, rows, ps=(0.0, 0.1), sdpa=True, bits_specs=()):
    qkv = torch.randn(b, s, h, 3 * d, device="cuda").bfloat16()
    do = torch.randn(b, s, h, d, device="cuda").bfloat16()
    seed = torch.tensor([99], dtype=torch.int64, device="cuda")
    flops = 4 * b * h * s * s * d / 2  # causal forward, two matmuls; backward 2.5x that
    res = dict(size=size, shape=[b, s, h, d])
    for p in ps:
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))[:2 * sdpa]:
            x = qkv.clone().requires_grad_(True)  # so the forward saves what the backward reads, as in training
            try:
                sdpa_fwd_bwd(x, do, p, be)  # a backend that refuses the inputs raises here, outside capture
                res[f"{name} p={p} fwd"] = graphed(lambda: sdpa_step(x, p, be), res, f"{name} p={p} fwd", iters)
                res[f"{name} p={p} fwd+bwd"] = graphed(lambda: sdpa_fwd_bwd(x, do, p, be), res,
                                                       f"{name} p={p} fwd+bwd", iters)
                res[f"{name} p={p} bwd (fwd+bwd - fwd)"] = res[f"{name} p={p} fwd+bwd"] - res[f"{name} p={p} fwd"]
            except RuntimeError as e:
                res[f"{name} p={p}"] = f"refused: {str(e)[:80]}"
        for spec in fwd_specs:
            bl = launch(spec)
            try:
                res[f"triton p={p} fwd [{spec}]"] = graphed(lambda: ta.forward(qkv, seed, p, bl))
            except Exception as e:  # a tile that does not fit (shared memory, registers)
                res[f"triton p={p} fwd [{spec}]"] = f"failed: {type(e).__name__} {str(e)[:80]}"
        out, lse, bits = ta.forward(qkv, seed, p)
        if p:
            res[f"triton p={p} keep bits"] = graphed(lambda: ta.keep_bits(seed, b * h, s, p))
            # launch variants of the bits kernel (Launch.bits_*): the same words below the diagonal
            need = torch.arange(s // 16, device="cuda").view(1, -1) <= (torch.arange(s, device="cuda") // 16).view(-1, 1)
            ref = ta.keep_bits(seed, b * h, s, p)[:, need]
            for spec in bits_specs:
                bl = launch(spec)
                try:
                    same = torch.equal(ta.keep_bits(seed, b * h, s, p, bl)[:, need], ref)
                    res[f"triton p={p} keep bits [{spec}]"] = (graphed(lambda: ta.keep_bits(seed, b * h, s, p, bl))
                                                               if same else "FAIL: bits differ from the default launch")
                except Exception as e:
                    res[f"triton p={p} keep bits [{spec}]"] = f"failed: {type(e).__name__} {str(e)[:80]}"
        for spec in bwd_specs:
            bl = launch(spec)
            try:
                res[f"triton p={p} bwd [{spec}]"] = graphed(lambda: ta.backward(do, qkv, out, lse, bits, p, bl, True))
            except Exception as e:
                res[f"triton p={p} bwd [{spec}]"] = f"failed: {type(e).__name__} {str(e)[:80]}"
        fw = [v for k, v in res.items() if k.startswith(f"triton p={p} fwd") and isinstance(v, float)]
        bw = [v for k, v in res.items() if k.startswith(f"triton p={p} bwd") and isinstance(v, float)]
        if fw and bw:
            res[f"triton p={p} best fwd+bwd"] = min(fw) + min(bw)
            res[f"triton p={p} best TFLOP/s"] = round(3.5 * flops / ((min(fw) + min(bw)) * 1e-3) / 1e12, 1)
        res[f"triton p={p} best spec"] = with_best_bits(res, p, best_spec(res, p))
        c = res.get(f"cudnn p={p} fwd+bwd")
        if isinstance(c, float):
            res[f"cudnn p={p} TFLOP/s"] = round(3.5 * flops / (c * 1e-3) / 1e12, 1)
    rows.append(res)
    print(json.dumps(res, indent=1), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="124M")
    ap.add_argument("--fwd", default="default")
    ap.add_argument("--bwd", default="default")
    ap.add_argument("--bits", default="", help="Launch specs of the keep-bits kernel to time alone "
                                               "(bits_rows, bits_groups, bits_warps)")
    ap.add_argument("--iters", type=int, default=20, help="event-timed iterations where CUDA-graph capture fails")
    ap.add_argument("--p", default="0.0,0.1", help="dropout rates to time")
    ap.add_argument("--no-sdpa", action="store_true", help="time only the Triton kernels")
    ap.add_argument("--no-agreement", action="store_true")
    ap.add_argument("--agree", default="default", help="tile configurations checked against the twin")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    rows: list = []
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version())
    if not a.no_agreement:
        for spec in a.agree.split():
            for shape in ((2, 1024, 4, 64), (2, 256, 4, 128)):
                try:
                    agreement(*shape, rows, spec)
                except Exception as e:  # keep the timings
                    rows.append(dict(check=f"triton [{spec}] {shape}", error=f"{type(e).__name__}: {str(e)[-300:]}"))
                    print(rows[-1], flush=True)
    for size in a.sizes.split(","):
        timing(size, *SHAPES[size], a.fwd.split(), a.bwd.split(), a.iters, rows,
               tuple(float(x) for x in a.p.split(",")), not a.no_sdpa, a.bits.split())
        write(a, env, rows)  # after each size: a run cut short by its timeout keeps what it timed


def write(a, env: dict, rows: list) -> None:
    with open(os.path.join(a.out, f"attention_probe{'_' + a.tag if a.tag else ''}.json"), "w") as f:
        json.dump(dict(env=env, fwd=a.fwd, bwd=a.bwd, rows=rows), f, indent=1)

if __name__ == "__main__":
    main()
