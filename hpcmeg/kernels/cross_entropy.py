"""One-pass cross-entropy forward in Triton: per row, the fp32 logsumexp and the loss, reading the
bf16 logits exactly once.

Why: the loss needs a logsumexp over [N, V] logits (124M, micro batch 12: N = 12,288 tokens,
V = 50,304, 1.24 GB of bf16). Inductor lowers logsumexp as a max pass and then a sum-of-exp pass
over each row; on the H200 that kernel took 0.72 ms per step (1.7 TB/s). These kernels keep a
running (max, sum) per row (the online-softmax recurrence: s <- s * exp(m_old - m_new) +
sum(exp(x - m_new))) so each logit is read once.

Contract
  ce_forward(logits [N, V] fp32|bf16|fp16 (row stride may exceed V), labels [N] int64, 0 <= label < V)
    -> (loss [N] fp32 = lse - logits[label], lse [N] fp32)
  `cross_entropy_lse` is the same as a torch custom op (hpcmeg::cross_entropy_lse) so torch.compile
  and CUDA graphs treat it as one opaque kernel; its fake (meta) implementation only gives shapes.
  `reference(logits, labels)` is the plain PyTorch twin (tests/test_fused_ops.py compares them
  with Triton's interpreter on CPU; bench/gpu_agreement.py on the GPU).
  ce_forward_grad_(logits, labels) -> loss [N] fp32, and logits overwritten IN PLACE by the loss
  gradient softmax - onehot(label) (logits' dtype): the forward of the fused "grad_in_forward" CE (hpcmeg/fused/linear_ce.py),
  whose backward then needs no pass over [N, V] at all. Custom op hpcmeg::cross_entropy_grad_
  (mutates logits); twin reference_grad_. `cross_entropy_lse` serves the vocabulary-parallel loss
  (hpcmeg/parallel/vocab_ce.py), `cross_entropy_grad_` the single-rank LM head.
Needs the `triton` package (present wherever CUDA torch is); imported when this module is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hpcmeg.model.ops import cross_entropy_grad_ as cross_entropy_grad_twin
from hpcmeg.model.ops import cross_entropy_with_lse

BLOCK = 4096  # columns per iteration: 8 KB of bf16 per row chunk, 13 iterations for V = 50,304
# V is a compile-time constant of the kernel (one compile per vocabulary size, a handful per run);
# a run-time V also trips Triton 3.6's CPU interpreter under numpy 2 (range over a 1-element array).


@triton.jit
def _row_lse(base, V: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 logsumexp of one row, each element read once: a running max m and sum of exp(x - m)."""
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32), axis=0)
    s = m * 0.0
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)  # masked lanes: exp(-inf) = 0
        m = m_new
    return m + tl.log(s)


@triton.jit
def _ce_fwd_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, stride_row, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lse = _row_lse(base, V, BLOCK)
    label = tl.load(labels_ptr + row)
    target = tl.load(base + label).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, lse - target)


@triton.jit
def _ce_fwd_grad_kernel(logits_ptr, labels_ptr, loss_ptr, stride_row, V: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: the forward above, then a second sweep of the row that overwrites each
    logit x with softmax(x) - onehot(label) = exp(x - lse) - [col == label] in the logits' dtype:
    the loss gradient (before the per-token upstream scale), written where the logits were. The
    second sweep re-reads a row the first one just read (100 KB at V = 50,304), from L2 while the
    rows in flight fit it (0.95 ms at [12288, 50304] on the H200, 2.6 TB/s of reads + writes; a
    persistent grid, a prefetching first sweep and a reversed second one were no faster in the
    user path)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    # the target logit is read BEFORE the row's reductions: every thread reads it, and one thread's
    # second sweep overwrites it; the reductions' CTA barriers (bar.sync) order all those reads
    # before any of the sweep's writes. Read after them, a warp that reached the sweep first could
    # overwrite it under another's read: a wrong loss for that token (its gradient, from lse and
    # the label alone, unaffected). That order was seen to fail on an H100 (losses that no later
    # call repeated); tests/test_fused_ops.py checks the order in the compiled PTX.
    label = tl.load(labels_ptr + row)
    target = tl.load(base + label).to(tl.float32)
    lse = _row_lse(base, V, BLOCK)
    tl.store(loss_ptr + row, lse - target)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(c == label, 1.0, 0.0)
        tl.store(base + c, g.to(logits_ptr.dtype.element_ty), mask=c < V)


def ce_forward(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"ce_forward: logits must be [N, V] with unit column stride, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    if n:
        _ce_fwd_kernel[(n,)](logits, labels.contiguous(), loss, lse, logits.stride(0), v, BLOCK=BLOCK,
                             num_warps=8)
    return loss, lse


reference = cross_entropy_with_lse  # the plain twin: (loss, lse) in PyTorch


@torch.library.custom_op("hpcmeg::cross_entropy_lse", mutates_args=())
def cross_entropy_lse(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) of 2-D logits; the Triton kernel on CUDA, the twin elsewhere."""
    if logits.is_cuda:
        return ce_forward(logits, labels)
    return reference(logits, labels)


@cross_entropy_lse.register_fake
def _(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return out, torch.empty_like(out)


def ce_forward_grad_(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """loss [N] fp32; logits [N, V] (contiguous rows) overwritten by softmax - onehot(label)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"ce_forward_grad_: logits must be [N, V] with unit column stride, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _ce_fwd_grad_kernel[(n,)](logits, labels.contiguous(), loss, logits.stride(0), v, BLOCK=BLOCK, num_warps=8)
    return loss


reference_grad_ = cross_entropy_grad_twin  # the plain twin of ce_forward_grad_ (hpcmeg/model/ops.py)


@torch.library.custom_op("hpcmeg::cross_entropy_grad_", mutates_args=("logits",))
def cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """loss of 2-D logits, which become the loss gradient (softmax - onehot); Triton on CUDA."""
    if logits.is_cuda:
        return ce_forward_grad_(logits, labels)
    return reference_grad_(logits, labels)


@cross_entropy_grad_.register_fake
def _(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32)
