"""Causal flash attention with dropout in Triton, reading q/k/v where the QKV GEMM wrote them and
writing their gradient back in that same layout; with a plain PyTorch twin.

Why (bench/results/user_path_h200_s7.md, 124M on the H200, dropout 0.1): cuDNN's SDPA forward +
backward took 5.1 ms of a 25.2 ms micro batch (~150 TFLOP/s at head dim 64, sequence 1024), plus
0.32 ms concatenating dq, dk, dv into the QKV weight's gradient layout and ~0.2 ms of GPU idle
around cuDNN's memsets. This kernel takes qkv [b, s, heads, 3 * head_dim] as the GEMM left it (no
transposes), returns the output [b, s, heads, head_dim] (a free view of [b, s, hidden]) and its
backward writes one dqkv [b, s, heads, 3 * head_dim] (no concatenation).

The algorithm (FlashAttention-2's, causal, dropout inside the kernels from a precomputed keep-bit
tensor) and its costs: hpcmeg/kernels/attention_kernels.py, which holds the kernels.

Keep-mask layout (the twin `reference_keep` builds exactly this; tests/test_triton_attention.py
checks it bit for bit in Triton's interpreter): for flat head index bh = b * heads + h, query row i
and key column j, one Philox4x32-10 call with key = seed (low, high 32 bits) and counter
(c0, c1, c2, c3) = (i * (s / 16) + j // 16, bh, 0, 0) gives 4 words = 16 bytes for 16 adjacent
columns; column j takes byte (j % 16) // 4 of word (j % 16) % 4 and is kept iff byte >= t, where
t = round(p * 256) (so p is applied in steps of 1/256: p_eff = t / 256, and the kept values are
scaled by 256 / (256 - t), which keeps the expectation exact). One Philox call per 16 elements:
per element Philox (Inductor's and tl.rand's way) would cost more than the two matmuls at head
dim 64.

Contract
  flash_attention(qkv [b, s, h, 3d] bf16|fp16|fp32 with unit last stride, seed [1] int64, p, bias=None)
      -> (out [b, s, h, d] contiguous, lse2 [b * h, s] fp32: log2-sum-exp of the scaled scores,
          bits: the keep-mask (empty without dropout or off CUDA)). bias [h * 3d]: the QKV bias that
      qkv already holds, the caller having added it in the GEMM with the bias detached; the op only
      returns its gradient, from the backward kernels' row sums, so no pass re-reads dqkv for it
      (fused.causal_attention_qkv).
  flash_attention_backward(dout, qkv, out, lse2, bits, seed, p, bias_grad=False) -> (dqkv [b, s, h, 3d]
      in qkv's dtype, dbias): with bias_grad, dbias [h * 3d] is the fp32 sum of dqkv over b and s,
      rounded once (the gradient of the bias flash_attention was given).
  Both are torch custom ops (hpcmeg::flash_attention[_backward]; the first has autograd) so
  torch.compile and CUDA graphs see one opaque kernel each; on CPU they run the twin.
  supports(qkv) says whether the kernels take the shape: s % 128 == 0, d in {16, 32, 64, 128}.
  reference(qkv, seed, p) -> out, reference_backward(dout, qkv, seed, p) -> dqkv and
  reference_bias_grad(fp32 dqkv, dtype) -> dbias: the twins,
  plain PyTorch with the same keep-mask (the ops' CPU path; the tests check reference_backward
  against autograd through reference).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

from hpcmeg.kernels.dropout import draw_seed, philox4x32_10  # noqa: F401  (seeds; the twin's generator)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the ops run the twin
    triton = tl = None

LOG2E = 1.4426950408889634
SEQ_MULTIPLE = 128  # every block size below divides it, so the kernels need no bounds masks
HEAD_DIMS = (16, 32, 64, 128)
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Launch:
    """Tile sizes and launch shapes (rows x cols of the score tile each program works on).
    The fastest of a sweep on the H200 at head dims 64 and 128 without dropout
    (bench/results/attention_probe_h200_s8a.json: 124M fwd 0.073 ms with fwd_m 64 vs 0.082 with
    128; bwd 0.221 ms with dkv_n = dq_m = 64 vs 0.277 with 128)."""
    fwd_m: int = 64   # query rows per forward program
    fwd_n: int = 64   # key columns per forward iteration
    fwd_warps: int = 4
    fwd_stages: int = 3
    dkv_n: int = 64   # key rows owned by one dK/dV program
    dkv_m: int = 32   # query rows per dK/dV iteration
    dq_m: int = 64    # query rows owned by one dQ program
    dq_n: int = 32    # key columns per dQ iteration
    bwd_warps: int = 4
    bwd_stages: int = 3
    # the keep-bits kernel (_attn_bits_kernel): tiles of bits_rows x 16 * bits_groups columns, bits_warps warps
    bits_rows: int = 64
    bits_groups: int = 8
    bits_warps: int = 4

    def __post_init__(self):
        # a loop's step must divide the block it walks (the first loop stops at the diagonal block,
        # which must start on a step boundary) and every block must divide SEQ_MULTIPLE
        for outer, inner in (("fwd_m", "fwd_n"), ("dkv_n", "dkv_m"), ("dq_m", "dq_n")):
            o, i = getattr(self, outer), getattr(self, inner)
            if o % i or SEQ_MULTIPLE % o or i < 16:
                raise ValueError(f"attention Launch: {inner}={i} must divide {outer}={o}, which must divide "
                                 f"{SEQ_MULTIPLE}, and both be >= 16")
        if SEQ_MULTIPLE % self.bits_rows or SEQ_MULTIPLE % (16 * self.bits_groups):
            raise ValueError(f"attention Launch: bits_rows={self.bits_rows} and 16 x bits_groups="
                             f"{16 * self.bits_groups} must divide {SEQ_MULTIPLE}")


DEFAULT_LAUNCH = Launch()


def dropout_threshold(p: float) -> tuple[int, float]:
    """(t, scale): keep iff random byte >= t; kept values times scale = 256 / (256 - t)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"flash_attention: dropout p must be in [0, 1), got {p}")
    t = min(int(round(p * 256)), 255)
    return t, 256.0 / (256 - t)


