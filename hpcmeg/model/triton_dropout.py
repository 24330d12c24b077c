"""Dropout keep-masks from one Philox4x32-10 call per FOUR elements, in Triton, with a bit-exact
PyTorch twin.

Why: inside the fused bias-dropout-add + LayerNorm kernel, Inductor lowers dropout as one
tl.rand per element, i.e. one full Philox4x32-10 (10 rounds) per element of which it keeps one
of the four 32-bit outputs. On the H200 at [12, 1024, 768] bf16 that made the kernel 61 us instead
of 18 us. This file draws the mask in a separate cheap kernel that uses all four outputs of each
Philox call (tl.rand4x: 4x fewer rounds) and writes a bool keep-mask (1 byte per element); the
Inductor-fused kernel then only reads it (x * keep * (1 / (1 - p))).

Contract
  dropout_keep_mask(seed [1] int64, shape list[int], p float in [0, 1]) -> keep, bool, `shape`,
    on seed.device; keep = u >= p with u ~ U[0, 1) in fp32, so P(keep) = 1 - p (p = 0 keeps all,
    p = 1 keeps none). The mask is a pure function of (seed value, shape, p): element i of the
    flattened mask is fixed by (seed, i) and p alone (see "Layout"), whatever the device, so the
    same seed gives the same mask on CUDA and on CPU. The op never reads the seed on the host
    (no .item(), no sync), so it is usable inside torch.compile(fullgraph=True) and CUDA graphs.
    It is the torch custom op hpcmeg::dropout_keep_mask (one opaque kernel for torch.compile; its
    fake only gives the shape): the Triton kernel on CUDA, `reference_keep_mask` elsewhere.
  draw_seed(device) -> [1] int64 in [0, 2**62), drawn from torch's generator of that device, so
    torch.manual_seed and the RNG states saved in checkpoints make masks reproducible and
    resumable; torch's CUDA generator is safe under CUDA graph capture (each replay a new seed).
  reference_keep_mask(seed, shape, p): the plain PyTorch twin, BIT-EXACT with the kernel (same
    Philox constants and counter layout as triton/language/random.py, same uint -> float
    conversion, same fp32 compare). tests/test_triton_dropout.py checks it against the published
    Random123 known-answer vectors and against the kernel in Triton's CPU interpreter.
  philox4x32_10(c0, c1, c2, c3, k0, k1): the raw generator on int64 tensors holding uint32 values.

Layout: program `pid` covers flat elements [pid*4*BLOCK, (pid+1)*4*BLOCK). Philox counter
  c = pid*BLOCK + j (j in [0, BLOCK)), as (c0, c1, c2, c3) = (low 32 bits of c, high 32 bits, 0, 0)
  with key (k0, k1) = (low 32 bits of seed, high 32 bits); its k-th output word (k = 0..3) gives
  element pid*4*BLOCK + k*BLOCK + j. So the mask depends on BLOCK, which both sides read from the
  module constant below: changing BLOCK changes every mask drawn from a given seed.
Triton is optional here: without it (a CPU-only install) the twin and the op's non-CUDA path work.
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: no kernel, the op runs the twin
    triton = tl = None

# Philox counters per program; each gives 4 elements, so a program writes 4 * BLOCK = 4096 bools
# (4 contiguous 1 KB runs: coalesced byte stores). With num_warps=4 (128 threads) each thread holds
# 8 counters (8 x 4 uint32 state words + the key: ~40 live registers, so no spills expected) and
# stores 8 contiguous bytes per output word. [12, 1024, 768] = 9.4M elements -> 2,304 programs,
# ~17 per SM on the 132-SM H200: enough waves that the tail does not matter. (Chosen by this
# reasoning, not yet timed on the GPU.)
BLOCK = 1024
NUM_WARPS = 4

# Philox4x32-10 constants, as in triton/language/random.py (philox_impl, 32-bit branch) and Random123
PHILOX_KEY_A = 0x9E3779B9    # key bump per round (golden ratio), word 0
PHILOX_KEY_B = 0xBB67AE85    # key bump per round (sqrt(3) - 1), word 1
PHILOX_ROUND_A = 0xD2511F53  # multiplier of counter word 0
PHILOX_ROUND_B = 0xCD9E8D57  # multiplier of counter word 2
PHILOX_ROUNDS = 10
UINT_TO_FLOAT_SCALE = 4.6566127342e-10  # triton's uint_to_uniform_float, 32-bit: < 2**-31, applied in fp32
_M32 = 0xFFFFFFFF


if triton is not None:
    @triton.jit
    def _keep_mask_kernel(seed_ptr, out_ptr, n, p, BLOCK: tl.constexpr):
        # seed_ptr: [1] int64; out_ptr: [n] bool; p: fp32 drop probability
        pid = tl.program_id(0).to(tl.int64)  # int64 counters and offsets: n >= 2**31 works
        seed = tl.load(seed_ptr)
        j = tl.arange(0, BLOCK).to(tl.int64)
        u0, u1, u2, u3 = tl.rand4x(seed, pid * BLOCK + j)  # one Philox call -> 4 x [BLOCK] fp32 in [0, 1)
        base = pid * (4 * BLOCK) + j
        tl.store(out_ptr + base, u0 >= p, mask=base < n)
        tl.store(out_ptr + base + BLOCK, u1 >= p, mask=base + BLOCK < n)
        tl.store(out_ptr + base + 2 * BLOCK, u2 >= p, mask=base + 2 * BLOCK < n)
        tl.store(out_ptr + base + 3 * BLOCK, u3 >= p, mask=base + 3 * BLOCK < n)


def _check(seed: torch.Tensor, p: float) -> None:
    if seed.dtype != torch.int64 or seed.shape != (1,):
        raise ValueError(f"dropout keep mask: seed must be an int64 tensor of shape [1], got {seed.dtype} "
                         f"{tuple(seed.shape)}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout keep mask: p must be in [0, 1], got {p}")


def keep_mask(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """The Triton launcher: bool keep-mask of `shape` on seed.device (a CUDA tensor)."""
    _check(seed, p)
    out = torch.empty(shape, dtype=torch.bool, device=seed.device)
    n = out.numel()
    if n:
        with torch.cuda.device(seed.device):
            _keep_mask_kernel[(triton.cdiv(n, 4 * BLOCK),)](seed, out, n, float(p), BLOCK=BLOCK,
                                                            num_warps=NUM_WARPS)
    return out


def _umulhi(a: torch.Tensor, b: int) -> torch.Tensor:
    # a, b in [0, 2**32): the true product is < 2**64 and wraps in int64, but the wrapped int64 bit
    # pattern equals the unsigned product mod 2**64 (two's complement), so the arithmetic shift
    # followed by & 0xFFFFFFFF extracts exactly bits 32..63, the unsigned high word.
    return ((a * b) >> 32) & _M32


def philox4x32_10(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
                  k0: torch.Tensor, k1: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding uint32 values (broadcastable): 4 output words, each in
    [0, 2**32). The round is triton's philox_impl / Random123's philox4x32round."""
    for _ in range(PHILOX_ROUNDS):
        c0, c1, c2, c3 = (_umulhi(c2, PHILOX_ROUND_B) ^ c1 ^ k0,
                          (c2 * PHILOX_ROUND_B) & _M32,
                          _umulhi(c0, PHILOX_ROUND_A) ^ c3 ^ k1,
                          (c0 * PHILOX_ROUND_A) & _M32)
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def _uniform(r: torch.Tensor) -> torch.Tensor:
    # triton's uint_to_uniform_float: x = bitcast int32; x < 0 -> -x - 1; fp32(x) * fp32(scale).
    # For r >= 2**31, x = r - 2**32 and -x - 1 = 2**32 - 1 - r = r ^ 0xFFFFFFFF, in [0, 2**31).
    x = torch.where(r >= 2**31, r ^ _M32, r)
    return x.to(torch.float32) * torch.tensor(UINT_TO_FLOAT_SCALE, dtype=torch.float32, device=r.device)


