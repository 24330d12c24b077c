"""The bias-dropout-add + LayerNorm forward as one Triton row pass (model.layernorm_impl
'triton_forward'), with its plain PyTorch twin and a torch custom op.

Why: every residual branch ends with
    out = residual + dropout(x + bias),   y = LayerNorm(out)       (out is also the residual stream)
and under torch.compile Inductor fuses that into one kernel. Up to hidden 1024 it is a persistent
reduction: each row is read once and stays in registers. Above 1024, Inductor's limit for inner
persistent reductions (torch/_inductor/choices.py), it is a looped reduction: the row is read,
reduced, then read again and normalised. On the H100 at 1.3B (hidden 2048; bench/results/
profile_h100_s19_1.3B_gbs64.md) that kernel took 92 us per [8192, 2048] call, 37 ms of a 1005 ms
step: 5.5 ps per element, against 3.6 for the persistent one at 124M's [16384, 768]. The traffic
is x and residual (2 B each), the packed keep bits (1/8 B), out and y (2 B each): 8.1 B per
element, 136 MB at [8192, 2048], ~45 us at 3 TB/s.

The kernel (_bda_ln_fwd_kernel) is one pass: a program owns a contiguous run of rows (the plan of
triton_layernorm, the backward's: BLOCK_H = next power of 2 >= H, 8 elements per thread, one row
per iteration at H >= 1024, 8 warps at H = 2048, two programs per SM), loads each row's x,
residual and keep (the next row's prefetched during this one's reductions, as in the backward),
and writes out and y. The bias and the LayerNorm's weight and bias are loaded once per program.
It computes in fp32, rounds `out` once to its dtype and normalises the ROUNDED out, the value that
the backward (triton_layernorm, which recomputes the statistics from the saved out) sees. Inductor
normalised the unrounded fp32 sum. The two differ by out's rounding, ~2^-9 relative in bf16.

Contract
  bda_layer_norm(x, bias, residual, keep, scale, weight, ln_bias, eps) -> (out, y):
      x, residual [..., H] of one dtype; bias, weight, ln_bias [H] (fp32 or x's dtype); keep None,
      bool [..., H], or uint8 [..., H / 8] packed as triton_dropout.pack_bits does (H % 8 == 0);
      scale the kept values' factor. out = residual + (x + bias) * keep * scale, y = LayerNorm(out)
      over H (biased variance, eps), both [..., H] contiguous in x's dtype. The bias is rounded to
      x's dtype first, as the plain ops do (bias.to(x.dtype)).
  reference_forward(...): the twin, the plain ops: each op in x's dtype, then F.layer_norm.
  bda_layer_norm_drawn(x, bias, residual, seed, p, weight, ln_bias, eps) -> (out, y, bits): the same
      with the keep-mask drawn inside the kernel from seed ([1] int64) and p, and written packed,
      bits = triton_dropout.dropout_keep_bits(seed, x.shape, p) bit for bit (the same Philox counter
      per 8 elements), scale = triton_dropout.keep_scale(p); H % 8 == 0. What the model runs with
      dropout_impl 'triton_bits': the separate keep-bits kernel (5.4 ms of the 1.3B
      step on the H100, profile_h100_s19_1.3B_gbs64.md, Philox-bound) goes, and its Philox calls
      (one per thread per row) run while the next row's loads are in flight. Twin
      reference_forward_drawn; custom op hpcmeg::bda_layer_norm_drawn.
  Custom op hpcmeg::bda_layer_norm (the Python object `bda_layer_norm_op`): the kernel on CUDA when
      Triton imports and x is bf16, fp16 or fp32; the twin elsewhere. Its fake gives the shapes, so
      torch.compile and CUDA graphs see one opaque call.
  tests/test_triton_bda_layernorm.py checks the kernel against the twin in Triton's interpreter
  (the drawn bits against triton_dropout's), the ops (opcheck), and the fused model with
  'triton_forward' against 'triton'.
Not yet timed on a GPU: `bench/gpu_agreement.py --parts bdaln` times the kernel (reading bits and
drawing them) against Inductor's, and bench/user_path.py's item
`hpcmeg:set=model.layernorm_impl=triton_forward` runs the model with it beside the default.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hpcmeg.model import triton_dropout, triton_layernorm
from hpcmeg.model.triton_dropout import unpack_bits
from hpcmeg.model.triton_layernorm import DEFAULT_LAUNCH, Launch, plan

triton, tl = triton_layernorm.triton, triton_layernorm.tl  # None on a CPU-only install: the op runs the twin

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:
    _load_rows = triton_layernorm._load_rows
    _keep2 = triton_dropout._keep2

    @triton.jit
    def _draw_keep(seed, KEEP, rows, row_end, thresh, H: tl.constexpr, BLOCK_H: tl.constexpr, R: tl.constexpr):
        """The keep-mask of rows `rows` drawn here, triton_dropout's layout bit for bit (byte c of
        the flat packed mask = Philox counter c = row * H / 8 + column / 8, element 8c + g in bit g):
        stored packed to KEEP (for the backward) and returned expanded, [R, BLOCK_H] int32 0/1, each
        thread's 8 adjacent elements from its own byte (the layout _load_rows gives loaded bits)."""
        c8 = tl.arange(0, BLOCK_H // 8)
        c = rows.to(tl.int64)[:, None] * (H // 8) + c8[None, :]  # [R, BLOCK_H / 8] counters
        r0, r1, r2, r3 = tl.randint4x(seed, c)
        byte = _keep2(r0, thresh, 0) | _keep2(r1, thresh, 2) | _keep2(r2, thresh, 4) | _keep2(r3, thresh, 6)
        tl.store(KEEP + c, byte.to(tl.uint8), mask=(rows < row_end)[:, None] & (c8 < H // 8)[None, :])
        return tl.reshape((byte[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1, [R, BLOCK_H])

    @triton.jit
    def _bda_ln_fwd_kernel(X, RES, KEEP, BIAS, W, B, OUT, Y, SEED, N, rows_per_prog, eps, scale, thresh,
                           H: tl.constexpr, BLOCK_H: tl.constexpr, R: tl.constexpr, HAS_KEEP: tl.constexpr,
                           KEEP_BITS: tl.constexpr, PREFETCH: tl.constexpr, DRAW: tl.constexpr):
        """Rows [pid * rows_per_prog, ...) R at a time: out = res + (x + bias) * keep * scale (fp32,
        rounded once), y = LayerNorm(rounded out) * w + b (rounded once). DRAW: the keep-mask is
        drawn here from SEED ([1] int64) and threshold `thresh` and written packed to KEEP (then
        HAS_KEEP and KEEP_BITS are off: nothing is loaded from KEEP)."""
        pid = tl.program_id(0)
        row_start = pid * rows_per_prog
        row_end = tl.minimum(row_start + rows_per_prog, N)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        # once per program; the bias rounded to x's dtype, as bias.to(x.dtype) in the plain ops
        bias = tl.load(BIAS + cols, mask=cmask, other=0.0).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        seed = tl.load(SEED) if DRAW else 0
        # _load_rows(DY, X, ...) returns (X's rows, DY's rows, -, keep): here (residual, x, -, keep)
        res_n, x_n, _, keep_n = _load_rows(X, RES, X, KEEP, row_start, row_end, cols, H, BLOCK_H, R,
                                           False, HAS_KEEP, KEEP_BITS)
        for r0 in range(row_start, row_end, R):
            res_raw, x_raw, keep_raw = res_n, x_n, keep_n
            if PREFETCH:
                res_n, x_n, _, keep_n = _load_rows(X, RES, X, KEEP, r0 + R, row_end, cols, H, BLOCK_H, R,
                                                   False, HAS_KEEP, KEEP_BITS)
            rows = r0 + tl.arange(0, R)
            m = (rows < row_end)[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
            branch = x_raw.to(tl.float32) + bias[None, :]
            if DRAW:  # Philox here, while the next rows' loads are in flight
                keep_raw = _draw_keep(seed, KEEP, rows, row_end, thresh, H, BLOCK_H, R)
            if HAS_KEEP or DRAW:
                branch = tl.where(keep_raw != 0, branch * scale, 0.0)
            out = (res_raw.to(tl.float32) + branch).to(OUT.dtype.element_ty)
            tl.store(OUT + offs, out, mask=m)
            o = tl.where(m, out.to(tl.float32), 0.0)  # masked lanes add 0 to both sums
            mean = tl.sum(o, axis=1) / H
            oc = tl.where(m, o - mean[:, None], 0.0)
            rstd = tl.math.rsqrt(tl.sum(oc * oc, axis=1) / H + eps)  # biased variance, as F.layer_norm
            y = oc * rstd[:, None] * w[None, :] + b[None, :]
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)
            if not PREFETCH:
                res_n, x_n, _, keep_n = _load_rows(X, RES, X, KEEP, r0 + R, row_end, cols, H, BLOCK_H, R,
                                                   False, HAS_KEEP, KEEP_BITS)


def _check(x, bias, residual, keep, weight, ln_bias) -> None:
    h = x.shape[-1] if x.dim() else 0
    problems = []
    if x.dim() < 1 or residual.shape != x.shape or residual.dtype != x.dtype:
        problems.append(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} "
                        f"must be the same [..., H] and dtype")
    for name, t in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        if t.shape != (h,):
            problems.append(f"{name} {tuple(t.shape)} must be [H] = [{h}]")
    problems += triton_layernorm.keep_problems(keep, x, "x")
    if problems:
        raise ValueError("bda_layer_norm: " + "; ".join(problems))


def _launch(x, bias, residual, keep, scale, weight, ln_bias, eps, launch, seed=None, thresh=0):
    # keep: the mask read (None, bool or packed), or with a seed the packed mask the kernel writes
    h = x.shape[-1]
    x2, res2 = triton_layernorm._rows(x, h), triton_layernorm._rows(residual, h)
    n = x2.shape[0]
    out, y = torch.empty_like(x2).view(x.shape), torch.empty_like(x2).view(x.shape)
    if n == 0 or h == 0:
        return out, y
    p = plan(n, h, x.device, launch)
    draw = seed is not None
    has_keep = keep is not None and not draw
    bits = has_keep and keep.dtype == torch.uint8
    if draw or not has_keep:  # the mask the kernel writes, or a placeholder it never reads
        keep2 = keep if draw else x2
    else:  # packed bits as they are, a bool mask as bytes
        keep2 = keep.contiguous() if bits else triton_layernorm._rows(keep, h).view(torch.uint8)
    with triton_layernorm._on(x.device):
        _bda_ln_fwd_kernel[(p.programs,)](
            x2, res2, keep2, bias.contiguous(), weight.contiguous(), ln_bias.contiguous(), out, y,
            seed if draw else x2, n, p.rows_per_prog, float(eps), float(scale), thresh,
            H=h, BLOCK_H=p.block_h, R=p.rows, HAS_KEEP=has_keep, KEEP_BITS=bits, PREFETCH=p.prefetch,
            DRAW=draw, num_warps=p.warps)
    return out, y


def bda_layer_norm(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, keep: torch.Tensor | None,
                   scale: float, weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                   launch: Launch = DEFAULT_LAUNCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel: (out, y), contract in the module docstring."""
    _check(x, bias, residual, keep, weight, ln_bias)
    return _launch(x, bias, residual, keep, scale, weight, ln_bias, eps, launch)


def _check_draw(x, seed, p) -> None:
    triton_dropout._check(seed, p)
    if x.dim() < 1 or x.shape[-1] % triton_dropout.PER_CALL:
        raise ValueError(f"bda_layer_norm_drawn: x's last dim ({tuple(x.shape)}) must be a multiple of "
                         f"{triton_dropout.PER_CALL} (the packed mask's bytes)")


def bda_layer_norm_drawn(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, seed: torch.Tensor, p: float,
                         weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                         launch: Launch = DEFAULT_LAUNCH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel drawing its own mask: (out, y, bits), contract in the module docstring."""
    _check(x, bias, residual, None, weight, ln_bias)
    _check_draw(x, seed, p)
    bits = torch.empty(triton_dropout.bits_shape(list(x.shape)), dtype=torch.uint8, device=x.device)
    out, y = _launch(x, bias, residual, bits, triton_dropout.keep_scale(p), weight, ln_bias, eps, launch,
                     seed=seed, thresh=triton_dropout.threshold(p))
    return out, y, bits


def reference_forward(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, keep: torch.Tensor | None,
                      scale: float, weight: torch.Tensor, ln_bias: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: the plain ops, each in x's dtype (what fused._BiasDropoutAddLayerNorm runs without
    the kernel), then F.layer_norm; (out, y) contiguous in x's dtype."""
    _check(x, bias, residual, keep, weight, ln_bias)
    branch = x + bias.to(x.dtype)
    if keep is not None:
        mask = unpack_bits(keep, list(x.shape)) if keep.dtype == torch.uint8 else keep
        branch = branch * mask * scale
    out = residual + branch
    y = F.layer_norm(out, (out.shape[-1],), weight, ln_bias, eps).to(x.dtype)
    return out.contiguous(), y.contiguous()


@torch.library.custom_op("hpcmeg::bda_layer_norm", mutates_args=())
def bda_layer_norm_op(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, keep: torch.Tensor | None,
                      scale: float, weight: torch.Tensor, ln_bias: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, y): the Triton kernel on CUDA, the twin elsewhere."""
    if x.is_cuda and triton is not None and x.dtype in _KERNEL_DTYPES:
        return bda_layer_norm(x, bias, residual, keep, scale, weight, ln_bias, eps)
    return reference_forward(x, bias, residual, keep, scale, weight, ln_bias, eps)


@bda_layer_norm_op.register_fake
def _(x, bias, residual, keep, scale, weight, ln_bias, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def reference_forward_drawn(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, seed: torch.Tensor, p: float,
                            weight: torch.Tensor, ln_bias: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of bda_layer_norm_drawn: triton_dropout's packed mask of (seed, x.shape, p), then
    reference_forward with it; (out, y, bits)."""
    _check_draw(x, seed, p)
    bits = triton_dropout.reference_keep_bits(seed, list(x.shape), p)
    out, y = reference_forward(x, bias, residual, bits, triton_dropout.keep_scale(p), weight, ln_bias, eps)
    return out, y, bits


@torch.library.custom_op("hpcmeg::bda_layer_norm_drawn", mutates_args=())
def bda_layer_norm_drawn_op(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, seed: torch.Tensor, p: float,
                            weight: torch.Tensor, ln_bias: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, y, bits): the Triton kernel on CUDA, the twin elsewhere."""
    if x.is_cuda and triton is not None and x.dtype in _KERNEL_DTYPES:
        return bda_layer_norm_drawn(x, bias, residual, seed, p, weight, ln_bias, eps)
    return reference_forward_drawn(x, bias, residual, seed, p, weight, ln_bias, eps)


@bda_layer_norm_drawn_op.register_fake
def _(x, bias, residual, seed, p, weight, ln_bias, eps):
    return (x.new_empty(x.shape), x.new_empty(x.shape),
            x.new_empty(triton_dropout.bits_shape(list(x.shape)), dtype=torch.uint8))
