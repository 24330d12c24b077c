"""Dropout keep-masks from one Philox4x32-10 call per EIGHT elements (16-bit thresholds), in
Triton, with a bit-exact PyTorch twin.

Why: inside the fused bias-dropout-add + LayerNorm kernel, Inductor lowers dropout as one
tl.rand per element, i.e. one full Philox4x32-10 (10 rounds) per element of which it keeps one
of the four 32-bit outputs. On the H200 at [12, 1024, 768] bf16 that made the kernel 61 us instead
of 18 us. This file draws the mask in a separate cheap kernel and writes a bool keep-mask (1 byte
per element); the Inductor-fused kernel then only reads it (x * keep * keep_scale(p)).
The kernel is bound by Philox's 32-bit multiplies, not by its 1-byte stores: using each call's four
32-bit words as four elements' uniforms, it took 13.7 us per [12, 1024, 768] mask on the H200
(profile_h200_s9_124M_gbs192.md: 25 masks per 124M micro batch, 0.34 ms, 1.4 % of it; the 9.4 MB
of stores alone are ~2.5 us). So each 32-bit Philox word gives two elements here, one per 16-bit half,
so half the Philox calls; the price is that p is applied in steps of 2**-16 (p_eff = t / 65536 with
t = round(p * 65536): 0.100006 for p = 0.1), and keep_scale(p) = 65536 / (65536 - t) keeps the
expectation exact. (The attention kernels' mask uses 8-bit thresholds, 16 per call; 16 bits keep
p_eff within 8e-6 of p at every p.)

Contract
  dropout_keep_mask(seed [1] int64, shape list[int], p float in [0, 1]) -> keep, bool, `shape`,
    on seed.device; keep = h >= t with h a uniform 16-bit integer and t = threshold(p), so
    P(keep) = 1 - t / 65536 (p = 0 keeps all, p = 1 keeps none). The mask is a pure function of
    (seed value, shape, p): element i of the flattened mask is fixed by (seed, i) and t alone (see
    "Layout"), whatever the device, so the same seed gives the same mask on CUDA and on CPU. The op
    never reads the seed on the host (no .item(), no sync), so it is usable inside
    torch.compile(fullgraph=True) and CUDA graphs. It is the torch custom op
    hpcmeg::dropout_keep_mask (one opaque kernel for torch.compile; its fake only gives the shape):
    the Triton kernel on CUDA, `reference_keep_mask` elsewhere.
  dropout_keep_bits(seed, shape, p) -> the same mask packed eight elements to a byte, uint8
    [..., H / 8] (H = shape[-1], a multiple of 8): element 8j + g of a row is bit g of byte j, so
    byte c holds exactly the eight elements of Philox counter c. 1/8 of the bool mask's memory and
    traffic: the bias-dropout-add + LayerNorm saves it for the backward (1.75 B less per hidden
    element per layer than two bool masks), its forward
    unpacks it with `unpack_bits` (tensor ops Inductor fuses) and hpcmeg/kernels/layernorm.py's backward
    reads the bits. Custom op hpcmeg::dropout_keep_bits; twin reference_keep_bits = pack_bits of
    the bool twin; pack_bits / unpack_bits convert between the two layouts.
  threshold(p) -> t = floor(p * 65536 + 0.5) in [0, 65536]; keep_scale(p) -> 65536 / (65536 - t),
    the factor of the kept values (0.0 when nothing is kept).
  draw_seed(device) -> [1] int64 in [0, 2**62), drawn from torch's generator of that device, so
    torch.manual_seed and the RNG states saved in checkpoints make masks reproducible and
    resumable; torch's CUDA generator is safe under CUDA graph capture (each replay a new seed).
  reference_keep_mask(seed, shape, p): the plain PyTorch twin, BIT-EXACT with the kernel (same
    Philox constants and counter layout as triton/language/random.py). tests/test_triton_dropout.py
    checks it against the published Random123 known-answer vectors and against the kernel in
    Triton's CPU interpreter (and compiles the kernel for sm90).
  keep8(seed, c, t): the kernel's @triton.jit building block: int64 counters c of shape [..., 1]
    -> keep [..., 8] of elements 8c .. 8c + 7.
  philox4x32_10(c0, c1, c2, c3, k0, k1): the raw generator on int64 tensors holding uint32 values.

Layout (one definition for every kernel that draws a mask from this file): element e of the
  flattened mask comes from Philox counter c = e // 8, as (c0, c1, c2, c3) = (low 32 bits of c,
  high 32 bits, 0, 0) with key (k0, k1) = (low 32 bits of seed, high 32 bits): its output word
  k = (e % 8) // 2, low 16 bits for even e, high 16 bits for odd e. So eight adjacent elements share
  one Philox call, a row of an [N, H] activation (H % 8 == 0) starts on a fresh counter, and the
  mask does not depend on how a kernel cuts the work into programs.
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

# Philox counters per program; each gives 8 adjacent elements, so a program writes 8 * BLOCK = 8192
# bools, each thread 8 contiguous bytes per counter (coalesced stores). With num_warps=4 (128
# threads) each thread holds 8 counters (8 x 4 uint32 state words + the key: ~40 live registers, so
# no spills expected). [12, 1024, 768] = 9.4M elements -> 1,152 programs, ~9 per SM on the 132-SM
# H200. (Chosen by this reasoning, not yet timed on the GPU: bench/gpu_agreement.py --parts
# dropout times it.)
BLOCK = 1024
NUM_WARPS = 4
PER_CALL = 8  # elements per Philox call: 4 output words x 2 halves
HALF = 1 << 16

# Philox4x32-10 constants, as in triton/language/random.py (philox_impl, 32-bit branch) and Random123
PHILOX_KEY_A = 0x9E3779B9    # key bump per round (golden ratio), word 0
PHILOX_KEY_B = 0xBB67AE85    # key bump per round (sqrt(3) - 1), word 1
PHILOX_ROUND_A = 0xD2511F53  # multiplier of counter word 0
PHILOX_ROUND_B = 0xCD9E8D57  # multiplier of counter word 2
PHILOX_ROUNDS = 10
_M32 = 0xFFFFFFFF
_M16 = 0xFFFF


if triton is not None:
    @triton.jit
    def keep8(seed, c, t):
        """c: int64 Philox counters [..., 1] -> keep int1 [..., 8], element 8c + g kept iff the 16-bit
        half g % 2 of output word g // 2 is >= t (t: threshold in [0, 65536])."""
        r0, r1, r2, r3 = tl.randint4x(seed, c)  # 4 x uint32, c's shape
        g = tl.arange(0, 8)
        w = tl.where(g < 4, tl.where(g < 2, r0, r1), tl.where(g < 6, r2, r3))  # [..., 8]
        half = tl.where((g & 1) == 0, w & 0xFFFF, w >> 16).to(tl.int32)  # logical shift: w is unsigned
        return half >= t

    @triton.jit
    def _keep_mask_kernel(seed_ptr, out_ptr, n, t, BLOCK: tl.constexpr):
        # seed_ptr: [1] int64; out_ptr: [n] bool; t: int32 threshold in [0, 65536]
        pid = tl.program_id(0).to(tl.int64)  # int64 counters and offsets: n >= 2**31 works
        c = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)[:, None]  # [BLOCK, 1]
        keep = keep8(tl.load(seed_ptr), c, t)  # [BLOCK, 8]
        e = c * 8 + tl.arange(0, 8)[None, :]
        tl.store(out_ptr + e, keep, mask=e < n)

    @triton.jit
    def _keep2(w, t, shift: tl.constexpr):
        # the bits of the two halves of uint32 words w, kept iff >= t (low half -> bit shift, high -> shift + 1)
        lo = ((w & 0xFFFF).to(tl.int32) >= t).to(tl.int32)
        hi = ((w >> 16).to(tl.int32) >= t).to(tl.int32)
        return (lo << shift) | (hi << (shift + 1))

    @triton.jit
    def _keep_bits_kernel(seed_ptr, out_ptr, n_bytes, t, BLOCK: tl.constexpr):
        # the same mask, packed: byte c (out_ptr: [n_bytes] uint8) holds elements 8c .. 8c + 7, i.e.
        # exactly the eight of Philox counter c (keep8's order: element 8c + g in bit g). Written on
        # 1-D [BLOCK] words, not keep8's [BLOCK, 8]: summing that tile over its 8 columns let Triton
        # pick a layout that drew each counter's Philox 8 times (sm_90 PTX: 1,154 mul.hi vs 146).
        pid = tl.program_id(0).to(tl.int64)
        c = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK] counters = byte indices
        r0, r1, r2, r3 = tl.randint4x(tl.load(seed_ptr), c)
        byte = _keep2(r0, t, 0) | _keep2(r1, t, 2) | _keep2(r2, t, 4) | _keep2(r3, t, 6)
        tl.store(out_ptr + c, byte.to(tl.uint8), mask=c < n_bytes)


