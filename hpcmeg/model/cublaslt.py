"""The MLP's two GELU GEMMs through cuBLASLt's GELU epilogues, which PyTorch does not expose,
called with ctypes from the libcublasLt that torch itself loads; with plain PyTorch twins and torch
custom ops.

Why: the GELU and its backward are separate memory-bound passes over [tokens, ffn] after and before
two GEMMs that already hold those values in registers. On the H200's 124M user path (micro batch
12, profile_h200_s12_124M_gbs192.md) hpcmeg's own Triton kernels for them took 37 us (forward) and
61 us (backward with the bias gradient) per layer call, ~1.2 ms, ~5 % of a micro batch. cuBLASLt
can do both inside the GEMMs' epilogues (what Transformer Engine uses on Hopper):
  * forward, CUBLASLT_EPILOGUE_GELU_AUX_BIAS: one GEMM writes g = gelu_tanh(x W1^T + b1) and the
    pre-activation h (kept for the backward); the GELU pass and its re-read of h are gone;
  * backward, CUBLASLT_EPILOGUE_DGELU_BGRAD: fc2's input-gradient GEMM dg = dy W2 multiplies by
    gelu'(h) in its epilogue and sums the bias gradient: dh and db1 without the pass that read dg
    and h and wrote dh.
GELU here is GPT-2's tanh approximation, cuBLASLt's GELU (computed in fp32 in the epilogue).
Measured on an H100 (bench/results/gpu_agreement_h100_s15_lt.json, CUDA-graph replays):
the forward 0.119 ms against 0.142 for the GEMM + Triton GELU at 124M's [12288, 768] x [768, 3072]
(355M 0.185 vs 0.212, 1.3B 0.454 vs 0.489); the backward 0.362 against 0.174 (2.1x slower; 355M
0.606 vs 0.253, 1.3B 0.950 vs 0.525). So the model never calls DGELU_BGRAD: linear_dgelu_bgrad
is here for bench/gpu_agreement.py --parts lt, which times it on each GPU. The forward epilogue
alone (gelu_impl 'cublaslt', fused._MLPCublasLt, the backward as 'triton''s) was +0.9 % tokens/s
against the Triton GELU in the 124M user path on an H100 (bench/results/user_path_h100_s16.md).
Where the library does not load, a warning is printed once and the MLP takes the 'triton' path.
The backward without a GELU pass, done the other way (gelu_impl 'cublaslt_dgelu', the default;
what Transformer Engine does): fc2's input-gradient GEMM with the DGELU epilogue alone
(no bias gradient in it: linear_dgelu), and fc1's bias gradient summed by fc1's weight-gradient
GEMM, which reads dh anyway, with the BGRADB epilogue into the fp32 main grad (wgrad_bgrad_).
Against 'cublaslt''s backward (GEMM, then the Triton pass reading dg and h and writing dh) it
writes dh once from the GEMM. Measured on an H100 (bench/results/mlp_bwd_probe_h100_s19.json): the MLP backward 0.260 against 0.269 ms at 124M (micro 12), 0.339
against 0.361 (micro 16), 0.402 against 0.414 at 355M, 0.964 against 0.973 at 1.3B; in the user
path +0.4 % (124M), +0.5 % (355M), +1.2 % (1.3B) tokens/s (bench/results/user_path_h100_s19.md).
That cuBLASLt offers BGRADB beside an fp32 D only with an fp32 bias gradient (not dy's type, as
Transformer Engine asks first); wgrad_bgrad_ tries both (the first quietly) and rounds the fp32 one.

Layouts (cuBLASLt is column-major; a row-major [r, c] tensor is a column-major [c, r] one):
  forward  D[N, M] = op(A) B with A = W1 (row-major [N, K] = col-major [K, N], transposed),
           B = x (col-major [K, M]), bias [N] per row of D, aux = h like D;
  backward D[F, M] = A B with A = W2 (row-major [H, F] = col-major [F, H]), B = dy (col-major
           [H, M]), aux = h (col-major [F, M]), bias gradient [F] (summed over D's columns);
  wgrad    D[in, out] = A op(B) with A = x (col-major [in, T]), B = dy (col-major [out, T],
           transposed), C = D = the fp32 main grad (row-major [out, in]), bias gradient [out]
           (summed over k = T).
bf16/fp16 operands, fp32 accumulation and scale, beta = 0 (1 into the main grad); the workspace is a torch allocation
(so CUDA graphs capture the calls: the graph pool owns it).

Contract
  linear_gelu_aux(x [M, K], w [N, K], b [N]) -> (g [M, N], h [M, N]), contiguous, x's dtype:
      h = x W^T + b, g = gelu_tanh(h).
  linear_dgelu_bgrad(dy [M, H], w [H, F], h [M, F]) -> (dh [M, F], db [F]) in dy's dtype:
      dh = (dy W) * gelu'(h), db = sum over rows of dh (fp32 inside cuBLASLt, rounded once).
  linear_dgelu(dy, w, h) -> dh: linear_dgelu_bgrad's dh alone (the DGELU epilogue).
  wgrad_bgrad_(flat, dy [.., out], x [.., in], offset) -> db [out] in dy's dtype: wgrad.wgrad_accumulate_
      (the fp32 main grad += dy^T x) and db = dy summed over rows (fp32, rounded once), in one GEMM
      (the BGRADB epilogue).
  All are torch custom ops (hpcmeg::linear_gelu_aux, hpcmeg::linear_dgelu_bgrad, ...; no autograd:
  fused.py's _MLPCublasLt wraps them): cuBLASLt on CUDA for bf16/fp16 when the library loads and
  its heuristic offers an algorithm for the epilogue (else a warning, once per problem or
  unusable library); otherwise
  the GEMM, then hpcmeg::gelu_tanh[_backward] (gelu_impl 'triton''s kernels; their twins on CPU).
  reference_gelu_aux / reference_dgelu_bgrad are the plain twins (fp32 math, the matmuls in the
  operands' dtype as F.linear computes them). tests/test_cublaslt.py checks the twins against
  autograd and, where a libcublasLt is found ($HPCMEG_CUBLASLT_LIB), that every descriptor this
  module builds is accepted; bench/gpu_agreement.py --parts lt checks the GPU path against the
  twins and times it.
  Lt(lib) wraps the library: handles per device and the heuristic's choice per problem are cached
  on the object (what PyTorch's own cuBLAS wrapper keeps per process; no training state).
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings

import torch

from hpcmeg.model import triton_gelu  # noqa: F401  (registers hpcmeg::gelu_tanh[_backward], the fallback)
from hpcmeg.model import wgrad  # noqa: F401  (registers hpcmeg::wgrad_accumulate_, wgrad_bgrad_'s fallback)
from hpcmeg.model.triton_gelu import gelu_grad

# cublasLt.h (CUDA 12 and 13 alike)
_OP_N, _OP_T = 0, 1
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD, _DESC_BIAS_DATA_TYPE = 11, 12, 26
_EPILOGUE_GELU_AUX_BIAS, _EPILOGUE_DGELU, _EPILOGUE_DGELU_BGRAD, _EPILOGUE_BGRADB = 164, 192, 208, 512
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT_BYTES = (5, 6, 7, 8)  # A, B, C, D: the heuristic assumes 256 unless told
WORKSPACE_BYTES = 32 * 1024 * 1024  # what Hopper wants (cuBLAS's own recommendation)
_CUDA_TYPE = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}  # the operands' (A, B) types
_ANY_TYPE = {**_CUDA_TYPE, torch.float32: _R_32F}  # D's and the bias's: fp32 for the main-grad GEMM
LIB_ENV = "HPCMEG_CUBLASLT_LIB"  # a libcublasLt.so path: the tests' way to a library on a CPU machine


class _HeuristicResult(ctypes.Structure):
    # cublasLtMatmulHeuristicResult_t: algo (8 x uint64), workspaceSize, state, wavesCount, reserved[4]
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class LtError(RuntimeError):
    pass


class Lt:
    """libcublasLt through ctypes: descriptors, the heuristic's algorithm (cached per problem), the call."""

    def __init__(self, path: str):
        self.lib = lib = ctypes.CDLL(path)
        vp, u64, i64, sz = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        pvp = ctypes.POINTER(vp)
        sigs = {
            "cublasLtCreate": [pvp],
            "cublasLtMatmulDescCreate": [pvp, ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, sz],
            "cublasLtMatrixLayoutCreate": [pvp, ctypes.c_int, u64, u64, i64],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceCreate": [pvp],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                               ctypes.POINTER(_HeuristicResult), ctypes.POINTER(ctypes.c_int)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self._handles: dict[int, ctypes.c_void_p] = {}
        self._algos: dict[tuple, tuple[_HeuristicResult, int] | None] = {}

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise LtError(f"cuBLASLt {what}: status {status}")

    def handle(self, device_index: int) -> ctypes.c_void_p:
        if device_index not in self._handles:
            h = ctypes.c_void_p()
            with torch.cuda.device(device_index):
                self.check(self.lib.cublasLtCreate(ctypes.byref(h)), "create")
            self._handles[device_index] = h
        return self._handles[device_index]

    def _set(self, desc, attr: int, value) -> None:
        self.check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   f"matmul attribute {attr}")

    def layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        lay = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld), "layout")
        return lay

    def matmul_desc(self, transa: int, transb: int, epilogue: int, bias_ptr: int, aux_ptr: int,
                    aux_ld: int, bias_type: int | None = None) -> ctypes.c_void_p:
        """A matmul descriptor (fp32 compute and scale) with the epilogue and its pointers set (the
        aux matrix takes D's type, cuBLASLt's default; so does the bias / bias gradient unless
        bias_type names another)."""
        desc = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "matmul desc")
        try:
            self._set(desc, _DESC_TRANSA, ctypes.c_int32(transa))
            self._set(desc, _DESC_TRANSB, ctypes.c_int32(transb))
            self._set(desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
            if bias_ptr:  # an epilogue without a bias or an aux matrix gets neither attribute
                self._set(desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))
            if aux_ptr:
                self._set(desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux_ptr))
                self._set(desc, _DESC_AUX_LD, ctypes.c_int64(aux_ld))
            if bias_type is not None:
                self._set(desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int32(bias_type))
        except LtError:
            self.lib.cublasLtMatmulDescDestroy(desc)
            raise
        return desc

    def preference(self, align_a: int = 256, align_b: int = 256, align_d: int = 256) -> ctypes.c_void_p:
        """The heuristic's constraints: at most WORKSPACE_BYTES of workspace, and the operands' actual
        pointer alignments (bytes; the ParamAndGradBuffer's weights are 128-byte aligned views, below
        the 256 cuBLASLt assumes by default)."""
        pref = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        try:
            for attr, value in ((_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES)),
                                *zip(_PREF_MIN_ALIGNMENT_BYTES, (ctypes.c_uint32(align_a), ctypes.c_uint32(align_b),
                                                                 ctypes.c_uint32(align_d), ctypes.c_uint32(align_d)))):
                self.check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value),
                                                                         ctypes.sizeof(value)), f"preference {attr}")
        except LtError:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
            raise
        return pref

    def gemm(self, device: torch.device, key: tuple, transa: int, transb: int, m: int, n: int, k: int,
             a: torch.Tensor, lda: int, b: torch.Tensor, ldb: int, d: torch.Tensor, ldd: int, epilogue: int,
             bias: torch.Tensor | None, aux: torch.Tensor | None, aux_ld: int, beta: float = 0.0,
             quiet: bool = False) -> bool:
        """D[m, n] = op(A) op(B) + beta D with the epilogue (all column-major; A, B and aux of one
        16-bit type, D of that type or fp32, C = D); bias / aux None where the epilogue takes none.
        False when the heuristic offers no algorithm (the caller falls back to its twin; a warning
        once per problem unless quiet: the caller has another form of the call to try)."""
        layouts, desc = [], None
        try:
            for dt, (rows, cols, ld) in ((_CUDA_TYPE[a.dtype], ((k, m) if transa == _OP_T else (m, k)) + (lda,)),
                                         (_CUDA_TYPE[b.dtype], ((n, k) if transb == _OP_T else (k, n)) + (ldb,)),
                                         (_ANY_TYPE[d.dtype], (m, n, ldd))):
                layouts.append(self.layout(dt, rows, cols, ld))
            la, lb, ld_ = layouts
            bias_type = _ANY_TYPE[bias.dtype] if bias is not None and bias.dtype != d.dtype else None
            desc = self.matmul_desc(transa, transb, epilogue, 0 if bias is None else bias.data_ptr(),
                                    0 if aux is None else aux.data_ptr(), aux_ld, bias_type)
            handle = self.handle(device.index)
            if key not in self._algos:  # the heuristic's first choice, once per problem
                pref = self.preference(*_alignment(a, b, d))
                res, count = _HeuristicResult(), ctypes.c_int(0)
                try:
                    st = self.lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld_, ld_, pref, 1,
                                                                 ctypes.byref(res), ctypes.byref(count))
                finally:
                    self.lib.cublasLtMatmulPreferenceDestroy(pref)
                ok = st == 0 and count.value > 0 and res.state == 0
                self._algos[key] = (res, res.workspace_size) if ok else None
                if not ok and not quiet:  # said once per problem: the op then runs its fallback (the
                    # Triton GELU path, or for wgrad_bgrad_ torch's GEMM and a sum)
                    warnings.warn(f"cuBLASLt offers no algorithm for {key} (status {st}, {count.value} found): "
                                  "the op takes its fallback path (hpcmeg/model/cublaslt.py)", stacklevel=2)
            found = self._algos[key]
            if found is None:
                return False
            res, ws_bytes = found
            ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=device)
            alpha, beta_ = ctypes.c_float(1.0), ctypes.c_float(beta)
            stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
            self.check(self.lib.cublasLtMatmul(handle, desc, ctypes.byref(alpha), a.data_ptr(), la, b.data_ptr(), lb,
                                               ctypes.byref(beta_), d.data_ptr(), ld_, d.data_ptr(), ld_,
                                               ctypes.byref(res.algo), ws.data_ptr(), ws_bytes, stream), "matmul")
            return True
        finally:
            if desc is not None:
                self.lib.cublasLtMatmulDescDestroy(desc)
            for lay in layouts:
                self.lib.cublasLtMatrixLayoutDestroy(lay)


