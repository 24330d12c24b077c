"""The LM head's loss, fused: per-token cross-entropy of hidden @ weight^T that never builds fp32
logits for the whole batch (hpcmeg/fused/ops.py's linear_cross_entropy, the fast twin of ops.py's).

Implementations (GPTConfig.fused_ce):
  * 'grad_in_forward' (the default): bf16 logits, which the forward's kernel (hpcmeg/kernels/cross_entropy.py's
    cross_entropy_grad_, one read and one write) overwrites with softmax - onehot; the backward folds
    the per-token scale into the LM-head GEMMs, so there is no backward pass over [tokens, vocab]
    and no fp32 [tokens, vocab] tensor (_LinearCEGradInForward).
  * 'backward_in_forward' (a memory trade-off): 'grad_in_forward' whose forward also runs the LM
    head's backward GEMMs, chunk by chunk of tokens, with the per-token loss weights the caller
    will backpropagate (TrainStep passes its factor x loss mask as `loss_weights`); keeps G @ W
    [N, h] instead of G [N, V] (at 124M 38 MB instead of 2.47 GB per micro batch of 24; with a
    main-grad sink also the LM head's fp32 d W [V, h], 154 MB, added into the main grad in the
    backward), same FLOPs. The backward forms d hidden from the incoming gradient, so the model's
    backward stays in torch.compile's backward graph. Without loss_weights, or without grad, it is
    'grad_in_forward'.
With a main-grad sink (wgrad.py) the weight's gradient is added into the fp32 main grad by the
backward's GEMM and autograd gets none (the tied word embedding sunk).
Everything here also runs on CPU in fp32 (tests/test_fused_ops.py compares it with ops.py).
"""
from __future__ import annotations

import torch

from hpcmeg.model import ops
from hpcmeg.fused import wgrad  # noqa: F401  (registers hpcmeg::wgrad_accumulate_ and main_grad_add_)

# Import-time fact, never mutated: whether Triton imports (then hpcmeg/kernels/cross_entropy.py registers
# torch.ops.hpcmeg.cross_entropy_lse / cross_entropy_grad_, the one-pass CE kernels used on CUDA;
# they must be registered before torch.compile traces the model).
try:
    from hpcmeg.kernels import cross_entropy as _cross_entropy_kernels  # noqa: F401
    HAVE_TRITON_CE = True
except ImportError:  # no triton (CPU-only installs): the Inductor/eager formulation below
    HAVE_TRITON_CE = False


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
    d W = G^T @ (g * hidden). So no backward pass over [N, V]."""

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
                         impl: str = "grad_in_forward", chunk_tokens: int = 4096, sink=None,
                         loss_weights: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [b, s, h], weight [V, h], labels [b, s] -> per-token loss float32 [b, s]. sink (flat,
    offset): the weight's gradient is added into the main grad there (wgrad.py) and autograd gets
    none. loss_weights [b, s] (impl 'backward_in_forward'): d total / d loss, which the caller must
    backpropagate exactly."""
    if impl not in ("grad_in_forward", "backward_in_forward"):
        raise ValueError(f"linear_cross_entropy: impl {impl!r}: use 'grad_in_forward' or 'backward_in_forward'")
    h, w = autocast_cast(hidden, weight)
    h, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if impl == "backward_in_forward" and loss_weights is not None and torch.is_grad_enabled():
        return _LinearCEBackwardInForward.apply(h, w, flat_labels, loss_weights.reshape(-1), chunk_tokens,
                                                *(sink or ())).view(labels.shape)
    # 'grad_in_forward', and 'backward_in_forward' in eval or for a caller without the weights
    return _LinearCEGradInForward.apply(h, w, flat_labels, *(sink or ())).view(labels.shape)
