"""The weight-gradient GEMMs on the GPU: the one the model runs (hpcmeg/model/wgrad.py's
wgrad_accumulate_: torch.addmm into the fp32 main grad, bf16 operands, beta 1) against each
algorithm cuBLASLt's heuristic offers for the same problem, every one checked against it first.

Why: the 124M user path's profile (bench/results/profile_h200_s12_124M_gbs192.md) spends 8.5 ms per
step (1.8 %) in cuBLASLt's split-K reduce kernels after these GEMMs. Their outputs are a few dozen
192 x 192 tiles (QKV 2304 x 768: 48; the attention's dense 768 x 768: 16) over K = 12,288 tokens,
so the heuristic cuts K to fill 132 SMs and sums the pieces in a second kernel. If another
algorithm of the heuristic's list (another split, a stream-K one) is faster, the model can ask for
it by a rule on that list (the list is deterministic for a problem, so the choice and the
numerics are too, which bit-exact resume needs; timing inside the run would not be).
Measured (session 17, H100, 124M; bench/results/gemm_probe_h100_s17.json): torch's choice was
the fastest or within 3 % for each GEMM (there the heuristic does not split K for qkv, fc1, fc2),
so the model keeps torch's addmm.
Time: triton.testing.do_bench_cudagraph (median of CUDA-graph replays; beta 1 keeps adding into
the same fp32 output, which stays finite).
Usage: python bench/dev/gemm_probe.py [--sizes 124M,355M,1.3B] [--n 16] [--out DIR] [--tag TAG]
Writes <out>/gemm_probe[_<tag>].json after each size: per problem torch's ms, then each
algorithm's ms, its configuration (id, tile, split-K, reduction scheme; waves and workspace from
the heuristic) and its largest difference from torch's result relative to the largest value.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hpcmeg.model import cublaslt  # noqa: E402

V = 50304
# hidden size, tokens per micro batch (the user path's micro batch x 1024)
SIZES = {"124M": (768, 12 * 1024), "355M": (1024, 12 * 1024), "1.3B": (2048, 8 * 1024)}
_EPILOGUE_DEFAULT = 1
# cublasLtMatmulAlgoConfigAttributes_t: id, tile, split-K, reduction scheme (int32 / uint32 each)
_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3}


def problems(size: str) -> list[tuple[str, int, int, int]]:
    """(name, out, in, tokens) of each weight gradient main[out, in] += dy[T, out]^T x[T, in]."""
    d, t = SIZES[size]
    return [("qkv", 3 * d, d, t), ("dense", d, d, t), ("fc1", 4 * d, d, t), ("fc2", d, 4 * d, t),
            ("lm_head", V, d, t)]


def _config_getter(lt: cublaslt.Lt):
    fn = lt.lib.cublasLtMatmulAlgoConfigGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    fn.restype = ctypes.c_int
    return fn


def _config(fn, algo) -> dict:
    out = {}
    for name, attr in _CONFIG.items():
        v, written = ctypes.c_int32(0), ctypes.c_size_t(0)
        st = fn(ctypes.addressof(algo), attr, ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written))
        out[name] = v.value if st == 0 else f"status {st}"
    return out


class Problem:
    """main[out, in] (fp32, row-major) += dy[T, out]^T x[T, in] as one column-major cuBLASLt call:
    D[in, out] = A[in, T] op(B) with A = x (col-major [in, T]), B = dy (col-major [out, T],
    transposed), C = D = main (col-major [in, out]); bf16 A/B, fp32 C/D, fp32 compute, beta 1."""

    def __init__(self, lt: cublaslt.Lt, dy: torch.Tensor, x: torch.Tensor, main: torch.Tensor):
        self.lt, self.dy, self.x, self.main = lt, dy, x, main
        (t, out_f), in_f = dy.shape, x.shape[1]
        ab = cublaslt._CUDA_TYPE[dy.dtype]
        self.la = lt.layout(ab, in_f, t, in_f)
        self.lb = lt.layout(ab, out_f, t, out_f)
        self.lc = lt.layout(cublaslt._R_32F, in_f, out_f, in_f)
        self.desc = ctypes.c_void_p()
        lt.check(lt.lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), cublaslt._COMPUTE_32F, cublaslt._R_32F),
                 "matmul desc")
        lt._set(self.desc, cublaslt._DESC_TRANSA, ctypes.c_int32(cublaslt._OP_N))
        lt._set(self.desc, cublaslt._DESC_TRANSB, ctypes.c_int32(cublaslt._OP_T))
        lt._set(self.desc, cublaslt._DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_DEFAULT))

    def algorithms(self, handle, n: int) -> list:
        pref = self.lt.preference(*cublaslt._alignment(self.x, self.dy, self.main))
        res, count = (cublaslt._HeuristicResult * n)(), ctypes.c_int(0)
        try:
            self.lt.check(self.lt.lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.la, self.lb, self.lc,
                                                                     self.lc, pref, n, res, ctypes.byref(count)),
                          "heuristic")
        finally:
            self.lt.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [res[i] for i in range(count.value) if res[i].state == 0]

    def run(self, handle, r, ws: torch.Tensor) -> None:
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(1.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.lt.check(self.lt.lib.cublasLtMatmul(
            handle, self.desc, ctypes.byref(alpha), self.x.data_ptr(), self.la, self.dy.data_ptr(), self.lb,
            ctypes.byref(beta), self.main.data_ptr(), self.lc, self.main.data_ptr(), self.lc,
            ctypes.byref(r.algo), ws.data_ptr(), r.workspace_size, stream), "matmul")

    def close(self) -> None:
        self.lt.lib.cublasLtMatmulDescDestroy(self.desc)
        for lay in (self.la, self.lb, self.lc):
            self.lt.lib.cublasLtMatrixLayoutDestroy(lay)


def torch_wgrad(main: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    torch.ops.hpcmeg.wgrad_accumulate_(main.view(-1), dy, x, 0)  # the model's op, as the model calls it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="124M,355M,1.3B")
    ap.add_argument("--n", type=int, default=16, help="algorithms asked of the heuristic per problem")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    from triton.testing import do_bench_cudagraph

    from hpcmeg.model import wgrad  # noqa: F401  (registers hpcmeg::wgrad_accumulate_)
    lt = cublaslt.lt()
    if lt is None:
        raise SystemExit("gemm_probe: no usable libcublasLt in this process")
    dev = torch.device("cuda", torch.cuda.current_device())
    handle, get_config = lt.handle(dev.index), _config_getter(lt)
    path = os.path.join(a.out, f"gemm_probe{'_' + a.tag if a.tag else ''}.json")
    report = dict(env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(dev)), rows=[])
    g = torch.Generator(device="cuda").manual_seed(0)
    for size in a.sizes.split(","):
        for name, out_f, in_f, t in problems(size):
            dy = torch.randn(t, out_f, device=dev, generator=g).bfloat16()
            x = torch.randn(t, in_f, device=dev, generator=g).bfloat16()
            ref = torch.zeros(out_f, in_f, device=dev)
            torch_wgrad(ref, dy, x)
            scale = ref.abs().max().item()
            m = torch.zeros_like(ref)
            row = dict(size=size, gemm=name, out=out_f, inp=in_f, tokens=t,
                       torch_ms=round(do_bench_cudagraph(lambda: torch_wgrad(m, dy, x), rep=100), 4), algos=[])
            p = Problem(lt, dy, x, m)
            try:
                for i, r in enumerate(p.algorithms(handle, a.n)):
                    e = dict(rank=i, waves=round(r.waves_count, 3), workspace=r.workspace_size, **_config(get_config, r.algo))
                    try:
                        ws = torch.empty(max(r.workspace_size, 1), dtype=torch.uint8, device=dev)
                        m.zero_()
                        p.run(handle, r, ws)
                        e["rel_diff"] = float(((m - ref).abs().max() / scale).item())
                        e["ms"] = round(do_bench_cudagraph(lambda: p.run(handle, r, ws), rep=100), 4)
                    except Exception as ex:  # an algorithm that fails: keep the others
                        e["error"] = f"{type(ex).__name__}: {str(ex)[:160]}"
                    row["algos"].append(e)
            finally:
                p.close()
            ok = [e for e in row["algos"] if "ms" in e and e["rel_diff"] < 1e-3]
            if ok:
                best = min(ok, key=lambda e: e["ms"])
                row["best"] = dict(rank=best["rank"], ms=best["ms"], x_torch=round(row["torch_ms"] / best["ms"], 3))
            print(json.dumps({k: v for k, v in row.items() if k != "algos"}), flush=True)
            report["rows"].append(row)
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
