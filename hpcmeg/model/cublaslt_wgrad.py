"""The weight-gradient GEMM (main[out, in] fp32 += dy^T x, bf16 operands) through cuBLASLt with an
algorithm picked from its heuristic's list by a fixed rule, instead of the one torch's addmm takes.

Why: torch's addmm into the fp32 main grad (hpcmeg/model/wgrad.py) gets cuBLAS's first choice: for
these problems (outputs of a few dozen 192 x 192 tiles over K = tokens, 12,288 at 124M micro 12)
a split-K kernel and then a separate split-K reduce kernel, 9.2 ms of the 124M step on the H200
(1.8 %, bench/results/profile_h200_s12_124M_gbs192_triton_attn.md). The heuristic's list holds
other algorithms (other splits, other reduction schemes); bench/gemm_probe.py times each one and
each rule below, and writes the rule that wins for the user path to try ($HPCMEG_WGRAD_ALGO).
A rule, not a timing inside the run: the heuristic's list is deterministic for a problem, so the
algorithm and with it the summation order (the numerics) are the same on every rank and on every
restart, which bit-exact resume needs.

Rules ($HPCMEG_WGRAD_ALGO; unset, empty or 'torch': torch's addmm):
  rank=K       the heuristic's K-th algorithm (0: its first choice), else its first
  splitk=S     the first with split-K S (1: no split), else the first
  reduction=R  the first with reduction scheme R (cublasLtReductionScheme_t: 0 none, 1 in place,
               2 compute type, 4 output type), else the first
Contract
  WgradGemm(lt, dy [T, out], x [T, in], main [out, in] fp32): the descriptors of one problem
    (column-major: D[in, out] = A[in, T] op(B) with A = x, B = dy transposed, C = D = main, beta 1);
    .algorithms(handle, n) the heuristic's list, .run(handle, result, workspace), .close().
  algo_config(lt, result) -> {id, tile, splitk, reduction}: what the list entry is.
  pick(configs, rule) -> the index the rule picks in a list of algo_config dicts.
  accumulate(main, dy, x, rule) -> bool: the GEMM by the rule (True), or False where cuBLASLt is
    not usable for it (no library, another dtype, not contiguous, no algorithm): the caller adds
    with torch. Heuristic lists and picks are cached on the Lt object per problem and alignment.
  parse_rule(rule) -> (kind, value) or None for torch; a bad rule raises ValueError naming the env.
"""
from __future__ import annotations

import ctypes
import os

import torch

from hpcmeg.model import cublaslt

RULE_ENV = "HPCMEG_WGRAD_ALGO"
_EPILOGUE_DEFAULT = 1
# cublasLtMatmulAlgoConfigAttributes_t: id, tile, split-K count, reduction scheme (4-byte values)
_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3}
_RULE_KINDS = ("rank", "splitk", "reduction")
LIST_LENGTH = 16  # algorithms asked of the heuristic per problem


def parse_rule(rule: str | None) -> tuple[str, int] | None:
    if not rule or rule == "torch":
        return None
    kind, _, value = rule.partition("=")
    try:
        if kind not in _RULE_KINDS:
            raise ValueError(kind)
        return kind, int(value)
    except ValueError:
        raise ValueError(f"${RULE_ENV}={rule!r}: want torch, rank=K, splitk=S or reduction=R") from None


def pick(configs: list[dict], rule: tuple[str, int]) -> int | None:
    """The index `rule` picks in the heuristic's list (as algo_config dicts), None for an empty list."""
    if not configs:
        return None
    kind, value = rule
    if kind == "rank":
        return value if value < len(configs) else 0
    return next((i for i, c in enumerate(configs) if c.get(kind) == value), 0)


def _config_getter(lt: cublaslt.Lt):
    fn = lt.lib.cublasLtMatmulAlgoConfigGetAttribute
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    fn.restype = ctypes.c_int
    return fn


def algo_config(lt: cublaslt.Lt, result) -> dict:
    fn, out = _config_getter(lt), {}
    for name, attr in _CONFIG.items():
        v, written = ctypes.c_int32(0), ctypes.c_size_t(0)
        st = fn(ctypes.addressof(result.algo), attr, ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written))
        out[name] = v.value if st == 0 else f"status {st}"
    return out