def supports(qkv: torch.Tensor) -> bool:
    return (qkv.dim() == 4 and qkv.shape[-1] % 3 == 0 and qkv.shape[-1] // 3 in HEAD_DIMS
            and qkv.shape[1] % SEQ_MULTIPLE == 0 and qkv.stride(-1) == 1)


# ---- the kernels (hpcmeg/kernels/attention_kernels.py) ---------------------------------

if triton is not None:
    from hpcmeg.kernels.attention_kernels import (  # noqa: F401  (the tests compile them via this module)
        _attn_bias_grad_kernel, _attn_bits_kernel, _attn_dkv_kernel, _attn_dq_kernel, _attn_fwd_kernel)


# ---- launchers ------------------------------------------------------------------------------

def _on(device: torch.device):
    # launch on the tensors' GPU; a no-op for CPU tensors (Triton's interpreter in the tests)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _shape(qkv: torch.Tensor) -> tuple[int, int, int, int]:
    if not supports(qkv):
        raise ValueError(f"flash_attention: qkv must be [b, s, heads, 3 * head_dim] with s % {SEQ_MULTIPLE} == 0, "
                         f"head_dim in {HEAD_DIMS} and unit last stride; got {tuple(qkv.shape)} strides "
                         f"{qkv.stride()}")
    b, s, h, d3 = qkv.shape
    return b, s, h, d3 // 3