def library_path() -> str | None:
    """$HPCMEG_CUBLASLT_LIB, else the libcublasLt this process has loaded (CUDA torch loads it with
    its cuBLAS), else None."""
    return os.environ.get(LIB_ENV) or _loaded_library()


@functools.lru_cache(maxsize=None)
def _loaded_library() -> str | None:
    # read once per process (after lt() made torch load its cuBLAS): /proc/self/maps is long
    if torch.cuda.is_available():
        torch.cuda.current_blas_handle()  # torch loads cuBLAS (and with it cuBLASLt) lazily
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "/libcublasLt.so" in path:
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def _lt_for(path: str) -> Lt | None:
    # a library that does not load or lacks a symbol (another CUDA major, a stub) is said once per
    # path; gelu_impl 'cublaslt' is the default, so the MLP then takes the 'triton' path, not an error
    try:
        return Lt(path)
    except (OSError, AttributeError, LtError) as e:
        warnings.warn(f"cuBLASLt at {path} is unusable ({e}): the GELU runs as its own pass "
                      f"(set model.gelu_impl=triton to silence this)", stacklevel=3)
        return None


def lt() -> Lt | None:
    """The process's Lt (one per library path, made on first use), or None without a usable library."""
    path = library_path()
    return _lt_for(path) if path else None


