"""The arithmetic of one FlatAdamW step on flat buffers: the AdamW update and the gradient norm's sum
of squares, each a plain PyTorch function (the twin, what CPU runs) and its torch.compile'd copy
(what CUDA runs: Inductor fuses each into one Triton kernel).

Owns:
  adamw_master_update_(p16, master, grad, m, v, hp): one AdamW step in place (its docstring).
  compiled_update(): torch.compile(adamw_master_update_), built once per process on first use.
  sum_of_squares_fp64(g): sum(g ** 2) in fp64.
  compiled_sum_of_squares(): torch.compile(sum_of_squares_fp64), built once per process on first use.
A hand-written update kernel cannot pay for itself: the whole update is under 2 % of a step at every
size (1.3B on an H100: the compiled update 19.7 ms of a 1005 ms step, at 2.0 TB/s of the ~3 TB/s the
card reaches; bench/results/user_path_h100_s19.md), short of the 1 % tokens/s a fast path must win.
"""
from __future__ import annotations

import functools

import torch


def adamw_master_update_(p16, master, grad, m, v, hp):
    """One AdamW step on flat 1-D buffers, in place: fp32 master/m/v from a grad of any float dtype,
    then the copy of the master into p16 (the model's bf16/fp16/fp32 parameters). hp float32 [8] =
    lr, beta1, beta2, eps, weight_decay, 1 - beta1**step, clip coefficient (grads are multiplied by
    it), sqrt(1 - beta2**step). Same math as torch.optim.AdamW (decoupled decay, bias-corrected
    moments, eps added after sqrt(v_hat)). Compiled (compiled_update) it is one Triton kernel that
    reads grad, master, m, v once and writes master, m, v, p16 once (28 bytes/param with bf16 grads;
    the unfused chain of cast + fused AdamW + copy-back is ~40)."""
    lr, b1, b2, eps, wd, bc1, coef = hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6]
    bc2_sqrt = hp[7]
    g = grad.float() * coef
    m.mul_(b1).add_(g * (1 - b1))
    v.mul_(b2).add_(g * g * (1 - b2))
    master.mul_(1 - lr * wd)
    master.sub_((lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps))
    p16.copy_(master)


@functools.cache
def compiled_update():
    # built on first use (importing Inductor costs seconds). The per-step scalars travel in the
    # hp tensor, so only a new length recompiles: the first length (the decay group, ~all the bytes)
    # gets a static kernel, the second one a dynamic-length kernel that every later length reuses
    # (the distributed optimizer updates one piece per bucket)
    return torch.compile(adamw_master_update_)


def sum_of_squares_fp64(g: torch.Tensor) -> torch.Tensor:
    """sum(g ** 2) in fp64 (an fp32 square is exact in fp64). Compiled (compiled_sum_of_squares) the
    cast fuses into the reduction: one read of g. torch.linalg.vector_norm(g, dtype=float64) first
    wrote an fp64 copy of g (8 bytes per parameter, then read again): 12.7 ms per 1.3B step on the
    H200 (bench/results/profile_h200_s10_1.3B_gbs64.md: direct_copy + NormTwoOps<double>)."""
    return g.double().square().sum()


@functools.cache
def compiled_sum_of_squares():
    return torch.compile(sum_of_squares_fp64)
