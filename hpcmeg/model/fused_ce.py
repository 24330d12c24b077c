"""The LM head's loss, fused: per-token cross-entropy of hidden @ weight^T that never builds fp32
logits for the whole batch (fused.py's linear_cross_entropy, the fast twin of ops.py's).

Implementations (GPTConfig.fused_ce):
  * 'fused': bf16 logits, then _CrossEntropyFromLogits, whose forward is one fp32 logsumexp pass
    (+ a gather of N target logits; on CUDA with Triton the one-read kernel of triton_ce.py, else
    Inductor's lowering, 'fused_inductor' forces the latter) and whose backward writes
    softmax - onehot in ONE pass over the logits. Autograd's own backward of gather materialised a
    dense fp32 [N, V] zeros+scatter tensor (2.5 GB at 124M, micro batch 12) and read it back:
    0.53 + ~0.5 ms per step on the H200.
  * 'grad_in_forward' (the default): the forward kernel overwrites the logits with softmax - onehot,
    and the backward folds the per-token scale into the LM-head GEMMs (no backward pass over the
    logits; _LinearCEGradInForward).
  * 'compiled': the previous formulation (logsumexp - gather under plain autograd), kept for
    comparison. Eager CUDA calls of it and of 'fused' get their own torch.compile.
  * 'chunked': a custom autograd function over token chunks that keeps no logits at all
    (recomputes them in backward: ~1/3 more LM-head FLOPs, for the least memory).
  * 'backward_in_forward': 'grad_in_forward' whose forward also runs the LM head's backward GEMMs,
    chunk by chunk of tokens, with the per-token loss weights the caller will backpropagate
    (TrainStep passes its factor x loss mask as `loss_weights`); keeps G @ W [N, h] instead of
    G [N, V] (at 124M 38 MB instead of 2.47 GB per micro batch of 24; with a main-grad sink also the
    LM head's fp32 d W [V, h], 154 MB, added into the main grad in the backward), same FLOPs. The
    backward forms d hidden from the incoming gradient, so the model's backward stays in
    torch.compile's backward graph. Without loss_weights, or without grad, it is 'grad_in_forward'.
With a main-grad sink (wgrad.py; 'grad_in_forward' only) the weight's gradient is added into the
fp32 main grad by the backward's GEMM and autograd gets none (the tied word embedding sunk).
Everything here also runs on CPU in fp32 (tests/test_fused_ops.py compares it with ops.py).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hpcmeg.model import ops
from hpcmeg.model import wgrad  # noqa: F401  (registers hpcmeg::wgrad_accumulate_ and main_grad_add_)
from hpcmeg.model.ops import cross_entropy_with_lse

# Import-time fact, never mutated: whether Triton imports (then hpcmeg/model/triton_ce.py registers
# torch.ops.hpcmeg.cross_entropy_lse / cross_entropy_grad_, the one-pass CE kernels used on CUDA;
# they must be registered before torch.compile traces the model).
try:
    from hpcmeg.model import triton_ce as _triton_ce  # noqa: F401
    HAVE_TRITON_CE = True
except ImportError:  # no triton (CPU-only installs): the Inductor/eager formulation below
    HAVE_TRITON_CE = False


def _ce_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # logsumexp - target logit, both in fp32; under Inductor the .float() fuses into the reduction
    return cross_entropy_with_lse(logits, labels)[0]


class _CrossEntropyFromLogits(torch.autograd.Function):
    """Per-token CE from logits [..., V] (any float dtype) and labels [...] -> fp32 [...].

    Saves the logits (already alive for the LM-head matmul's backward), labels and the fp32
    logsumexp [...]; backward is d loss / d logits = (softmax - onehot(label)) * g, one
    elementwise pass that Inductor fuses into a single kernel (read logits, write the grad)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
        if use_triton:  # one read of the logits (hpcmeg/model/triton_ce.py)
            loss, lse = torch.ops.hpcmeg.cross_entropy_lse(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss, lse = loss.view(labels.shape), lse.view(labels.shape)
        else:
            loss, lse = cross_entropy_with_lse(logits, labels)
        ctx.save_for_backward(logits, labels, lse)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        # softmax - onehot in fp32 registers: Inductor fuses it with the scale and the cast
        return (ops.softmax_minus_onehot(logits, labels, lse) * g.unsqueeze(-1)).to(logits.dtype), None, None


def _ce_fused(logits: torch.Tensor, labels: torch.Tensor, triton: bool = True) -> torch.Tensor:
    use = triton and HAVE_TRITON_CE and logits.is_cuda
    return _CrossEntropyFromLogits.apply(logits, labels, use)


def _ce_fused_no_triton(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _ce_fused(logits, labels, triton=False)


@functools.cache
def _compiled(fn):
    """The compiled copy for eager CUDA callers, built on first use: calling torch.compile at
    import time pulls in Dynamo/Inductor (7-12 s on CPU) even for runs that never take this path.
    Inside an already-compiled model Dynamo inlines the plain function instead."""
    return torch.compile(fn)


def autocast_cast(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast to the active autocast dtype (custom autograd functions are not autocast-aware)."""
    dev = ts[0].device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return tuple(t.to(dt) for t in ts)
    return ts


def _ce_grad_(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """loss [N] fp32 of logits [N, V], which are overwritten by softmax - onehot(label)."""
    if HAVE_TRITON_CE:
        return torch.ops.hpcmeg.cross_entropy_grad_(logits, labels)
    return ops.cross_entropy_grad_(logits, labels)  # no triton: the plain twin


def _scaled(gw, g):
    """d hidden = g * (G @ W) from gw = G @ W (the operands' dtype) and g [n, 1] fp32, rounded once."""
    return (gw.float() * g).to(gw.dtype)


def _lm_head_wgrad(G, hidden, g, flat=None, offset=0):
    """d W = G^T (g * hidden) [V, h] from G = softmax - onehot [n, V] and g [n, 1] fp32; with a sink
    (flat, offset) it is added into flat by the GEMM (fp32 C, beta 1) and None comes back."""
    hg = (hidden.float() * g).to(hidden.dtype)
    if flat is not None:  # main[V, h] += G^T (g * hidden)
        torch.ops.hpcmeg.wgrad_accumulate_(flat, G, hg, offset)
        return None
    return G.t() @ hg


def _lm_head_grads(G, hidden, weight, g, flat=None, offset=0):
    """The LM head's gradients (d hidden = g * (G @ W), d W as _lm_head_wgrad gives it)."""
    return _scaled(G @ weight, g), _lm_head_wgrad(G, hidden, g, flat, offset)


class _LinearCEGradInForward(torch.autograd.Function):
    """Per-token CE of hidden @ weight^T whose logits become their own gradient in the forward.

    The loss gradient w.r.t. logit (n, v) is g_n * G[n, v] with G = softmax - onehot known in the
    forward and g [N] (the upstream per-token scale: loss mask x 1/tokens) known only in backward.
    The forward's kernel writes G over the logits (one read, one write); the backward folds g into
    the LM-head GEMMs' small operands instead of scaling [N, V]: d hidden = g * (G @ W) and
    d W = G^T @ (g * hidden). So no backward pass over [N, V]: one HBM read of the logits less than
    'fused' (whose compiled backward already reuses the logits' buffer for their gradient, so the
    peak memory is the same). Measured on the H200 at 124M's shape (bench/results/
    gpu_agreement_h200_s7_ce.json): LM head + loss fwd+bwd 4.76 ms vs 4.91 ms."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, flat=None, offset=0):  # hidden [N, h], weight [V, h], labels [N]
        logits = hidden @ weight.t()  # [N, V] in the operands' dtype
        loss = _ce_grad_(logits, labels)
        ctx.save_for_backward(logits, hidden, weight)
        ctx.flat, ctx.offset = flat, offset  # a sink (wgrad.py): d W goes into the main grad
        return loss

    @staticmethod
    def backward(ctx, g):
        G, hidden, weight = ctx.saved_tensors
        d_hidden, d_weight = _lm_head_grads(G, hidden, weight, g.reshape(-1, 1).float(), ctx.flat, ctx.offset)
        return d_hidden, d_weight, None, None, None


class _ChunkedLinearCE(torch.autograd.Function):
    """Per-token CE of hidden @ weight^T keeping only [N] fp32 logsumexps between passes."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):  # hidden [N,h], weight [V,h], labels [N]
        n = hidden.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(loss)
        for i in range(0, n, chunk):
            lf = (hidden[i:i + chunk] @ weight.t()).float()
            lse[i:i + chunk] = torch.logsumexp(lf, -1)
            loss[i:i + chunk] = lse[i:i + chunk] - lf.gather(1, labels[i:i + chunk, None]).squeeze(1)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk = ctx.chunk
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i in range(0, hidden.shape[0], chunk):
            h = hidden[i:i + chunk]
            p = ((h @ weight.t()).float() - lse[i:i + chunk, None]).exp_()  # softmax rows
            p.scatter_add_(1, labels[i:i + chunk, None],
                           torch.full_like(lse[i:i + chunk, None], -1.0))  # minus one-hot
            p = (p * grad_loss[i:i + chunk, None]).to(hidden.dtype)
            grad_h[i:i + chunk] = p @ weight
            grad_w += (p.t() @ h).float()
        return grad_h, grad_w.to(weight.dtype), None, None


class _LinearCEBackwardInForward(torch.autograd.Function):
    """_LinearCEGradInForward with its backward done in the forward, chunk by chunk of tokens.

    g [N] is d total / d loss_n, which the caller promises to backpropagate (TrainStep: its factor x
    loss mask), so each chunk's G = softmax - onehot (written over its logits) goes straight into
    G @ W and d W = G^T @ (g * hidden) (with a sink: into a local fp32 [V, h] that the backward adds
    into the main grad) and is freed: the saved state is G @ W, not [N, V]; the backward forms
    d hidden = g * (G @ W) from its incoming gradient. Same GEMMs and roundings as
    _LinearCEGradInForward, split along the tokens (d W summed per chunk)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, g, chunk: int, flat=None, offset=0):
        n = hidden.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        gw = torch.empty_like(hidden)  # G @ W per chunk: d hidden before the per-token scale
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        # With a sink, the chunks' GEMMs accumulate d W into this fp32 buffer (beta 1) and the
        # backward adds it into the main grad, and d hidden = g * (G @ W) is formed in the backward
        # from the incoming gradient (the same values: the caller promises it equals g). Why (as
        # Inductor's generated code shows on CPU): were d hidden complete in the forward, nothing of
        # the model's backward would depend on the incoming gradient, so AOTAutograd's partitioner
        # would move all of it into the forward graph, where the main grad's mutations make it
        # clone the whole buffer (0.5 GB at 124M) per micro batch, keep the clone and copy it back.
        local_sink = None if flat is None else d_weight.view(-1)
        gf = g.reshape(-1, 1).float()
        for i in range(0, n, chunk):
            h, gc = hidden[i:i + chunk], gf[i:i + chunk]
            G = h @ weight.t()  # [chunk, V], becomes softmax - onehot in place
            loss[i:i + chunk] = _ce_grad_(G, labels[i:i + chunk])
            gw[i:i + chunk] = G @ weight
            dw = _lm_head_wgrad(G, h, gc, local_sink, 0)  # None with the local sink (added there)
            if dw is not None:
                d_weight += dw.float()
        ctx.flat, ctx.offset = flat, offset
        # without a sink autograd gets d W in the weight's dtype; with one, the fp32 sum goes to flat
        ctx.save_for_backward(gw, gf, d_weight if flat is not None else d_weight.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, g_up):
        gw, gf, d_weight = ctx.saved_tensors
        if not g_up.is_cuda and not torch.compiler.is_compiling():
            # the promise, checked where it costs no device sync (CPU: the tests)
            if not torch.equal(g_up.reshape(-1, 1).float(), gf):
                raise RuntimeError("linear_cross_entropy 'backward_in_forward': the loss gradient differs from "
                                   "the loss_weights given to the forward")
        d_hidden = _scaled(gw, g_up.reshape(-1, 1).float())
        if ctx.flat is not None:
            torch.ops.hpcmeg.main_grad_add_(ctx.flat, d_weight, ctx.offset)
            d_weight = None
        return d_hidden, d_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         impl: str = "fused", chunk_tokens: int = 4096, sink=None,
                         loss_weights: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [b, s, h], weight [V, h], labels [b, s] -> per-token loss float32 [b, s]. sink (flat,
    offset), impl 'grad_in_forward' or 'backward_in_forward' only: the weight's gradient is added
    into the main grad there (wgrad.py) and autograd gets none. loss_weights [b, s] (impl
    'backward_in_forward'): d total / d loss, which the caller must backpropagate exactly."""
    if sink is not None and impl not in ("grad_in_forward", "backward_in_forward"):
        raise ValueError(f"linear_cross_entropy: a main-grad sink needs impl 'grad_in_forward' or "
                         f"'backward_in_forward', not {impl!r}")
    if impl == "backward_in_forward":
        if loss_weights is not None and torch.is_grad_enabled():
            h, w = autocast_cast(hidden, weight)
            return _LinearCEBackwardInForward.apply(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1),
                                                    loss_weights.reshape(-1), chunk_tokens,
                                                    *(sink or ())).view(labels.shape)
        impl = "grad_in_forward"  # eval, or a caller without the weights
    if sink is not None:
        h, w = autocast_cast(hidden, weight)
        return _LinearCEGradInForward.apply(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1),
                                            *sink).view(labels.shape)
    if impl == "chunked":
        h, w = autocast_cast(hidden, weight)
        loss = _ChunkedLinearCE.apply(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1), chunk_tokens)
        return loss.view(labels.shape)
    if impl == "grad_in_forward":
        h, w = autocast_cast(hidden, weight)
        return _LinearCEGradInForward.apply(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1)).view(labels.shape)
    logits = F.linear(hidden, weight)
    fn = {"fused": _ce_fused, "fused_inductor": _ce_fused_no_triton, "compiled": _ce_from_logits}[impl]
    if logits.is_cuda and not torch.compiler.is_compiling():
        return _compiled(fn)(logits, labels)
    return fn(logits, labels)