def _alignment(*ts: torch.Tensor) -> tuple[int, ...]:
    # each pointer's alignment in bytes (capped at cuBLASLt's default assumption, 256): the heuristic
    # is told them, and they are part of the cache key
    return tuple(min(t.data_ptr() & -t.data_ptr(), 256) for t in ts)


def _use_lt(*ts: torch.Tensor) -> bool:
    return all(t.is_cuda for t in ts) and ts[0].dtype in _CUDA_TYPE and all(t.dtype == ts[0].dtype for t in ts)


# ---- the plain twins ------------------------------------------------------------------------

def reference_gelu_aux(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, h): h = x W^T + b as F.linear computes it (x's dtype), g = tanh-GELU of h in fp32, cast."""
    h = torch.nn.functional.linear(x, w, b)
    hf = h.float()
    g = 0.5 * hf * (1.0 + torch.tanh(0.7978845608028654 * (hf + 0.044715 * hf * hf * hf)))
    return g.to(h.dtype), h


def reference_dgelu_bgrad(dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, db): dg = dy W as a matmul in dy's dtype, dh = dg * gelu'(h) in fp32, db its fp32 row sum;
    both rounded once to dy's dtype."""
    dh = (dy @ w).float() * gelu_grad(h.float())
    return dh.to(dy.dtype), dh.sum(0).to(dy.dtype)


# ---- custom ops -----------------------------------------------------------------------------

@torch.library.custom_op("hpcmeg::linear_gelu_aux", mutates_args=())
def linear_gelu_aux(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu_tanh(x W^T + b), x W^T + b) for x [M, K], w [N, K], b [N]: one cuBLASLt GEMM with the
    GELU_AUX_BIAS epilogue on CUDA, the twin elsewhere."""
    lib = lt() if _use_lt(x, w, b) else None
    if lib is not None:
        x, w, b = x.contiguous(), w.contiguous(), b.contiguous()
        (m_tok, k), n = x.shape, w.shape[0]
        g, h = x.new_empty(m_tok, n), x.new_empty(m_tok, n)
        key = ("gelu_aux", x.device.index, x.dtype, m_tok, n, k, _alignment(x, w, b, g, h))
        if lib.gemm(x.device, key, _OP_T, _OP_N, n, m_tok, k, w, k, x, k, g, n, _EPILOGUE_GELU_AUX_BIAS, b, h, n):
            return g, h
    h = torch.nn.functional.linear(x, w, b).contiguous()  # the gelu_impl 'triton' path (its twin on CPU)
    return torch.ops.hpcmeg.gelu_tanh(h), h


@linear_gelu_aux.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0]), x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("hpcmeg::linear_dgelu_bgrad", mutates_args=())
def linear_dgelu_bgrad(dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((dy W) * gelu'(h), its row sum) for dy [M, H], w [H, F], h [M, F]: one cuBLASLt GEMM with the
    DGELU_BGRAD epilogue on CUDA, the twin elsewhere."""
    lib = lt() if _use_lt(dy, w, h) else None
    if lib is not None:
        dy, w, h = dy.contiguous(), w.contiguous(), h.contiguous()
        (m_tok, k), f = dy.shape, w.shape[1]
        dh, db = dy.new_empty(m_tok, f), dy.new_empty(f)
        key = ("dgelu_bgrad", dy.device.index, dy.dtype, m_tok, f, k, _alignment(dy, w, h, dh, db))
        if lib.gemm(dy.device, key, _OP_N, _OP_N, f, m_tok, k, w, f, dy, k, dh, f, _EPILOGUE_DGELU_BGRAD, db, h, f):
            return dh, db
    return torch.ops.hpcmeg.gelu_tanh_backward(dy @ w, h)  # the gelu_impl 'triton' path (its twin on CPU)


@linear_dgelu_bgrad.register_fake
def _(dy, w, h):
    return dy.new_empty(dy.shape[0], w.shape[1]), dy.new_empty(w.shape[1])


# ---- the backward without the GELU pass (gelu_impl 'cublaslt_dgelu') -------------------------

def reference_dgelu(dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dh = (dy W) * gelu'(h): reference_dgelu_bgrad's dh (the twin of linear_dgelu)."""
    return reference_dgelu_bgrad(dy, w, h)[0]


@torch.library.custom_op("hpcmeg::linear_dgelu", mutates_args=())
def linear_dgelu(dy: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(dy W) * gelu'(h) for dy [M, H], w [H, F], h [M, F]: one cuBLASLt GEMM with the DGELU epilogue
    on CUDA (fc2's input gradient; the bias gradient comes from fc1's weight-gradient GEMM,
    wgrad_bgrad_), else the GEMM and the Triton GELU backward (its twin on CPU)."""
    lib = lt() if _use_lt(dy, w, h) else None
    if lib is not None:
        dy, w, h = dy.contiguous(), w.contiguous(), h.contiguous()
        (m_tok, k), f = dy.shape, w.shape[1]
        dh = dy.new_empty(m_tok, f)
        key = ("dgelu", dy.device.index, dy.dtype, m_tok, f, k, _alignment(dy, w, h, dh))
        if lib.gemm(dy.device, key, _OP_N, _OP_N, f, m_tok, k, w, f, dy, k, dh, f, _EPILOGUE_DGELU, None, h, f):
            return dh
    return torch.ops.hpcmeg.gelu_tanh_backward(dy @ w, h)[0]


@linear_dgelu.register_fake
def _(dy, w, h):
    return dy.new_empty(dy.shape[0], w.shape[1])


@torch.library.custom_op("hpcmeg::wgrad_bgrad_", mutates_args=("flat",))
def wgrad_bgrad_(flat: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, offset: int) -> torch.Tensor:
    """wgrad.wgrad_accumulate_ (flat[offset : offset + out * in] viewed [out, in] += dy^T x, the fp32
    main grad) that also returns the bias gradient db = dy summed over rows ([out] in dy's dtype,
    summed in fp32, rounded once): on CUDA one cuBLASLt GEMM with the BGRADB epilogue (the sum over
    the GEMM's k, the tokens, of B = dy, while the GEMM reads dy anyway); else wgrad_accumulate_ and
    dy's fp32 row sum, its twin."""
    out_f, in_f = dy.shape[-1], x.shape[-1]
    dy2, x2 = dy.reshape(-1, out_f).contiguous(), x.reshape(-1, in_f).contiguous()
    lib = lt() if flat.is_cuda and flat.dtype == torch.float32 and _use_lt(dy2, x2) else None
    if lib is not None:
        main, t = flat[offset:offset + out_f * in_f], dy2.shape[0]
        # the bias gradient in dy's type (what Transformer Engine asks for beside an fp32 D), else in
        # fp32 (D's type): the H100's cuBLASLt 13 offers an algorithm only for that, so
        # the first try is quiet and only the last one's miss is said
        for bias_dtype in (dy.dtype, torch.float32):
            db = torch.empty(out_f, dtype=bias_dtype, device=dy.device)
            key = ("wgrad_bgrad", dy.device.index, dy.dtype, t, out_f, in_f, bias_dtype, _alignment(x2, dy2, main, db))
            # main[out, in] row-major = D[in, out] column-major = A[in, T] op(B)[T, out], A = x (col-major
            # [in, T]), B = dy (col-major [out, T], transposed), beta 1: bench/dev/gemm_probe.py's Problem
            if lib.gemm(dy.device, key, _OP_N, _OP_T, in_f, out_f, t, x2, in_f, dy2, out_f, main, in_f,
                        _EPILOGUE_BGRADB, db, None, 0, beta=1.0, quiet=bias_dtype != torch.float32):
                return db.to(dy.dtype)
    torch.ops.hpcmeg.wgrad_accumulate_(flat, dy2, x2, offset)
    return dy2.float().sum(0).to(dy.dtype)


@wgrad_bgrad_.register_fake
def _(flat, dy, x, offset):
    return dy.new_empty(dy.shape[-1])
