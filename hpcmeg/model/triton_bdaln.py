"""The forward of bias-dropout-add + LayerNorm as ONE Triton kernel that draws its own dropout mask,
with its plain PyTorch twin and a torch custom op.

Why: every residual branch of a layer ends with
    out = residual + dropout(x + bias),   y = LayerNorm(out)       (x [N, H] the branch's GEMM output)
(gpt.py: 24 of them per 124M micro batch). With dropout_impl 'triton' that is two kernels: the
keep-mask kernel of triton_dropout.py, writing a bool mask (1 byte per element), and Inductor's
fused add + LayerNorm kernel, reading it; the LayerNorm backward reads it again. The mask kernel is
bound by Philox's integer multiplies (13.7 us per [12288, 768] mask on the H200 with 4 draws per
call, profile_h200_s9_124M_gbs192.md), the add + LayerNorm kernel by memory (22.6 us for ~85 MB).
Here the Philox calls run inside the memory-bound kernel, where the integer units are otherwise
idle, and the mask leaves it bit-packed (1/8 of the bytes) for the backward, which
triton_layernorm.py reads directly. Traffic per element at [12288, 768] bf16: reads x, residual
2 B each, writes out, y 2 B each, + 1/8 B of bits = 75 MB against 85 MB + the mask kernel's 9.4 MB
(and the backward reads 1.2 MB of bits instead of 9.4 MB of bools). Not yet timed on the GPU:
GPTConfig.dropout_impl 'fused' selects it, bench/lease.sh's user-path stage compares it.

Math, in fp32 (as Inductor computes the plain formulation), rounded once per output:
    keep = triton_dropout's mask of (seed, the [N, H] shape, p)   (the same bits its kernel draws)
    out = residual + keep * (x + bias) * keep_scale(p)          -> stored in out's dtype
    o = out as stored (so the backward, which recomputes the statistics from out, sees the same
    values), mean and biased variance over H, y = (o - mean) * rsqrt(var + eps) * weight + ln_bias

Kernel: a program owns R rows (R = 1 at H >= 1024 ... here H = 768 also 1), as [R, BG, 8] tiles
(BG = next power of 2 >= H / 8 groups of 8 adjacent columns): each thread holds one group of 8
elements (one 16-byte bf16 vector per tensor) and makes the group's one Philox call (counter
row * H / 8 + group: triton_dropout's layout, so H % 8 == 0 is required), packs its 8 keep bits
into one byte and reduces the row statistics across the program.

Contract
  supports(x, residual, weight) -> bool: the kernel takes these (CUDA, H % 8 == 0, one dtype for x,
      residual and weight, no autocast: the GPU's bf16-parameter path); otherwise callers keep the
      separate mask.
  forward(x, bias, residual, seed, p, weight, ln_bias, eps) -> (out, y, bits): the kernel (CUDA
      tensors; CPU tensors under TRITON_INTERPRET=1 in the tests). x, residual [..., H]; bias,
      weight, ln_bias [H]; seed [1] int64 (triton_dropout.draw_seed); 0 < p < 1. out, y [..., H] in
      residual's dtype; bits uint8 [ceil(N * H / 8)] (triton_dropout.pack_bits's layout).
  reference_forward(...): the twin, plain PyTorch (triton_dropout.reference_keep_mask and the
      formula above); the op's CPU path. tests/test_triton_bdaln.py checks the kernel against it
      in Triton's interpreter (bits equal, out and y to bf16 rounding) and compiles it for sm90.
  Custom op hpcmeg::bias_dropout_add_layer_norm (torch.ops.hpcmeg.bias_dropout_add_layer_norm):
      the kernel on CUDA, the twin elsewhere; its fake gives the shapes.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from hpcmeg.model import triton_dropout

try:
    import triton
    import triton.language as tl
    from hpcmeg.model.triton_dropout import keep8
except ImportError:  # CPU-only install: the op runs the twin
    triton = tl = None

MAX_ROWS = 8             # rows per program for small H (tests), so a tile has ~1024 elements
TILE_ELEMENTS = 1024     # R * BG * 8
ELEMS_PER_THREAD = 8     # one group of 8 columns per thread: warps = R * BG / 32


def _plan(n_rows: int, h: int) -> tuple[int, int, int]:
    """(BG, R, warps) for rows of width h."""
    groups = h // 8
    bg = 1 << max(groups - 1, 0).bit_length()  # next power of 2 >= H / 8
    r = max(1, min(MAX_ROWS, TILE_ELEMENTS // (bg * 8)))
    warps = max(1, min(16, r * bg * 8 // (32 * ELEMS_PER_THREAD)))
    return bg, r, warps


if triton is not None:
    @triton.jit
    def _bdaln_fwd_kernel(X, BIAS, RES, W, LB, OUT, Y, BITS, seed_ptr, N, t, scale, eps,
                          H: tl.constexpr, BG: tl.constexpr, R: tl.constexpr):
        pid = tl.program_id(0)
        r1 = (pid * R + tl.arange(0, R)).to(tl.int64)   # [R] rows: int64, N * H may pass 2^31
        rows = r1[:, None, None]                          # [R, 1, 1]
        g = tl.arange(0, BG)[None, :, None]               # [1, BG, 1] groups of 8 columns
        col = g * 8 + tl.arange(0, 8)[None, None, :]      # [1, BG, 8]
        cm = col < H
        m = (rows < N) & cm                               # [R, BG, 8]
        offs = rows * H + col
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        res = tl.load(RES + offs, mask=m, other=0.0).to(tl.float32)
        bias = tl.load(BIAS + col, mask=cm, other=0.0).to(tl.float32)
        keep = keep8(tl.load(seed_ptr), rows * (H // 8) + g, t)  # [R, BG, 8]: one Philox call per group
        out = (res + tl.where(keep, (x + bias) * scale, 0.0)).to(OUT.dtype.element_ty)
        tl.store(OUT + offs, out, mask=m)
        o = out.to(tl.float32)
        mean = tl.sum(tl.sum(o, axis=2), axis=1) / H      # [R]; masked lanes hold 0
        oc = tl.where(m, o - mean[:, None, None], 0.0)
        var = tl.sum(tl.sum(oc * oc, axis=2), axis=1) / H  # biased, as F.layer_norm
        rstd = tl.math.rsqrt(var + eps)
        w = tl.load(W + col, mask=cm, other=0.0).to(tl.float32)
        lb = tl.load(LB + col, mask=cm, other=0.0).to(tl.float32)
        y = oc * rstd[:, None, None] * w + lb
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)
        # bit j of a group's byte = its column 8 * group + j (pack_bits's order)
        byte = tl.sum(tl.where(keep, 1 << tl.arange(0, 8)[None, None, :], 0), axis=2)  # [R, BG] int32
        g2 = tl.arange(0, BG)[None, :]
        boffs = r1[:, None] * (H // 8) + g2
        tl.store(BITS + boffs, byte.to(tl.uint8), mask=(r1[:, None] < N) & (g2 < H // 8))


def supports(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these (see the contract); otherwise the separate mask kernel."""
    return (triton is not None and x.is_cuda and x.dim() >= 1 and x.shape[-1] % 8 == 0
            and x.dtype == residual.dtype == weight.dtype and x.shape == residual.shape
            and not torch.is_autocast_enabled(x.device.type))