class WgradGemm:
    """main[out, in] (fp32, row-major) += dy[T, out]^T x[T, in] as one column-major cuBLASLt call."""

    def __init__(self, lt: cublaslt.Lt, dy: torch.Tensor, x: torch.Tensor, main: torch.Tensor):
        self.lt, self.dy, self.x, self.main = lt, dy, x, main
        self.la = self.lb = self.lc = self.desc = None
        try:
            (t, out_f), in_f = dy.shape, x.shape[1]
            ab = cublaslt._CUDA_TYPE[dy.dtype]
            self.la = lt.layout(ab, in_f, t, in_f)      # x: col-major [in, T]
            self.lb = lt.layout(ab, out_f, t, out_f)    # dy: col-major [out, T], used transposed
            self.lc = lt.layout(cublaslt._R_32F, in_f, out_f, in_f)  # main: col-major [in, out]
            self.desc = ctypes.c_void_p()
            lt.check(lt.lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), cublaslt._COMPUTE_32F,
                                                     cublaslt._R_32F), "matmul desc")
            lt._set(self.desc, cublaslt._DESC_TRANSA, ctypes.c_int32(cublaslt._OP_N))
            lt._set(self.desc, cublaslt._DESC_TRANSB, ctypes.c_int32(cublaslt._OP_T))
            lt._set(self.desc, cublaslt._DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_DEFAULT))
        except BaseException:
            self.close()
            raise

    def algorithms(self, handle, n: int = LIST_LENGTH) -> list:
        pref = self.lt.preference(*cublaslt._alignment(self.x, self.dy, self.main))
        res, count = (cublaslt._HeuristicResult * n)(), ctypes.c_int(0)
        try:
            st = self.lt.lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.la, self.lb, self.lc, self.lc,
                                                            pref, n, res, ctypes.byref(count))
        finally:
            self.lt.lib.cublasLtMatmulPreferenceDestroy(pref)
        if st != 0:
            return []
        return [res[i] for i in range(count.value) if res[i].state == 0]

    def run(self, handle, result, ws: torch.Tensor) -> None:
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(1.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.main.device).cuda_stream)
        self.lt.check(self.lt.lib.cublasLtMatmul(
            handle, self.desc, ctypes.byref(alpha), self.x.data_ptr(), self.la, self.dy.data_ptr(), self.lb,
            ctypes.byref(beta), self.main.data_ptr(), self.lc, self.main.data_ptr(), self.lc,
            ctypes.byref(result.algo), ws.data_ptr(), result.workspace_size, stream), "matmul")

    def close(self) -> None:
        if self.desc is not None:
            self.lt.lib.cublasLtMatmulDescDestroy(self.desc)
        for lay in (self.la, self.lb, self.lc):
            if lay is not None:
                self.lt.lib.cublasLtMatrixLayoutDestroy(lay)
        self.la = self.lb = self.lc = self.desc = None


def accumulate(main: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, rule: tuple[str, int]) -> bool:
    """main += dy^T x by the algorithm `rule` picks; False (nothing done) where cuBLASLt cannot."""
    if not (main.is_cuda and main.dtype == torch.float32 and dy.dtype in cublaslt._CUDA_TYPE
            and x.dtype == dy.dtype and main.is_contiguous() and dy.is_contiguous() and x.is_contiguous()):
        return False
    lt = cublaslt.lt()
    if lt is None:
        return False
    dev = main.device
    key = ("wgrad", rule, dev.index, dy.dtype, *dy.shape, x.shape[1], cublaslt._alignment(x, dy, main))
    g = WgradGemm(lt, dy, x, main)
    try:
        handle = lt.handle(dev.index)
        if key not in lt._algos:  # the list and the pick, once per problem (deterministic)
            results = g.algorithms(handle)
            i = pick([algo_config(lt, r) for r in results], rule)
            lt._algos[key] = None if i is None else (results[i], results[i].workspace_size)
        found = lt._algos[key]
        if found is None:
            return False
        ws = torch.empty(max(found[1], 1), dtype=torch.uint8, device=dev)
        g.run(handle, found[0], ws)
        return True
    finally:
        g.close()


def rule_from_env() -> tuple[str, int] | None:
    return parse_rule(os.environ.get(RULE_ENV))