def keep_bits(seed: torch.Tensor, bh: int, s: int, p: float, launch: Launch = DEFAULT_LAUNCH) -> torch.Tensor:
    """The Triton keep-mask as bits, [bh, s, s / 16] int16 (bit j % 16 of word (i, j // 16));
    words wholly right of the diagonal are left unwritten (no kernel reads them)."""
    t, _ = dropout_threshold(p)
    bits = torch.empty(bh, s, s // 16, dtype=torch.int16, device=seed.device)
    r, g = launch.bits_rows, launch.bits_groups
    with _on(seed.device):
        _attn_bits_kernel[(s // r, s // (16 * g), bh)](seed, bits, s, t, R=r, G=g, num_warps=launch.bits_warps)
    return bits


def forward(qkv: torch.Tensor, seed: torch.Tensor, p: float, launch: Launch = DEFAULT_LAUNCH):
    """The Triton forward: (out [b, s, h, d], lse2 [b * h, s] fp32, keep bits [b * h, s, s / 16]
    int16, or an empty tensor without dropout)."""
    b, s, h, d = _shape(qkv)
    t, keep_scale = dropout_threshold(p)
    out = qkv.new_empty(b, s, h, d)
    lse = torch.empty(b * h, s, dtype=torch.float32, device=qkv.device)
    bits = keep_bits(seed, b * h, s, p, launch) if t else torch.empty(0, dtype=torch.int16, device=qkv.device)
    sm_scale = 1.0 / math.sqrt(d)
    with _on(qkv.device):
        _attn_fwd_kernel[(s // launch.fwd_m, b * h)](
            qkv, out, lse, bits, *qkv.stride()[:3], *out.stride()[:3], h, s, t, keep_scale, sm_scale * LOG2E,
            D=d, BM=launch.fwd_m, BN=launch.fwd_n, DROPOUT=t > 0, num_warps=launch.fwd_warps,
            num_stages=launch.fwd_stages)
    return out, lse, bits


def backward(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, bits: torch.Tensor,
             p: float, launch: Launch = DEFAULT_LAUNCH, bias_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton backward: (dqkv [b, s, h, 3d] contiguous in qkv's dtype, dbias): with bias_grad,
    dbias [h * 3d] = the fp32 sum of dqkv over b and s (the gradient of a QKV bias added inside qkv),
    rounded once to qkv's dtype; else an empty tensor."""
    b, s, h, d = _shape(qkv)
    t, keep_scale = dropout_threshold(p)
    dout = dout.contiguous() if dout.stride() != out.stride() else dout  # dO is read with out's strides
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    if qkv.stride() != dqkv.stride():
        qkv = qkv.contiguous()  # the dK/dV and dQ kernels address qkv and dqkv with one set of strides
    delta = torch.empty(b * h, s, dtype=torch.float32, device=qkv.device)  # written by the dQ kernel
    f32 = dict(dtype=torch.float32, device=qkv.device)
    nq, nk = b * (s // launch.dq_m), b * (s // launch.dkv_n)
    pq = torch.empty(nq, h, d, **f32) if bias_grad else delta.new_empty(0)  # row-block sums of dQ
    pkv = torch.empty(nk, h, 2, d, **f32) if bias_grad else delta.new_empty(0)  # ... of dK, dV
    sm_scale = 1.0 / math.sqrt(d)
    ostr, qstr = out.stride()[:3], qkv.stride()[:3]
    with _on(qkv.device):
        tail = (*qstr, *ostr, h, s, t, keep_scale, sm_scale * LOG2E, sm_scale)
        flags = dict(DROPOUT=t > 0, BIAS_GRAD=bias_grad, num_warps=launch.bwd_warps, num_stages=launch.bwd_stages)
        # dQ first: it leaves delta for the dK/dV kernel
        _attn_dq_kernel[(s // launch.dq_m, b * h)](qkv, out, dout, lse, delta, dqkv, bits, pq, *tail,
                                                   D=d, BM=launch.dq_m, BN=launch.dq_n, **flags)
        _attn_dkv_kernel[(s // launch.dkv_n, b * h)](qkv, dout, lse, delta, dqkv, bits, pkv, *tail,
                                                     D=d, BN=launch.dkv_n, BM=launch.dkv_m, **flags)
        if not bias_grad:
            return dqkv, dqkv.new_empty(0)
        dbias = torch.empty(h * 3 * d, dtype=qkv.dtype, device=qkv.device)
        _attn_bias_grad_kernel[(h, 3)](pq, pkv, dbias, nq, nk, h, D=d, ROWS=32, num_warps=1)
    return dqkv, dbias


# ---- the plain twin -------------------------------------------------------------------------

def reference_keep(seed: torch.Tensor, bh: int, s: int, p: float) -> torch.Tensor:
    """bool [bh, s, s] keep-mask, bit for bit the kernels' (layout in the module docstring)."""
    t, _ = dropout_threshold(p)
    dev = seed.device
    i = torch.arange(s, dtype=torch.int64, device=dev).view(1, s, 1)
    j = torch.arange(s, dtype=torch.int64, device=dev).view(1, 1, s)
    c0 = (i * (s // 16) + j // 16).expand(bh, s, s)
    c1 = torch.arange(bh, dtype=torch.int64, device=dev).view(bh, 1, 1).expand(bh, s, s)
    zero = torch.zeros_like(c0)
    sd = seed.to(torch.int64).view(1, 1, 1)
    words = torch.stack(philox4x32_10(c0, c1, zero, zero, sd & _M32, (sd >> 32) & _M32))  # [4, bh, s, s]
    r = j % 16
    word = words.gather(0, (r % 4).expand(bh, s, s).unsqueeze(0)).squeeze(0)
    return ((word >> (8 * (r // 4))) & 0xFF) >= t


def reference_bits(seed: torch.Tensor, bh: int, s: int, p: float) -> torch.Tensor:
    """keep_bits' twin: reference_keep packed 16 columns to an int16 word, bit = column % 16."""
    keep = reference_keep(seed, bh, s, p).view(bh, s, s // 16, 16).to(torch.int32)
    words = (keep << torch.arange(16, dtype=torch.int32, device=seed.device)).sum(-1)
    return torch.where(words >= 2**15, words - 2**16, words).to(torch.int16)


def _reference_parts(qkv: torch.Tensor, seed: torch.Tensor, p: float):
    # fp32 q, k, v [b, h, s, d], softmax probabilities P [b, h, s, s], and Z = keep * scale (or None)
    b, s, h, d3 = qkv.shape
    q, k, v = (t.transpose(1, 2).float() for t in qkv.split(d3 // 3, dim=-1))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d3 // 3)
    causal = torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    t, keep_scale = dropout_threshold(p)
    z = reference_keep(seed, b * h, s, p).view(b, h, s, s) * keep_scale if t else None
    return q, k, v, probs, z


def reference(qkv: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """The twin: softmax in fp32, the same keep-mask and scale; out [b, s, h, d] in qkv's dtype."""
    _, _, v, probs, z = _reference_parts(qkv, seed, p)
    return ((probs if z is None else probs * z) @ v).transpose(1, 2).to(qkv.dtype)


def _reference_dqkv32(dout: torch.Tensor, qkv: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    # the backward formula of the module docstring written out in PyTorch: fp32 dqkv [b, s, h, 3d]
    q, k, v, probs, z = _reference_parts(qkv, seed, p)
    do = dout.transpose(1, 2).float()
    pz = probs if z is None else probs * z
    dp = do @ v.transpose(-1, -2)
    if z is not None:
        dp = dp * z
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))  # (dp * P).sum = dO . O, the delta term
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = ds @ k * scale, ds.transpose(-1, -2) @ q * scale, pz.transpose(-1, -2) @ do
    return torch.cat([t.transpose(1, 2) for t in (dq, dk, dv)], dim=-1)


def reference_backward(dout: torch.Tensor, qkv: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """The backward formula of the module docstring written out in PyTorch: dqkv [b, s, h, 3d]."""
    return _reference_dqkv32(dout, qkv, seed, p).to(qkv.dtype)


def reference_bias_grad(dqkv32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """backward's dbias from the fp32 dqkv: summed over b and s, [h * 3d], rounded once to dtype."""
    return dqkv32.sum((0, 1)).reshape(-1).to(dtype)


def _reference_lse2(qkv: torch.Tensor) -> torch.Tensor:
    b, s, h, d3 = qkv.shape
    d = d3 // 3
    q, k, _ = (t.transpose(1, 2).float() for t in qkv.split(d, dim=-1))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1)
    return (scores.masked_fill(causal, float("-inf")).logsumexp(-1) * LOG2E).reshape(b * h, s)


# ---- custom ops ---------------------------------------------------------------------------

def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and triton is not None


@torch.library.custom_op("hpcmeg::flash_attention", mutates_args=())
def flash_attention(qkv: torch.Tensor, seed: torch.Tensor, p: float, bias: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [b, s, h, d], lse2 [b * h, s], keep bits) of causal attention with dropout p; Triton
    on CUDA, the twins elsewhere (whose backward redraws the mask from the seed, bits unused).
    bias [h * 3d]: the QKV bias already inside qkv, which the caller kept out of qkv's autograd
    graph (x W^T + b.detach()); unused here, given so that this op's backward returns its gradient,
    the sum of dqkv over tokens, from the backward kernels' own row sums."""
    if _use_kernel(qkv):
        return forward(qkv, seed, p)
    return (reference(qkv, seed, p).contiguous(), _reference_lse2(qkv),
            torch.empty(0, dtype=torch.int16, device=qkv.device))


@flash_attention.register_fake
def _(qkv: torch.Tensor, seed: torch.Tensor, p: float, bias: Optional[torch.Tensor] = None
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, s, h, d3 = qkv.shape
    n_bits = b * h * s * (s // 16) if _use_kernel(qkv) and dropout_threshold(p)[0] else 0
    return (qkv.new_empty(b, s, h, d3 // 3), qkv.new_empty(b * h, s, dtype=torch.float32),
            qkv.new_empty(n_bits, dtype=torch.int16).view(-1, s, s // 16) if n_bits else
            qkv.new_empty(0, dtype=torch.int16))


@torch.library.custom_op("hpcmeg::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             bits: torch.Tensor, seed: torch.Tensor, p: float, bias_grad: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dqkv, dbias) of flash_attention (dbias [h * 3d] in qkv's dtype with bias_grad, else empty);
    Triton on CUDA, the twins elsewhere."""
    if _use_kernel(qkv):
        return backward(dout, qkv, out, lse, bits, p, bias_grad=bias_grad)
    g = _reference_dqkv32(dout, qkv, seed, p)
    return g.to(qkv.dtype), (reference_bias_grad(g, qkv.dtype) if bias_grad else qkv.new_empty(0))


@flash_attention_backward.register_fake
def _(dout, qkv, out, lse, bits, seed, p, bias_grad=False) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, d3 = qkv.shape
    return (torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device),
            qkv.new_empty(h * d3 if bias_grad else 0))


def _setup_context(ctx, inputs, output) -> None:
    qkv, seed, p, bias = inputs
    out, lse, bits = output
    ctx.save_for_backward(qkv, out, lse, bits, seed)
    ctx.p, ctx.bias_grad = p, bias is not None
    ctx.mark_non_differentiable(lse, bits)


def _backward(ctx, dout, _dlse, _dbits):
    qkv, out, lse, bits, seed = ctx.saved_tensors
    dqkv, dbias = flash_attention_backward(dout, qkv, out, lse, bits, seed, ctx.p, ctx.bias_grad)
    return dqkv, None, None, (dbias if ctx.bias_grad else None)


flash_attention.register_autograd(_backward, setup_context=_setup_context)