def _check(x, bias, residual, seed, p, weight, ln_bias) -> None:
    h = x.shape[-1] if x.dim() else 0
    problems = []
    if x.dim() < 1 or residual.shape != x.shape or h % 8:
        problems.append(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be the same [..., H] "
                        "with H % 8 == 0")
    for name, t in (("bias", bias), ("weight", weight), ("ln_bias", ln_bias)):
        if t.shape != (h,):
            problems.append(f"{name} {tuple(t.shape)} must be [H] = [{h}]")
    if seed.dtype != torch.int64 or seed.shape != (1,):
        problems.append(f"seed must be int64 [1], got {seed.dtype} {tuple(seed.shape)}")
    if not 0.0 < p < 1.0:
        problems.append(f"p must be in (0, 1), got {p}")
    if problems:
        raise ValueError("bias_dropout_add_layer_norm: " + "; ".join(problems))


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def forward(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, seed: torch.Tensor, p: float,
            weight: torch.Tensor, ln_bias: torch.Tensor, eps: float):
    """The Triton kernel: (out, y, bits), contract in the module docstring."""
    _check(x, bias, residual, seed, p, weight, ln_bias)
    h = x.shape[-1]
    x2, r2 = x.contiguous().view(-1, h), residual.contiguous().view(-1, h)
    n = x2.shape[0]
    out = torch.empty(residual.shape, dtype=residual.dtype, device=x.device)
    y = torch.empty_like(out)
    bits = torch.empty(-(-n * h // 8), dtype=torch.uint8, device=x.device)
    if n:
        bg, r, warps = _plan(n, h)
        with _on(x.device):
            _bdaln_fwd_kernel[(triton.cdiv(n, r),)](
                x2, bias.contiguous(), r2, weight.contiguous(), ln_bias.contiguous(), out, y, bits, seed, n,
                triton_dropout.threshold(p), triton_dropout.keep_scale(p), float(eps),
                H=h, BG=bg, R=r, num_warps=warps)
    return out, y, bits


def reference_forward(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, seed: torch.Tensor, p: float,
                      weight: torch.Tensor, ln_bias: torch.Tensor, eps: float):
    """The twin: (out, y, bits) from the plain formula and triton_dropout's reference mask."""
    _check(x, bias, residual, seed, p, weight, ln_bias)
    keep = triton_dropout.reference_keep_mask(seed, list(x.shape), p)
    branch = (x.float() + bias.float()) * keep * triton_dropout.keep_scale(p)
    out = (residual.float() + branch).to(residual.dtype)
    y = F.layer_norm(out.float(), (x.shape[-1],), weight.float(), ln_bias.float(), eps).to(out.dtype)
    return out, y, triton_dropout.pack_bits(keep)


@torch.library.custom_op("hpcmeg::bias_dropout_add_layer_norm", mutates_args=())
def bias_dropout_add_layer_norm(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, seed: torch.Tensor,
                                p: float, weight: torch.Tensor, ln_bias: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, y, bits); the Triton kernel on CUDA, the twin elsewhere."""
    if x.is_cuda and triton is not None:
        return forward(x, bias, residual, seed, p, weight, ln_bias, eps)
    return reference_forward(x, bias, residual, seed, p, weight, ln_bias, eps)


@bias_dropout_add_layer_norm.register_fake
def _(x, bias, residual, seed, p, weight, ln_bias, eps):
    n = math.prod(x.shape)
    return (residual.new_empty(residual.shape), residual.new_empty(residual.shape),
            x.new_empty(-(-n // 8), dtype=torch.uint8))
