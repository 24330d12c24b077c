"""The MLP's tanh-GELU in Triton: the forward, and the backward with the bias gradient in the same
pass; with plain PyTorch twins and torch custom ops.

Why: the GELU is memory-bound in theory (bf16 [12288, 3072] at 124M, micro batch 12: 151 MB of
forward traffic, ~35 us at the H200's ~4.3 TB/s achievable) but Inductor's kernel evaluates tanh
with libdevice (a long polynomial per element), which makes it ALU-bound: 51 us on the H200. Here
  g(h) = 0.5 h (1 + tanh(u)) = h * sigmoid(2u),  u = GELU_C (h + 0.044715 h^3),
and sigmoid(2u) = 1 / (1 + exp2(h (A + B h^2))) with A = -2 GELU_C log2(e), B = 0.044715 A: one
exp2 (a single MUFU instruction) and one fp32 division (Triton's `/` is div.full.f32, approximate,
~2 ulp) per element. The derivative reuses s = sigmoid(2u):
  g'(h) = s + h s (1 - s) 2 GELU_C (1 + 3 * 0.044715 h^2).
The backward also sums dh over the rows (the gradient of the bias added just before the GELU, in
the GEMM's epilogue), so no second pass re-reads [tokens, ffn] for it.

Contract
  gelu_forward(h [..., F] bf16|fp16|fp32) -> g, h's shape and dtype, contiguous; math in fp32.
  gelu_backward(dg, h: same shape [..., F]) -> (dh, dbias): dh = dg * g'(h) in fp32, stored in
    h's dtype; dbias [F] = the fp32 sum over all leading dims of the fp32 dh values (before their
    rounding), rounded once to h's dtype (the bias's dtype in the fused MLP: bf16 parameters take
    no cast kernel). Deterministic, no atomics: each program of the main kernel owns a
    column block and a fixed set of row tiles and writes its fp32 partial sum to one row of a
    partials buffer [P, F]; a second small kernel adds the P rows in a fixed order (P = 1 with fp32
    h: the main kernel writes dbias itself). The grid depends on the GPU's SM count, so dbias is bit-for-bit
    reproducible on one GPU model, not across models.
  Inputs that are not contiguous are copied first (the kernels address [N, F] row-major).
  Custom ops (one opaque kernel each for torch.compile / CUDA graphs; fakes give shapes):
    hpcmeg::gelu_tanh(h) -> g and hpcmeg::gelu_tanh_backward(dg, h) -> (dh, dbias): the kernels on
    CUDA (bf16/fp16/fp32, triton importable), the twins elsewhere; hpcmeg::gelu_tanh_recompute(h)
    is gelu_tanh under another name (a backward's recomputation that torch.compile must not merge
    with the forward's call). No autograd is registered:
    hpcmeg/fused/ops.py wraps them in its autograd.Function.
  reference_forward(h) / reference_backward(dg, h): the plain twins (fp32 math, same outputs).
    gelu_grad(h) is the written-out derivative in h's dtype (tests/test_triton_gelu.py checks it
    against autograd of ops.bias_gelu and the kernels against the twins in Triton's interpreter;
    bench/dev/gelu_probe.py checks the kernels against the twins on the GPU and times them).
  launch(kernel, grid, device, ...) runs a kernel on the tensors' GPU, or in Triton's interpreter
    (TRITON_INTERPRET=1) for CPU tensors.
Triton is optional: without it (CPU-only installs) the ops run the twins.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hpcmeg.model.ops import GELU_C, bias_gelu

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the ops run the twins
    triton = tl = None

GELU_A3 = 0.044715  # the cubic coefficient of u
LOG2E = 1.4426950408889634
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REGISTERS_PER_SM = 65536  # 32-bit registers per SM on sm_80 / sm_90
INTERPRETER_SMS = 4  # "SMs" assumed for CPU tensors (Triton's interpreter): several partial rows in tests


@dataclass(frozen=True)
class Launch:
    """Tile sizes and launch shapes. Chosen by the reasoning in the comments (not yet timed on the
    GPU; bench/dev/gelu_probe.py times a few alternatives). All sizes are powers of two (tl.arange)."""
    # Forward: flat over all N * F elements (contiguous, so no row structure is needed and every
    # 16-byte vector is aligned). 2048 elements x 2 B = 4 KB read per program; 4 warps = 128
    # threads x 16 elements = two 16-byte loads in flight per thread. [12288, 3072] -> 18,432
    # programs (~140 per SM), so the last partial wave is < 1% of the pass. Up to 16 such programs
    # reside per SM (2048 threads; ptxas: 32 registers, so the register file allows all 16): ~64 KB
    # of loads in flight per SM, more than the ~35 KB that 4.8 TB/s x ~1 us loaded latency / 132
    # SMs needs.
    fwd_block: int = 2048
    fwd_warps: int = 4
    # Backward: program (c, r) owns columns [c * bwd_f, (c + 1) * bwd_f) and row tiles r, r + R,
    # r + 2R, ... of bwd_rows rows each (R row programs). A [32, 128] tile with 8 warps is 16
    # elements per thread per input (two 16-byte loads of dg and two of h in flight per thread)
    # plus a [32, 128] fp32 accumulator, reduced over rows once at the end.
    bwd_f: int = 128
    bwd_rows: int = 32
    bwd_warps: int = 8
    # R = bwd_per_sm * SMs / column blocks: ONE wave of equal programs (no tail wave; each program
    # strides over ~N / (R * bwd_rows) tiles, counts differing by at most one). The register cap
    # maxnreg = 64K / (bwd_per_sm * bwd_warps * 32) (= 64 here) guarantees that bwd_per_sm
    # programs fit on an SM together: a kernel that took more would leave a second, nearly empty
    # wave. Measured on the H200 in CUDA-graph replays (bench/results/gelu_probe_h200_s9b.json):
    # [32, 128] x 4 per SM 62.8 / 81.9 / 106.9 us at 124M / 355M / 1.3B, the best of six tilings
    # ([16, 256] x 4: 66.4 / 85.0 / 109.8; [32, 512] x 2: 157-259); Inductor 80.1 / 105.1 / 139.4.
    bwd_per_sm: int = 4
    # dbias = the sum of the [P, F] partials: [32, 64] tiles, fixed order (P rows in steps of 32).
    sum_f: int = 64
    sum_rows: int = 32


DEFAULT_LAUNCH = Launch()

# Shapes that matter, bf16 on the H200 (bytes / 4.3 TB/s achievable; grid of the backward):
#   [12288, 3072] (124M): forward 151 MB -> 35 us, backward 226 MB -> 53 us; 12 column blocks x 44
#     row programs = 528 (~17.5 tiles each); dbias partials 44 x 3072 x 4 B = 0.54 MB, written and
#     read back once (from L2, 50 MB): ~0.3 us of traffic plus the small second kernel's launch.
#   [12288, 4096] (355M): forward 201 MB -> 47 us, backward 302 MB -> 70 us; 16 x 33 = 528.
#   [8192, 8192] (1.3B): forward 268 MB -> 62 us, backward 403 MB -> 94 us; 32 x 16 = 512.


# ---- the kernels ----------------------------------------------------------------------------

if triton is not None:
    _EXP2_A = tl.constexpr(-2.0 * GELU_C * LOG2E)  # exp(-2u) = exp2(h * (A + B h^2))
    _EXP2_B = tl.constexpr(-2.0 * GELU_C * LOG2E * GELU_A3)
    _DU_1 = tl.constexpr(2.0 * GELU_C)  # d(2u)/dh = 2 GELU_C + 6 GELU_C 0.044715 h^2
    _DU_3 = tl.constexpr(2.0 * GELU_C * 3.0 * GELU_A3)

    @triton.jit
    def _sigmoid_2u(h):
        """(s, 1 - s) for s = sigmoid(2u) = 1 / (1 + e), e = exp(-2u), in fp32: one ex2 and one
        div.full per element. 1 - s = e * s keeps full relative precision where s -> 1 (h > 2;
        `1 - s` would cancel: ~h * 2^-24 error in g'). The exponent is capped at 120 (h < -9.8,
        where g < 1e-35) so e stays finite (e * s would be inf * 0) and 1 + e stays below 2^126,
        where div.full.f32 returns 0."""
        e = tl.math.exp2(tl.minimum(h * (_EXP2_A + _EXP2_B * (h * h)), 120.0))
        s = 1.0 / (1.0 + e)
        return s, e * s

    @triton.jit
    def _gelu_fwd_kernel(H, G, n, BLOCK: tl.constexpr):
        """g = h * sigmoid(2u) over n contiguous elements; BLOCK per program."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: n may pass 2^31
        mask = offs < n
        h = tl.load(H + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        s, _ = _sigmoid_2u(h)
        tl.store(G + offs, (h * s).to(G.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_bwd_kernel(DG, H, DH, PART, N, F: tl.constexpr, BLOCK_F: tl.constexpr, ROWS: tl.constexpr):
        """dh = dg * g'(h) for columns block program_id(0) and row tiles program_id(1) + k * R;
        the fp32 column sums of this program's dh go to row program_id(1) of PART [R, F].
        F is a compile-time constant (one compile per ffn width): the row stride is then known, so
        every row segment is provably 16-byte aligned and the loads vectorize."""
        pf, pr = tl.program_id(0), tl.program_id(1)
        n_row_progs = tl.num_programs(1)
        cols = pf * BLOCK_F + tl.arange(0, BLOCK_F)
        col_ok = cols < F
        tile_rows = tl.arange(0, ROWS)
        tile_offs = tile_rows[:, None] * F + cols[None, :]  # int32 within a tile: ROWS * F < 2^31
        acc = tl.zeros([ROWS, BLOCK_F], tl.float32)  # per-thread partial sums, reduced once at the end
        for t in range(pr, tl.cdiv(N, ROWS), n_row_progs):
            row0 = t * ROWS
            base = row0.to(tl.int64) * F  # int64: N * F may pass 2^31
            mask = ((row0 + tile_rows) < N)[:, None] & col_ok[None, :]
            h = tl.load(H + base + tile_offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            dg = tl.load(DG + base + tile_offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            s, one_minus_s = _sigmoid_2u(h)
            dh = dg * s * (1.0 + h * one_minus_s * (_DU_1 + _DU_3 * (h * h)))  # masked lanes: dg = 0 -> 0
            tl.store(DH + base + tile_offs, dh.to(DH.dtype.element_ty), mask=mask)
            acc += dh
        tl.store(PART + pr * F + cols, tl.sum(acc, axis=0), mask=col_ok)

    @triton.jit
    def _sum_rows_kernel(PART, OUT, P, F: tl.constexpr, BLOCK_F: tl.constexpr, ROWS: tl.constexpr):
        """OUT[f] = sum over the P rows of PART [P, F], always in the same order (deterministic)."""
        cols = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
        col_ok = cols < F
        acc = tl.zeros([ROWS, BLOCK_F], tl.float32)
        for r0 in range(0, P, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            acc += tl.load(PART + rows[:, None] * F + cols[None, :], mask=(rows < P)[:, None] & col_ok[None, :],
                           other=0.0)
        tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)  # rounded once


# ---- launchers ------------------------------------------------------------------------------

def _on(device: torch.device):
    # launch on the tensors' GPU; a no-op for CPU tensors (Triton's interpreter in the tests)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def launch(kernel, grid: tuple[int, ...], device: torch.device, *args, **meta) -> None:
    """kernel[grid](*args, **meta) on `device`: its GPU, or Triton's interpreter for CPU tensors
    (TRITON_INTERPRET=1; launch options such as num_warps are then ignored)."""
    with _on(device):
        kernel[grid](*args, **meta)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def _register_cap(tiles: Launch) -> dict:
    """{'maxnreg': n} so that bwd_per_sm programs of bwd_warps warps share one SM's registers;
    {} when no cap is needed (over 255, the hardware's per-thread maximum)."""
    cap = REGISTERS_PER_SM // (tiles.bwd_per_sm * tiles.bwd_warps * 32) // 8 * 8
    return {"maxnreg": cap} if cap < 255 else {}


def _check_kernel_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} not in {KERNEL_DTYPES}")


def gelu_forward(h: torch.Tensor, tiles: Launch = DEFAULT_LAUNCH) -> torch.Tensor:
    """The Triton forward: g = tanh-GELU(h), h's shape and dtype, contiguous."""
    _check_kernel_dtype(h, "gelu_forward")
    h = h.contiguous()
    g = torch.empty_like(h)
    n = h.numel()
    if n:
        launch(_gelu_fwd_kernel, (triton.cdiv(n, tiles.fwd_block),), h.device, h, g, n,
               BLOCK=tiles.fwd_block, num_warps=tiles.fwd_warps)
    return g


def _check_pair(dg: torch.Tensor, h: torch.Tensor, name: str) -> int:
    if h.dim() == 0 or dg.shape != h.shape:
        raise ValueError(f"{name}: dg and h must share one shape [..., F], got {tuple(dg.shape)} and "
                         f"{tuple(h.shape)}")
    return h.shape[-1]


def row_programs(n: int, f: int, device: torch.device, tiles: Launch = DEFAULT_LAUNCH) -> int:
    """R, the backward's row programs (= rows of the dbias partials): bwd_per_sm programs per SM
    in all, at least 1, at most one per row tile."""
    col_blocks = triton.cdiv(f, tiles.bwd_f)
    return max(1, min(triton.cdiv(n, tiles.bwd_rows), tiles.bwd_per_sm * _sm_count(device) // col_blocks))


def gelu_backward(dg: torch.Tensor, h: torch.Tensor, tiles: Launch = DEFAULT_LAUNCH,
                  n_row_programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton backward: (dh in h's dtype and shape, dbias [F] in h's dtype); see the module docstring.
    n_row_programs overrides R (the tests use it to sum several partial rows on a small input)."""
    f = _check_pair(dg, h, "gelu_backward")
    _check_kernel_dtype(h, "gelu_backward")
    _check_kernel_dtype(dg, "gelu_backward")
    h2, dg2 = h.contiguous().view(-1, f), dg.contiguous().view(-1, f)
    n = h2.shape[0]
    dh = torch.empty_like(h2)
    if n == 0 or f == 0:
        return dh.view(h.shape), torch.zeros(f, dtype=h.dtype, device=h.device)
    dbias = torch.empty(f, dtype=h.dtype, device=h.device)  # every column written below: no memset
    r = n_row_programs or row_programs(n, f, h.device, tiles)
    # the main kernel stores fp32 partial sums: straight into dbias only if it is one fp32 row
    direct = r == 1 and dbias.dtype == torch.float32
    part = dbias.view(1, f) if direct else torch.empty(r, f, dtype=torch.float32, device=h.device)
    launch(_gelu_bwd_kernel, (triton.cdiv(f, tiles.bwd_f), r), h.device, dg2, h2, dh, part, n,
           F=f, BLOCK_F=tiles.bwd_f, ROWS=tiles.bwd_rows, num_warps=tiles.bwd_warps, **_register_cap(tiles))
    if not direct:
        launch(_sum_rows_kernel, (triton.cdiv(f, tiles.sum_f),), h.device, part, dbias, r,
               F=f, BLOCK_F=tiles.sum_f, ROWS=tiles.sum_rows, num_warps=4)
    return dh.view(h.shape), dbias


# ---- the plain twins ------------------------------------------------------------------------

def reference_forward(h: torch.Tensor) -> torch.Tensor:
    """ops.bias_gelu with a zero bias, in fp32, cast to h's dtype."""
    return bias_gelu(h.float(), h.new_zeros((), dtype=torch.float32)).to(h.dtype)


def gelu_grad(h: torch.Tensor) -> torch.Tensor:
    """d/dh of 0.5 h (1 + tanh(u)), u = GELU_C (h + 0.044715 h^3), written out in h's dtype:
    0.5 (1 + tanh u) + 0.5 h (1 - tanh^2 u) GELU_C (1 + 3 * 0.044715 h^2)."""
    t = torch.tanh(GELU_C * (h + GELU_A3 * h * h * h))
    return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A3 * h * h)


def reference_backward(dg: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh = dg * g'(h) computed in fp32, cast to h's dtype; dbias = fp32 column sums of that fp32 dh,
    cast to h's dtype)."""
    f = _check_pair(dg, h, "reference_backward")
    dh = dg.float() * gelu_grad(h.float())
    return dh.to(h.dtype), dh.reshape(-1, f).sum(0).to(h.dtype)


# ---- custom ops ---------------------------------------------------------------------------

def _use_kernel(*ts: torch.Tensor) -> bool:
    return triton is not None and all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in ts)


@torch.library.custom_op("hpcmeg::gelu_tanh", mutates_args=())
def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    """tanh-GELU of h (contiguous, h's dtype): the Triton kernel on CUDA, the twin elsewhere."""
    if _use_kernel(h):
        return gelu_forward(h)
    return reference_forward(h.contiguous())


@gelu_tanh.register_fake
def _(h: torch.Tensor) -> torch.Tensor:
    return h.new_empty(h.shape)  # contiguous, like both real paths


@torch.library.custom_op("hpcmeg::gelu_tanh_recompute", mutates_args=())
def gelu_tanh_recompute(h: torch.Tensor) -> torch.Tensor:
    """gelu_tanh under its own name, for a backward that recomputes the forward's GELU output
    (hpcmeg/fused/ops.py's _MLPRecomputeGelu): torch.compile's common-subexpression pass merges a second
    hpcmeg::gelu_tanh of the same h with the forward's, and then saves that output after all."""
    return gelu_forward(h) if _use_kernel(h) else reference_forward(h.contiguous())


@gelu_tanh_recompute.register_fake
def _(h: torch.Tensor) -> torch.Tensor:
    return h.new_empty(h.shape)


@torch.library.custom_op("hpcmeg::gelu_tanh_backward", mutates_args=())
def gelu_tanh_backward(dg: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh in h's dtype, dbias [F] in h's dtype) of gelu_tanh; Triton on CUDA, reference_backward elsewhere."""
    if _use_kernel(dg, h):
        return gelu_backward(dg, h)
    return tuple(t.contiguous() for t in reference_backward(dg, h))


@gelu_tanh_backward.register_fake
def _(dg: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = _check_pair(dg, h, "gelu_tanh_backward")
    return h.new_empty(h.shape), h.new_empty(f)

