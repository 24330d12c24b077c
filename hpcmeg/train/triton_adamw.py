"""AdamW's master-weight update as one hand-written Triton kernel (train.optimizer_kernel 'triton');
its plain twin is hpcmeg/train/optim.adamw_master_update_, which it matches op for op.

Why: the update reads the fp32 gradient, master, exp_avg and exp_avg_sq and writes the last three
plus the bf16 parameter copy: 30 bytes per parameter, 39.3 GB per 1.3B step. Inductor's compiled
twin (optim._compiled_update) took 19.7 ms of it on the H100 (bench/results/
profile_h100_s19_1.3B_gbs64.md), 2.0 TB/s of the ~3 TB/s a streaming kernel can reach there: ~6 ms
per step to gain.

The kernel: program p updates elements [p * BLOCK, (p + 1) * BLOCK) of the flat buffers, in int64
offsets (a 1.3B buffer passes 2^31 bytes). BLOCK and warps are `Launch`'s: 16 elements per thread by
default (four 16-byte fp32 vectors per tensor in flight per thread). Every byte is touched once, so
the loads are marked evict_first (they should not push reusable lines out of L2).
The per-step scalars come in the hp tensor (optim.adamw_master_update_'s layout), read by every
program (32 bytes, L2 hits): no recompilation and no host sync when the LR or step changes.
It is launched with fp-fusion off (each multiply and add rounds, as the eager twin's CUDA kernels
do) and divides and takes square roots IEEE-rounded (div_rn, sqrt_rn; Triton's `/` is the 2-ulp
div.full), so on the GPU it should give the eager twin's fp32 results to the bit, which
`bench/gpu_agreement.py --parts adamw` counts (Inductor's compiled twin divides with div.full). In
Triton's interpreter the moments match the CPU twin to the bit, and the masters match the twin's
operations IEEE-rounded to the bit; the CPU twin's own fp32 square root (MKL's) may be an ulp off
on some CPUs (tests/test_triton_adamw.py says which and what that allows). The memory-bound kernel loses nothing by the rounding.
Pieces whose length is a multiple of 16 (the buffer's are: multiples of 64) get 16-byte vector
accesses; other lengths work with narrower ones.

Contract
  adamw_update_(p16, master, grad, m, v, hp, launch=DEFAULT_LAUNCH): in place, the same arguments
      as optim.adamw_master_update_ (flat 1-D tensors of one length on one device; master, m, v
      fp32; grad any float dtype; p16 bf16, fp16 or fp32; hp float32 [8]); CUDA tensors, or CPU
      tensors under TRITON_INTERPRET=1 (the tests).
  available(t): Triton imports and t is on CUDA (or the interpreter is on).
Triton is optional at import: FlatAdamW falls back to the compiled or plain update without it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: FlatAdamW uses another update
    triton = tl = None


@dataclass(frozen=True)
class Launch:
    """Elements per program and warps (bench/gpu_agreement.py --parts adamw times a few)."""
    block: int = 4096
    warps: int = 8

    def __post_init__(self):
        if self.block < 128 or self.block & (self.block - 1) or self.warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"triton_adamw.Launch: block={self.block} must be a power of 2 >= 128, "
                             f"warps={self.warps} a power of 2 <= 32")


DEFAULT_LAUNCH = Launch()


if triton is not None:
    @triton.jit
    def _adamw_kernel(P16, MASTER, GRAD, M, V, HP, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        lr = tl.load(HP)
        b1 = tl.load(HP + 1)
        b2 = tl.load(HP + 2)
        eps = tl.load(HP + 3)
        wd = tl.load(HP + 4)
        bc1 = tl.load(HP + 5)
        coef = tl.load(HP + 6)
        bc2_sqrt = tl.load(HP + 7)
        g = tl.load(GRAD + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32) * coef
        m = tl.load(M + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        v = tl.load(V + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        w = tl.load(MASTER + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        # the twin's expressions in its order: m.mul_(b1).add_(g * (1 - b1)), and so on
        m = m * b1 + g * (1 - b1)
        v = v * b2 + g * g * (1 - b2)
        w = w * (1 - lr * wd)
        # div_rn: Triton's `/` is div.full.f32 (2 ulp) in the PTX; torch divides IEEE-rounded
        w = w - tl.math.div_rn((tl.math.div_rn(lr, bc1) * m), tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
        tl.store(MASTER + offs, w, mask=mask)
        tl.store(P16 + offs, w.to(P16.dtype.element_ty), mask=mask)


def available(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def adamw_update_(p16: torch.Tensor, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                  hp: torch.Tensor, launch: Launch = DEFAULT_LAUNCH) -> None:
    n = master.numel()
    for name, t in (("p16", p16), ("grad", grad), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.numel() != n or t.dim() != 1 or t.stride(0) != 1:
            raise ValueError(f"adamw_update_: {name} must be flat and contiguous with master's {n} elements, "
                             f"got shape {tuple(t.shape)} stride {t.stride()}")
    if master.dtype != torch.float32 or m.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError("adamw_update_: master, exp_avg and exp_avg_sq must be fp32")
    if n == 0:
        return
    grid = (triton.cdiv(n, launch.block),)
    _adamw_kernel[grid](p16, master, grad, m, v, hp, n, BLOCK=launch.block, num_warps=launch.warps,
                        enable_fp_fusion=False)