def _check(seed: torch.Tensor, p: float) -> None:
    if seed.dtype != torch.int64 or seed.shape != (1,):
        raise ValueError(f"dropout keep mask: seed must be an int64 tensor of shape [1], got {seed.dtype} "
                         f"{tuple(seed.shape)}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout keep mask: p must be in [0, 1], got {p}")


def threshold(p: float) -> int:
    """t = round(p * 65536) in [0, 65536]: an element is kept iff its uniform 16-bit draw is >= t."""
    return int(math.floor(p * HALF + 0.5))


def keep_scale(p: float) -> float:
    """The factor of the kept values, 65536 / (65536 - t), so that E[keep] * keep_scale = 1 up to the
    float's rounding (0.0 when p rounds to 1 and nothing is kept)."""
    t = threshold(p)
    return HALF / (HALF - t) if t < HALF else 0.0


def keep_mask(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """The Triton launcher: bool keep-mask of `shape` on seed.device (a CUDA tensor)."""
    _check(seed, p)
    out = torch.empty(shape, dtype=torch.bool, device=seed.device)
    n = out.numel()
    if n:
        with torch.cuda.device(seed.device):
            _keep_mask_kernel[(triton.cdiv(n, PER_CALL * BLOCK),)](seed, out, n, threshold(p), BLOCK=BLOCK,
                                                                   num_warps=NUM_WARPS)
    return out


def bits_shape(shape: list[int]) -> list[int]:
    """The packed mask's shape for a mask of `shape` (last dim a multiple of 8): [..., H / 8]."""
    if not shape or shape[-1] % PER_CALL:
        raise ValueError(f"dropout keep bits: the last dim of {list(shape)} must be a multiple of {PER_CALL}")
    return [*shape[:-1], shape[-1] // PER_CALL]


def keep_bits(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """The Triton launcher of the packed mask: uint8 bits_shape(shape) on seed.device (CUDA)."""
    _check(seed, p)
    out = torch.empty(bits_shape(shape), dtype=torch.uint8, device=seed.device)
    n = out.numel()
    if n:
        with torch.cuda.device(seed.device):
            _keep_bits_kernel[(triton.cdiv(n, BLOCK),)](seed, out, n, threshold(p), BLOCK=BLOCK,
                                                       num_warps=NUM_WARPS)
    return out


def pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """bool [..., H] (H % 8 == 0) -> uint8 [..., H / 8], element 8j + g of a row in bit g of byte j."""
    shifts = torch.arange(PER_CALL, dtype=torch.uint8, device=keep.device)
    b = keep.reshape(*bits_shape(list(keep.shape)), PER_CALL).to(torch.uint8) << shifts
    return b.sum(-1, dtype=torch.uint8)  # disjoint bits: the sum is their OR


def unpack_bits(bits: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """uint8 [..., H / 8] -> bool `shape` [..., H]: pack_bits' inverse. Plain tensor ops, so under
    torch.compile Inductor fuses the shift and mask into the kernel that reads the mask."""
    shifts = torch.arange(PER_CALL, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).reshape(shape).bool()


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


def reference_keep_mask(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """The plain PyTorch twin of `keep_mask`, bit for bit, on any device."""
    _check(seed, p)
    n = math.prod(shape)
    dev = seed.device
    c = torch.arange(-(-n // PER_CALL), dtype=torch.int64, device=dev)  # counter e // 8
    s = seed.to(torch.int64)
    words = philox4x32_10(c & _M32, (c >> 32) & _M32, torch.zeros_like(c), torch.zeros_like(c),
                          s & _M32, (s >> 32) & _M32)  # (seed >> 32) & M: the logical shift's bits
    # [counters, 8]: element 8c + 2k + h is half h of word k of counter c
    h = torch.stack([x for w in words for x in (w & _M16, w >> 16)], dim=1).reshape(-1)[:n]
    return (h >= threshold(p)).reshape(shape)


@torch.library.custom_op("hpcmeg::dropout_keep_mask", mutates_args=())
def dropout_keep_mask(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """Bool keep-mask (P(keep) = 1 - p) of `shape`; the Triton kernel on CUDA, the twin elsewhere."""
    if seed.is_cuda and triton is not None:
        return keep_mask(seed, shape, p)
    return reference_keep_mask(seed, shape, p)


@dropout_keep_mask.register_fake
def _(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bool, device=seed.device)


def reference_keep_bits(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """The plain twin of `keep_bits`: the twin's bool mask, packed (bit for bit the kernel's)."""
    bits_shape(shape)
    return pack_bits(reference_keep_mask(seed, shape, p))


@torch.library.custom_op("hpcmeg::dropout_keep_bits", mutates_args=())
def dropout_keep_bits(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    """The keep-mask of `shape` packed 8 elements per byte (uint8 bits_shape(shape)): the same bits
    as dropout_keep_mask(seed, shape, p); the Triton kernel on CUDA, the twin elsewhere."""
    if seed.is_cuda and triton is not None:
        return keep_bits(seed, shape, p)
    return reference_keep_bits(seed, shape, p)


@dropout_keep_bits.register_fake
def _(seed: torch.Tensor, shape: list[int], p: float) -> torch.Tensor:
    return torch.empty(bits_shape(shape), dtype=torch.uint8, device=seed.device)


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """A fresh [1] int64 seed in [0, 2**62) from torch's generator of `device` (no host sync)."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
