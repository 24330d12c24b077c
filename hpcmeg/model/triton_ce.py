"""One-pass cross-entropy forward in Triton: per row, the fp32 logsumexp and the loss, reading the
bf16 logits exactly once.

Why: the forward of hpcmeg.model.fused_ce._CrossEntropyFromLogits is a logsumexp over [N, V] logits
(124M, micro batch 12: N = 12,288 tokens, V = 50,304, 1.24 GB of bf16). Inductor lowers
logsumexp as a max pass and then a sum-of-exp pass over each row; on the H200 that kernel took
0.72 ms per step (1.7 TB/s). This kernel keeps a running (max, sum) per row (the online-softmax
recurrence: s <- s * exp(m_old - m_new) + sum(exp(x - m_new))) so each logit is read once.
The backward stays in Inductor (softmax - onehot, one fused elementwise pass).

Contract
  ce_forward(logits [N, V] fp32|bf16|fp16 (row stride may exceed V), labels [N] int64, 0 <= label < V)
    -> (loss [N] fp32 = lse - logits[label], lse [N] fp32)
  `cross_entropy_lse` is the same as a torch custom op (hpcmeg::cross_entropy_lse) so torch.compile
  and CUDA graphs treat it as one opaque kernel; its fake (meta) implementation only gives shapes.
  `reference(logits, labels)` is the plain PyTorch twin (tests/test_fused_ops.py compares them
  with Triton's interpreter on CPU; bench/gpu_agreement.py on the GPU).
  ce_forward_grad_(logits, labels) -> loss [N] fp32, and logits overwritten IN PLACE by the loss
  gradient softmax - onehot(label) (logits' dtype): the forward of fused.py's "grad_in_forward" CE,
  whose backward then needs no pass over [N, V] at all. Custom op hpcmeg::cross_entropy_grad_
  (mutates logits); twin reference_grad_. Its launch (CELaunch: chunk size, warps, a persistent grid,
  prefetch, a reversed second sweep) defaults to the one measured in the user path; $HPCMEG_CE_LAUNCH
  picks another for a run and bench/dev/ce_probe.py times them (every launch computes the same values;
  bit for bit at the default chunk size and warps).
Needs the `triton` package (present wherever CUDA torch is); imported when this module is.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

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
def _row_lse_prefetch(base, V: tl.constexpr, BLOCK: tl.constexpr):
    """_row_lse with each chunk's load issued one chunk ahead, before this chunk's two cross-warp
    reductions, so two chunks per program are in flight. The same arithmetic in the same order, so
    the same lse bit for bit (m starts at -inf: the first step's s * exp(m - m_new) is 0, as there)."""
    cols = tl.arange(0, BLOCK)
    x = tl.load(base + cols, mask=cols < V, other=float("-inf"))
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        c_next = start + BLOCK + cols
        x_next = tl.load(base + c_next, mask=c_next < V, other=float("-inf"))  # all masked past the row
        xf = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(xf, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(xf - m_new), axis=0)
        m = m_new
        x = x_next
    return m + tl.log(s)


@triton.jit
def _ce_fwd_grad_kernel(logits_ptr, labels_ptr, loss_ptr, stride_row, n_rows, V: tl.constexpr, BLOCK: tl.constexpr,
                        PREFETCH: tl.constexpr = False, REVERSE: tl.constexpr = False, LOOP: tl.constexpr = False):
    """The forward above, then a second sweep of the row that overwrites each logit x with
    softmax(x) - onehot(label) = exp(x - lse) - [col == label] in the logits' dtype: the loss
    gradient (before the per-token upstream scale), written where the logits were. The second
    sweep re-reads a row the first one just read (100 KB at V = 50,304), from L2 while the rows in
    flight fit it. (0.95 ms at [12288, 50304] on the H200 with one row per program, 2.6 TB/s of
    reads + writes; a persistent grid of 1-8 programs per SM was no faster, 0.97-2.1 ms, with 8
    warps and one chunk in flight: bench/results/user_path_h200_s12.md.)
    LOOP: rows pid, pid + G, ... (G programs), else one row per program. Launch knobs (CELaunch;
    bench/dev/ce_probe.py times them: on an H100 BLOCK 8192, 16 warps, PREFETCH and REVERSE ran 14 %
    under the default launch alone but +0.2 % / -0.1 % tokens/s in the 124M / 355M user path, within
    its noise, so the default stays): PREFETCH the first sweep's next chunk loaded before this one's
    reductions (_row_lse_prefetch); REVERSE the second sweep from the row's end, so the chunks the
    first sweep read last, the likeliest still in L2, are re-read first. At one BLOCK and warp count every
    setting gives the same bits (another BLOCK or warp count sums in another order)."""
    if LOOP:
        for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            _ce_fwd_grad_row(logits_ptr, labels_ptr, loss_ptr, tl.cast(r, tl.int64), stride_row, V, BLOCK,
                             PREFETCH, REVERSE)  # (tl.cast: in the interpreter r is a Python int)
    else:  # one row per program, no loop (sm90: 62 registers at 8 warps, where the loop takes 78)
        _ce_fwd_grad_row(logits_ptr, labels_ptr, loss_ptr, tl.program_id(0).to(tl.int64), stride_row, V, BLOCK,
                         PREFETCH, REVERSE)


@triton.jit
def _ce_fwd_grad_row(logits_ptr, labels_ptr, loss_ptr, row, stride_row, V: tl.constexpr, BLOCK: tl.constexpr,
                     PREFETCH: tl.constexpr, REVERSE: tl.constexpr):
    base = logits_ptr + row * stride_row
    # the target logit is read BEFORE the row's reductions: every thread reads it, and one thread's
    # second sweep overwrites it; the reductions' CTA barriers (bar.sync) order all those reads
    # before any of the sweep's writes. Read after them, a warp that reached the sweep first could
    # overwrite it under another's read: a wrong loss for that token (its gradient, from lse and
    # the label alone, unaffected). That order was seen to fail on an H100: one cold-cache call of
    # bench/dev/ce_probe.py gave losses that no later call repeated; tests/test_fused_ops.py checks
    # the order in the compiled PTX.
    label = tl.load(labels_ptr + row)
    target = tl.load(base + label).to(tl.float32)
    if PREFETCH:
        lse = _row_lse_prefetch(base, V, BLOCK)
    else:
        lse = _row_lse(base, V, BLOCK)
    tl.store(loss_ptr + row, lse - target)
    cols = tl.arange(0, BLOCK)
    NB: tl.constexpr = (V + BLOCK - 1) // BLOCK
    for i in range(0, NB):
        c = (NB - 1 - i if REVERSE else i) * BLOCK + cols
        x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(c == label, 1.0, 0.0)
        tl.store(base + c, g.to(logits_ptr.dtype.element_ty), mask=c < V)


@dataclass(frozen=True)
class CELaunch:
    """How _ce_fwd_grad_kernel is launched (bench/dev/ce_probe.py sweeps it; $HPCMEG_CE_LAUNCH, e.g.
    'block=8192,warps=16,per_sm=2,prefetch=1,reverse=1', picks one for a run). The default is the
    launch measured in the user path: one row per program, 8 warps, 4096-column chunks."""
    block: int = BLOCK       # columns per chunk (a power of 2)
    warps: int = 8
    per_sm: int = 0          # 0: one row per program; k: k programs per SM, each looping over rows
    prefetch: int = 0        # 1: the first sweep keeps two chunks in flight
    reverse: int = 0         # 1: the second sweep runs from the row's end
    programs: int = 0        # > 0: exactly this grid (tests: several rows per program)


DEFAULT_LAUNCH = CELaunch()
LAUNCH_ENV = "HPCMEG_CE_LAUNCH"


def launch_from_env() -> CELaunch:
    """DEFAULT_LAUNCH with the fields named in $HPCMEG_CE_LAUNCH (read per call, no state)."""
    spec = os.environ.get(LAUNCH_ENV, "")
    if not spec or spec == "default":
        return DEFAULT_LAUNCH
    try:
        pairs = (kv.split("=") for kv in spec.replace("+", ",").split(",") if kv)
        launch = dataclasses.replace(DEFAULT_LAUNCH, **{k: int(v) for k, v in pairs})
    except (TypeError, ValueError) as e:
        raise ValueError(f"${LAUNCH_ENV}={spec!r}: want NAME=INT,... with names from "
                         f"{[f.name for f in dataclasses.fields(CELaunch)]} ({e})") from None
    if launch.block & (launch.block - 1) or launch.block < 128:
        raise ValueError(f"${LAUNCH_ENV}={spec!r}: block must be a power of 2 >= 128")
    return launch


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


def ce_forward_grad_(logits: torch.Tensor, labels: torch.Tensor, launch: CELaunch | None = None) -> torch.Tensor:
    """loss [N] fp32; logits [N, V] (contiguous rows) overwritten by softmax - onehot(label).
    launch: None reads $HPCMEG_CE_LAUNCH (DEFAULT_LAUNCH when unset)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"ce_forward_grad_: logits must be [N, V] with unit column stride, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    launch = launch_from_env() if launch is None else launch
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        grid = launch.programs or (min(n, launch.per_sm * _sm_count(logits.device)) if launch.per_sm else n)
        _ce_fwd_grad_kernel[(grid,)](logits, labels.contiguous(), loss, logits.stride(0), n, v, BLOCK=launch.block,
                                     PREFETCH=bool(launch.prefetch), REVERSE=bool(launch.reverse), LOOP=grid < n,
                                     num_warps=launch.warps)
    return loss


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the H200's, so CPU (interpreter) runs plan like the GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


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
