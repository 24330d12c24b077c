"""LayerNorm backward in Triton, fused with the residual-gradient add and the bias-dropout-add
backward, in one pass over the rows plus a small deterministic column-sum pass; with its plain
PyTorch twin and a torch custom op.

Why: every transformer layer ends its residual branches with (forward)
    out = residual + dropout(attn + bias),   y = LayerNorm(out)      (out is also the residual stream)
and Inductor compiles the backward of that into a fused row kernel (26.5 us at [12288, 768] bf16 on
the H200) plus separate column reductions for the LN weight/bias gradients (23 us) and one for the
branch bias gradient. Everything needs ~104 MB of HBM traffic at that shape (below), ~25 us at
~4.3 TB/s; there are 25 LayerNorms per micro batch at 124M, so this is ~0.6 ms of a 25 ms micro batch.

The math (fp32 in registers; row statistics over the last dim H, recomputed from x, which is read
anyway, so no mean/rstd has to be saved or read):
    mean = mean_H(x), rstd = 1 / sqrt(mean_H((x - mean)^2) + eps), xhat = (x - mean) * rstd
    wdy = w * dy,  dln = rstd * (wdy - mean_H(wdy) - xhat * mean_H(wdy * xhat))
    dx = dln + d_res                         (d_res: the gradient reaching `out` from elsewhere)
    d_branch = dx * keep * scale             (the gradient of `attn + bias`; only with keep)
    dw = sum_rows(dy * xhat), db = sum_rows(dy), dbias = sum_rows(d_branch)    (fp32 sums of fp32)

Kernel design (one pass over the rows, no atomics, deterministic):
  * _ln_bwd_kernel: program p owns the contiguous rows [p * rows_per_prog, (p + 1) * rows_per_prog)
    and walks them R rows at a time as [R, BLOCK_H] fp32 tiles (BLOCK_H = next power of 2 >= H,
    column mask for H = 768 etc.). It writes dx (and d_branch) in dy's dtype, rounded once, and
    accumulates [BLOCK_H] fp32 partial sums of dw, db (and dbias) in registers, stored at the end
    as row p of a partials buffer [P, K * H] (K = 2, or 3 with keep). The next R rows' loads are
    issued at the top of each iteration (prefetch), so they are in flight during this iteration's
    reductions and stores. The four row sums take two cross-warp exchanges (pairs joined).
  * _sum_partials_kernel: sums the P partial rows of each column in a fixed order (one program per
    32 columns x one of the K sums), writing dw, db, dbias.
  Launch (DEFAULT_LAUNCH, `plan`): 8 tile elements per thread (one 16-byte bf16 vector per tensor
  per thread): R = 1 and 4 warps at H = 768 and 1024, R = 1 and 8 warps at H = 2048. sm_90 register
  counts (Triton 3.6's ptxas, with keep and d_res): 96 at 4 warps (5 programs would fit an SM),
  115 at 8 warps (2 fit); a 16-element-per-thread tile (R = 4 at H = 768, 8 warps) takes 224-244, so
  one program per SM. Grid: 20 resident warps per SM, i.e. 5 programs per SM at H <= 1024 (P = 647
  at N = 12288 on the H200's 132 SMs, 19 rows each) and 2 at H = 2048 (P = 256 at N = 8192, 32 rows
  each): one wave. Per SM that is 5 x 5.4 KB (H = 768: one row of dy, x, d_res at 2 B + keep at
  1 B) of prefetched loads in flight besides the current ones, about the 22-26 KB that 4.8 TB/s x
  ~600 ns of DRAM latency / 132 SMs asks for. R, warps, programs per SM and the prefetch are knobs
  of `Launch`; bench/dev/layernorm_probe.py times a few settings on the H200. Measured there in CUDA-graph
  replays (bench/results/layernorm_probe_h200_s9b.json), with keep and d_res: 37.9 / 43.4 / 55.7 us
  at 124M / 355M / 1.3B's shapes with 4 programs per SM at H <= 1024, 36.5 / 43.2 with 5; Inductor's
  compiled formulation 70.8 / 79.0 / 82.5 us.
  Traffic per element at [12288, 768] bf16 with keep and d_res: reads dy, x, d_res 2 B each + keep
  1 B, writes dx, d_branch 2 B each = 11 B x 9.44 M elements = 104 MB, ~24 us at ~4.3 TB/s; the
  partials add 4.7 MB written and read back (512 rows of 3 x 768 fp32, mostly from L2) and the
  second kernel ~2 us: ~26-28 us. Plain LN backward (reads dy, x, writes dx): 6 B x 9.44 M = 57 MB,
  ~13 us + ~2 us. [8192, 2048]: 185 MB (~43 us) and 6.3 MB of partials.

Contract
  layer_norm_backward(dy, x, weight, eps, d_res=None, keep=None, scale=1.0, bias_grad=False,
                      launch=DEFAULT_LAUNCH) -> (dx, d_branch, dw, db, dbias):
      the Triton kernels (CUDA tensors; CPU tensors under TRITON_INTERPRET=1 in the tests).
      dy, x, d_res [..., H] with any leading dims (flattened; made contiguous if they are not),
      weight [H] fp32 or the activation dtype, keep bool [..., H], or uint8 [..., H / 8] packed
      as dropout.pack_bits does (H % 8 == 0: 1/8 B per element), or None; scale the kept values'
      factor (dropout.keep_scale(p) for its masks, 1 / (1 - p) for torch's). dx, d_branch [..., H] contiguous in dy's
      dtype; dw, db, dbias [H] in weight's dtype (fp32 sums, rounded once: in the sum kernel, so
      bf16 parameters take no cast kernels, 74 per 124M micro batch otherwise). d_branch is empty (numel 0) when keep is None, and dbias too
      unless bias_grad: then dbias = sum_rows(dx) (no dropout: the branch's gradient is dx itself).
  reference_backward(dy, x, weight, eps, d_res=None, keep=None, scale=1.0, bias_grad=False): the twin,
      same outputs: aten's own LayerNorm backward in fp32 (native_layer_norm_backward, what autograd
      of F.layer_norm runs) plus the add, mask and sums written out. (Not torch.autograd itself:
      the twin is also the custom op's CPU kernel, which runs below the autograd dispatch key, where
      autograd.grad finds no graph and torch.func.vjp fails opcheck's schema check.)
      tests/test_triton_layernorm.py checks the twin against autograd through ops.layer_norm with the
      bias-dropout-add forward, and the kernels against the twin in Triton's interpreter.
  Custom op hpcmeg::layer_norm_backward(Tensor dy, Tensor x, Tensor weight, float eps, Tensor? d_res,
      Tensor? keep, float scale, bool bias_grad=False) -> (Tensor x 5), the Python object
      `layer_norm_backward_op` (torch.ops.hpcmeg.layer_norm_backward): the kernels on CUDA when
      Triton imports, the twin elsewhere; its fake gives the shapes, so torch.compile and CUDA
      graphs see one opaque call.
Triton is optional at import (CPU-only installs get the twin through the op).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from hpcmeg.kernels.dropout import unpack_bits

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the op runs the twin
    triton = tl = None

# Launch rules, from the sm_90 register counts of _ln_bwd_kernel (Triton 3.6's ptxas, bf16, with
# keep and d_res, prefetch on): at 8 tile elements per thread (one 16-byte bf16 vector per tensor)
# it takes 96 registers at H = 768 or 1024 (4 warps) and 115 at H = 2048 (8 warps); at 16 per
# thread (R = 4, 8 warps at H = 768) 224-244, so only one 8-warp program fits an SM (64 K registers).
TILE_ELEMENTS = 1024   # R * BLOCK_H by default: R = 1 at H >= 1024 (and 768), up to MAX_ROWS for small H
ELEMS_PER_THREAD = 8   # warps = R * BLOCK_H / (32 * 8), clamped to [1, MAX_WARPS]
MAX_ROWS = 8           # R cap: small H (tests) still get several rows per iteration
MAX_WARPS = 16
RESIDENT_WARPS = 20    # grid target = SMs x RESIDENT_WARPS / warps: 5 programs of 4 warps per SM at H = 768
DEFAULT_SMS = 132      # stand-in SM count off CUDA (the H200's), so CPU runs plan like the GPU
SUM_BLOCK_P, SUM_BLOCK_C = 128, 32  # the column-sum pass's tile: 128 partial rows x 32 columns


@dataclass(frozen=True)
class Launch:
    """How the row pass is cut up; 0 means the rule given per field. bench/dev/layernorm_probe.py sweeps it."""
    rows: int = 0             # R, rows per iteration; 0: TILE_ELEMENTS // BLOCK_H, clamped to [1, MAX_ROWS]
    warps: int = 0            # 0: R * BLOCK_H / (32 * ELEMS_PER_THREAD), clamped to [1, MAX_WARPS]
    programs_per_sm: int = 0  # grid target = this x SMs; 0: RESIDENT_WARPS // warps (at least 1)
    programs: int = 0         # > 0: this grid target instead (tests: force several iterations per program)
    prefetch: bool = True     # load the next R rows before this iteration's arithmetic (_ln_bwd_kernel)


DEFAULT_LAUNCH = Launch()


@dataclass(frozen=True)
class Plan:
    block_h: int        # power of 2 >= H
    rows: int           # R
    warps: int
    rows_per_prog: int  # a multiple of R, so only the last program has a ragged tail
    programs: int       # P: the grid, and the partials' row count
    prefetch: bool = True


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan(n: int, h: int, device: torch.device, launch: Launch = DEFAULT_LAUNCH) -> Plan:
    """Tile and grid for n rows of width h (the rules above; the module docstring has the numbers)."""
    block_h = 1 << max(h - 1, 0).bit_length()  # next power of 2 >= h
    rows = launch.rows or max(1, min(MAX_ROWS, TILE_ELEMENTS // block_h))
    warps = launch.warps or max(1, min(MAX_WARPS, rows * block_h // (32 * ELEMS_PER_THREAD)))
    per_sm = launch.programs_per_sm or max(1, RESIDENT_WARPS // warps)
    target = launch.programs or per_sm * _sm_count(device)
    per_prog = -(-n // target)  # ceil
    per_prog = max(rows, -(-per_prog // rows) * rows)
    return Plan(block_h, rows, warps, per_prog, max(1, -(-n // per_prog)), launch.prefetch)


# ---- the kernels ----------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _load_rows(DY, X, DRES, KEEP, r0, row_end, cols, H: tl.constexpr, BLOCK_H: tl.constexpr, R: tl.constexpr,
                   HAS_RES: tl.constexpr, HAS_KEEP: tl.constexpr, KEEP_BITS: tl.constexpr):
        """Rows r0 .. r0 + R - 1 (those < row_end) of dy, x, d_res, keep as loaded (not upcast:
        a prefetched tile waits in registers at 2 B or 1 B per element); masked lanes are 0.
        KEEP_BITS: keep is packed (element e in bit e % 8 of byte e // 8, H % 8 == 0), loaded as
        [R, BLOCK_H / 8] bytes and expanded by shifts; the reshape to [R, BLOCK_H] keeps each
        thread's 8 adjacent elements in its registers (sm_90 PTX: one 1-byte load per thread per row
        and no shared memory, where indexing the bytes as offs // 8 gave 8 loads and a shared round trip)."""
        rows = r0 + tl.arange(0, R)
        m = (rows < row_end)[:, None] & (cols < H)[None, :]
        offs = rows.to(tl.int64)[:, None] * H + cols[None, :]  # int64: N * H may pass 2^31
        x = tl.load(X + offs, mask=m, other=0.0)
        dy = tl.load(DY + offs, mask=m, other=0.0)
        res = dy  # a placeholder without HAS_RES (never read)
        if HAS_RES:
            res = tl.load(DRES + offs, mask=m, other=0.0)
        keep = m  # a placeholder without HAS_KEEP (never read)
        if HAS_KEEP:
            if KEEP_BITS:
                c8 = tl.arange(0, BLOCK_H // 8)
                m8 = (rows < row_end)[:, None] & (c8 < H // 8)[None, :]
                byte = tl.load(KEEP + rows.to(tl.int64)[:, None] * (H // 8) + c8[None, :], mask=m8, other=0)
                keep = tl.reshape((byte.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1, [R, BLOCK_H])
            else:
                keep = tl.load(KEEP + offs, mask=m, other=0)  # the bool mask as bytes
        return x, dy, res, keep

    @triton.jit
    def _ln_bwd_kernel(DY, X, W, DRES, KEEP, DX, DBR, PART, N, rows_per_prog, eps, scale,
                       H: tl.constexpr, BLOCK_H: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
                       HAS_RES: tl.constexpr, HAS_KEEP: tl.constexpr, KEEP_BITS: tl.constexpr,
                       BIAS_SUM: tl.constexpr, PREFETCH: tl.constexpr):
        """Rows [pid * rows_per_prog, ...) R at a time; dx (+ d_branch) out, dw/db(/dbias) partials
        [BLOCK_H] in registers, stored as row pid of PART [P, K * H]. PREFETCH: the next R rows'
        loads are issued before this iteration's arithmetic, so they are in flight during its
        reductions and stores: twice the bytes in flight per program, for a few more registers
        (96 instead of 79 at H = 768, 4 warps, bf16 with keep and d_res)."""
        pid = tl.program_id(0)
        row_start = pid * rows_per_prog
        row_end = tl.minimum(row_start + rows_per_prog, N)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)  # [BLOCK_H], once per program
        acc_dw = tl.zeros([BLOCK_H], tl.float32)
        acc_db = tl.zeros([BLOCK_H], tl.float32)
        acc_dbias = tl.zeros([BLOCK_H], tl.float32)
        x_n, dy_n, res_n, keep_n = _load_rows(DY, X, DRES, KEEP, row_start, row_end, cols, H, BLOCK_H, R,
                                              HAS_RES, HAS_KEEP, KEEP_BITS)
        for r0 in range(row_start, row_end, R):
            x_raw, dy_raw, res_raw, keep_raw = x_n, dy_n, res_n, keep_n
            if PREFETCH:
                x_n, dy_n, res_n, keep_n = _load_rows(DY, X, DRES, KEEP, r0 + R, row_end, cols, H, BLOCK_H, R,
                                                      HAS_RES, HAS_KEEP, KEEP_BITS)
            rows = r0 + tl.arange(0, R)
            m = (rows < row_end)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
            # masked lanes hold 0: their xhat, wdy and dy are 0 below, so they add 0 to every sum
            x = x_raw.to(tl.float32)
            dy = dy_raw.to(tl.float32)
            wdy = w[None, :] * dy
            # four row sums in two reductions over a joined [R, BLOCK_H, 2] tile: each cross-warp
            # exchange (shared memory + barrier) carries two sums; sum(wdy * xhat) is taken as
            # rstd * sum(wdy * xc), so the second pair needs only the mean
            s_x, s_wdy = tl.split(tl.sum(tl.join(x, wdy), axis=1))
            mean = s_x / H
            xc = tl.where(m, x - mean[:, None], 0.0)
            s_xx, s_wdyxc = tl.split(tl.sum(tl.join(xc * xc, wdy * xc), axis=1))
            rstd = tl.math.rsqrt(s_xx / H + eps)  # biased variance, as the forward
            xhat = xc * rstd[:, None]
            c1 = s_wdy / H                        # mean_H(wdy)
            c2 = s_wdyxc * rstd / H               # mean_H(wdy * xhat)
            dx = (wdy - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]
            acc_dw += tl.sum(dy * xhat, axis=0)
            acc_db += tl.sum(dy, axis=0)
            if HAS_RES:
                dx += res_raw.to(tl.float32)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m)
            if HAS_KEEP:
                dbr = tl.where(keep_raw != 0, dx * scale, 0.0)
                tl.store(DBR + offs, dbr.to(DBR.dtype.element_ty), mask=m)
                acc_dbias += tl.sum(dbr, axis=0)
            elif BIAS_SUM:  # no dropout: the branch's gradient is dx itself (not stored twice)
                acc_dbias += tl.sum(dx, axis=0)
            if not PREFETCH:
                x_n, dy_n, res_n, keep_n = _load_rows(DY, X, DRES, KEEP, r0 + R, row_end, cols, H, BLOCK_H, R,
                                                      HAS_RES, HAS_KEEP, KEEP_BITS)
        part = PART + pid.to(tl.int64) * (K * H) + cols
        tl.store(part, acc_dw, mask=cmask)
        tl.store(part + H, acc_db, mask=cmask)
        if BIAS_SUM:
            tl.store(part + 2 * H, acc_dbias, mask=cmask)

    @triton.jit
    def _sum_partials_kernel(PART, DW, DB, DBIAS, P, H: tl.constexpr, K: tl.constexpr,
                             BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """Column sums of PART [P, K * H] over its P rows, in a fixed order (BLOCK_P rows at a time,
        then a fixed-shape tree): program (c, k) writes columns c * BLOCK_C.. of sum k (dw, db, dbias)."""
        k = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < H
        base = PART + k * H + cols
        acc = tl.zeros([BLOCK_C], tl.float32)
        for p0 in range(0, P, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            t = tl.load(base[None, :] + ps.to(tl.int64)[:, None] * (K * H),
                        mask=(ps < P)[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(t, axis=0)
        # rounded once to the parameters' dtype here: a separate cast would be a kernel per sum
        tl.store(DW + cols, acc.to(DW.dtype.element_ty), mask=cmask & (k == 0))
        tl.store(DB + cols, acc.to(DB.dtype.element_ty), mask=cmask & (k == 1))
        tl.store(DBIAS + cols, acc.to(DBIAS.dtype.element_ty), mask=cmask & (k == 2))


# ---- launcher -------------------------------------------------------------------------------

def _on(device: torch.device):
    # launch on the tensors' GPU; a no-op for CPU tensors (Triton's interpreter in the tests)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, d_res: Optional[torch.Tensor],
           keep: Optional[torch.Tensor]) -> None:
    h = dy.shape[-1] if dy.dim() else 0
    problems = []
    if dy.dim() < 1 or x.shape != dy.shape:
        problems.append(f"dy {tuple(dy.shape)} and x {tuple(x.shape)} must be the same [..., H]")
    if weight.shape != (h,):
        problems.append(f"weight {tuple(weight.shape)} must be [H] = [{h}]")
    if d_res is not None and d_res.shape != dy.shape:
        problems.append(f"d_res {tuple(d_res.shape)} must be dy's shape {tuple(dy.shape)}")
    problems += keep_problems(keep, dy, "dy")
    if problems:
        raise ValueError("layer_norm_backward: " + "; ".join(problems))


def keep_problems(keep: Optional[torch.Tensor], like: torch.Tensor, name: str) -> list[str]:
    """What is wrong with a keep mask for rows shaped like `like` [..., H] (none: []): a bool mask of
    like's shape, or uint8 bits [..., H / 8] packed as dropout.pack_bits does."""
    h = like.shape[-1] if like.dim() else 0
    if keep is not None and keep.dtype == torch.uint8:
        if h % 8 or keep.shape != (*like.shape[:-1], h // 8):
            return [f"packed keep {tuple(keep.shape)} must be [..., H / 8] of {name}'s shape {tuple(like.shape)} "
                    f"(H a multiple of 8)"]
    elif keep is not None and (keep.shape != like.shape or keep.dtype != torch.bool):
        return [f"keep {tuple(keep.shape)} {keep.dtype} must be bool of {name}'s shape {tuple(like.shape)} "
                f"or uint8 bits [..., H / 8]"]
    return []


def _rows(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.contiguous().view(-1, h)  # [N, H]; a view when t is already contiguous


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        d_res: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                        scale: float = 1.0, bias_grad: bool = False, launch: Launch = DEFAULT_LAUNCH):
    """The Triton kernels: (dx, d_branch, dw, db, dbias), contract in the module docstring."""
    _check(dy, x, weight, d_res, keep)
    h = dy.shape[-1]
    dy2, x2 = _rows(dy, h), _rows(x, h)
    n = dy2.shape[0]
    has_keep = keep is not None
    has_bias = has_keep or bias_grad
    dev = dy.device
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dev)
    d_branch = torch.empty(dy.shape if has_keep else (0,), dtype=dy.dtype, device=dev)
    wdt = dict(dtype=weight.dtype, device=dev)  # the sums come back in the parameters' dtype
    if n == 0 or h == 0:  # sums over no rows
        return dx, d_branch, torch.zeros(h, **wdt), torch.zeros(h, **wdt), torch.zeros(h if has_bias else 0, **wdt)
    # every column of these is written by _sum_partials_kernel: no memset kernels
    dw, db, dbias = torch.empty(h, **wdt), torch.empty(h, **wdt), torch.empty(h if has_bias else 0, **wdt)
    p = plan(n, h, dev, launch)
    k = 3 if has_bias else 2
    partials = torch.empty(p.programs, k * h, dtype=torch.float32, device=dev)
    # absent optional tensors: any pointer will do, the constexpr flags compile their loads away
    res2 = _rows(d_res, h) if d_res is not None else dy2
    bits = has_keep and keep.dtype == torch.uint8
    keep2 = (keep.contiguous() if bits else _rows(keep, h).view(torch.uint8)) if has_keep else dy2
    with _on(dev):
        _ln_bwd_kernel[(p.programs,)](
            dy2, x2, weight.contiguous(), res2, keep2, dx, d_branch if has_keep else dx, partials,
            n, p.rows_per_prog, float(eps), float(scale),
            H=h, BLOCK_H=p.block_h, R=p.rows, K=k, HAS_RES=d_res is not None, HAS_KEEP=has_keep,
            KEEP_BITS=bits, BIAS_SUM=has_bias, PREFETCH=p.prefetch, num_warps=p.warps)
        _sum_partials_kernel[(triton.cdiv(h, SUM_BLOCK_C), k)](
            partials, dw, db, dbias if has_bias else dw, p.programs,
            H=h, K=k, BLOCK_P=SUM_BLOCK_P, BLOCK_C=SUM_BLOCK_C, num_warps=4)
    return dx, d_branch, dw, db, dbias


# ---- the plain twin -------------------------------------------------------------------------

def reference_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       d_res: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                       scale: float = 1.0, bias_grad: bool = False):
    """The twin: aten's LayerNorm backward in fp32 (statistics from aten's forward), then the
    residual add, the mask and the sums in fp32; outputs as layer_norm_backward's."""
    _check(dy, x, weight, d_res, keep)
    h = dy.shape[-1]
    xf, dyf = x.reshape(-1, h).float(), dy.reshape(-1, h).float()
    wf = weight.float()
    _, mean, rstd = torch.ops.aten.native_layer_norm(xf, [h], wf, torch.zeros_like(wf), eps)
    dxf, dw, db = torch.ops.aten.native_layer_norm_backward(dyf, xf, [h], mean, rstd, wf, torch.zeros_like(wf),
                                                            [True, True, True])
    if d_res is not None:
        dxf = dxf + d_res.reshape(-1, h).float()
    if keep is not None:
        if keep.dtype == torch.uint8:
            keep = unpack_bits(keep, list(dy.shape))
        dbrf = dxf * keep.reshape(-1, h) * scale
        d_branch, dbias = dbrf.to(dy.dtype).view(dy.shape), dbrf.sum(0)
    elif bias_grad:
        d_branch, dbias = dy.new_empty(0), dxf.sum(0)
    else:
        d_branch, dbias = dy.new_empty(0), torch.zeros(0, dtype=torch.float32, device=dy.device)
    return dxf.to(dy.dtype).view(dy.shape), d_branch, dw.to(weight.dtype), db.to(weight.dtype), dbias.to(weight.dtype)


# ---- custom op ------------------------------------------------------------------------------

@torch.library.custom_op("hpcmeg::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                           d_res: Optional[torch.Tensor], keep: Optional[torch.Tensor], scale: float,
                           bias_grad: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d_branch, dw, db, dbias); the Triton kernels on CUDA, the twin elsewhere."""
    if dy.is_cuda and triton is not None:
        return layer_norm_backward(dy, x, weight, eps, d_res, keep, scale, bias_grad)
    dx, d_branch, dw, db, dbias = reference_backward(dy, x, weight, eps, d_res, keep, scale, bias_grad)
    return dx.contiguous(), d_branch.contiguous(), dw, db, dbias


@layer_norm_backward_op.register_fake
def _(dy, x, weight, eps, d_res, keep, scale, bias_grad=False):
    h = dy.shape[-1]
    wdt = weight.dtype
    has_keep = keep is not None
    return (dy.new_empty(dy.shape), dy.new_empty(dy.shape if has_keep else (0,)),
            dy.new_empty(h, dtype=wdt), dy.new_empty(h, dtype=wdt),
            dy.new_empty(h if has_keep or bias_grad else 0, dtype=wdt))
