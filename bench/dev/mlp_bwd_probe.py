"""The MLP backward's GELU on the GPU: the shipped path (gelu_impl 'cublaslt': fc2's input-gradient
GEMM, then the Triton GELU backward with fc1's bias gradient, then fc1's weight-gradient GEMM into
the fp32 main grad) against gelu_impl 'cublaslt_dgelu' (fc2's input-gradient GEMM with cuBLASLt's
DGELU epilogue, then fc1's weight-gradient GEMM with the BGRADB epilogue summing the bias gradient),
at the user path's shapes, each checked against the fp64 twin first.

Why: the Triton GELU backward reads dg and h and writes dh, 109 us per layer call at 124M micro 16
on the H100 (profile_h100_s17_124M_mb16_gbs192.md: 18.9 ms per step, 5 % of it; 2 % at 1.3B on the
H200, profile_h200_s10_1.3B_gbs64.md). The DGELU epilogue reads h where the GEMM writes, so dh is
written once and dg never; BGRADB sums dh in the GEMM that reads it anyway. cuBLASLt's
DGELU_BGRAD (both in the first GEMM) measured 2.1x slower than the shipped pair on the H100
(gpu_agreement --parts lt): the bias sum across the tokens is what that epilogue does badly, so
this probe times the split Transformer Engine uses.
Usage: python bench/dev/mlp_bwd_probe.py [--sizes 124M,124M@16,355M,1.3B] [--out DIR] [--tag TAG]
Writes <out>/mlp_bwd_probe[_<tag>].json after each size: per size the parts' and the two paths'
ms (triton.testing.do_bench_cudagraph, median of CUDA-graph replays), whether cuBLASLt ran each
epilogue (else the op fell back to its twin path and the row says so), and the errors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hpcmeg.model import cublaslt  # noqa: E402  (registers the ops)

# hidden size, tokens per micro batch (the user path's micro batch x 1024); "124M@16": micro 16
SIZES = {"124M": (768, 12 * 1024), "124M@16": (768, 16 * 1024), "355M": (1024, 12 * 1024),
         "1.3B": (2048, 8 * 1024)}


def shipped(dy, w2, h, x, flat):
    dh, db = torch.ops.hpcmeg.gelu_tanh_backward(dy @ w2, h)
    torch.ops.hpcmeg.wgrad_accumulate_(flat, dh, x, 0)
    return dh, db


def dgelu(dy, w2, h, x, flat):
    dh = torch.ops.hpcmeg.linear_dgelu(dy, w2, h)
    return dh, torch.ops.hpcmeg.wgrad_bgrad_(flat, dh, x, 0)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max())


def probe(size: str, dev: torch.device, g: torch.Generator) -> dict:
    from triton.testing import do_bench_cudagraph

    d, t = SIZES[size]
    f = 4 * d
    dy = (torch.randn(t, d, device=dev, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(d, f, device=dev, generator=g) * 0.02).bfloat16()
    h = torch.randn(t, f, device=dev, generator=g).bfloat16()
    x = torch.randn(t, d, device=dev, generator=g).bfloat16()
    # the fp64 twin: dh = (dy W2) * gelu'(h), db its row sum, the weight gradient dh^T x
    dh_ref = cublaslt.reference_dgelu(dy.double(), w2.double(), h.double())
    row = dict(size=size, tokens=t, hidden=d, ffn=f)
    for name, fn in (("shipped", shipped), ("cublaslt_dgelu", dgelu)):
        flat = torch.zeros(f * d, device=dev)
        dh, db = fn(dy, w2, h, x, flat)
        torch.cuda.synchronize()
        row[f"{name}_err"] = dict(dh=_rel(dh, dh_ref), db=_rel(db, dh.double().sum(0)),
                                  dw=_rel(flat.view(f, d), dh.double().t() @ x.double()))
        row[f"{name}_ms"] = round(do_bench_cudagraph(lambda: fn(dy, w2, h, x, flat), rep=100), 4)
    lib = cublaslt.lt()
    # per problem key (name, and for wgrad_bgrad the bias gradient's type): False where the
    # heuristic offered no algorithm and the op ran its fallback
    used = row["cublaslt_used"] = {}
    for k, v in (lib._algos.items() if lib else []):
        if k[3:6] == (t, f, d):
            used[f"{k[0]} {k[6]}" if k[0] == "wgrad_bgrad" else k[0]] = v is not None
    flat = torch.zeros(f * d, device=dev)
    dg = dy @ w2
    dh = torch.ops.hpcmeg.linear_dgelu(dy, w2, h)
    parts = {"fc2_dgrad_gemm": lambda: dy @ w2,
             "triton_gelu_bwd": lambda: torch.ops.hpcmeg.gelu_tanh_backward(dg, h),
             "fc1_wgrad": lambda: torch.ops.hpcmeg.wgrad_accumulate_(flat, dh, x, 0),
             "dgelu_gemm": lambda: torch.ops.hpcmeg.linear_dgelu(dy, w2, h),
             "fc1_wgrad_bgradb": lambda: torch.ops.hpcmeg.wgrad_bgrad_(flat, dh, x, 0)}
    row["parts_ms"] = {k: round(do_bench_cudagraph(fn, rep=100), 4) for k, fn in parts.items()}
    row["x_shipped"] = round(row["shipped_ms"] / row["cublaslt_dgelu_ms"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="124M,124M@16,355M,1.3B")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    for s in a.sizes.split(","):
        if s not in SIZES:
            sys.exit(f"bench/dev/mlp_bwd_probe.py: --sizes: unknown size {s!r} (want some of {', '.join(SIZES)})")
    if not torch.cuda.is_available():
        sys.exit("bench/dev/mlp_bwd_probe.py: no CUDA GPU here; run it on the GPU machine (bench/lease.sh mlpbwd)")
    dev = torch.device("cuda", torch.cuda.current_device())
    path = os.path.join(a.out, f"mlp_bwd_probe{'_' + a.tag if a.tag else ''}.json")
    report = dict(env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(dev),
                           cublaslt=cublaslt.library_path()), rows=[])
    g = torch.Generator(device=dev).manual_seed(0)
    for size in a.sizes.split(","):
        try:
            row = probe(size, dev, g)
        except Exception as ex:  # keep the other sizes
            row = dict(size=size, error=f"{type(ex).__name__}: {str(ex)[:300]}")
        print(json.dumps(row), flush=True)
        report["rows"].append(row)
        os.makedirs(a.out, exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