def reference_keep_mask(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """The plain PyTorch twin of `keep_mask`, bit for bit, on any device."""
    _check(seed, p)
    n = math.prod(shape)
    dev = seed.device
    n_prog = -(-n // (4 * BLOCK))
    c = torch.arange(n_prog * BLOCK, dtype=torch.int64, device=dev)  # counter pid*BLOCK + j
    s = seed.to(torch.int64)
    words = philox4x32_10(c & _M32, (c >> 32) & _M32, torch.zeros_like(c), torch.zeros_like(c),
                          s & _M32, (s >> 32) & _M32)  # (seed >> 32) & M: the logical shift's bits
    # [n_prog, 4, BLOCK]: word k of counter pid*BLOCK + j -> flat element pid*4*BLOCK + k*BLOCK + j
    u = torch.stack([_uniform(w).view(n_prog, BLOCK) for w in words], dim=1).reshape(-1)[:n]
    return (u >= torch.tensor(p, dtype=torch.float32, device=dev)).reshape(shape)


@torch.library.custom_op("hpcmeg::dropout_keep_mask", mutates_args=())
def dropout_keep_mask(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """Bool keep-mask (P(keep) = 1 - p) of `shape`; the Triton kernel on CUDA, the twin elsewhere."""
    if seed.is_cuda and triton is not None:
        return keep_mask(seed, shape, p)
    return reference_keep_mask(seed, shape, p)


@dropout_keep_mask.register_fake
def _(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bool, device=seed.device)


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """A fresh [1] int64 seed in [0, 2**62) from torch's generator of `device` (no host sync)."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
