"""Fast versions of the ops in hpcmeg/model/ops.py (same names, same contracts).

What "fused" means here, op by op:
  * attention: flash-attn's `flash_attn_func` when the package imports (no transposes, [b,s,h,d]
    in and out), else PyTorch SDPA with a backend priority list (cuDNN > flash > mem-efficient
    > math by default: on Hopper cuDNN's kernel is the fastest SDPA backend; the list falls
    through when a backend refuses the inputs, e.g. dropout or CPU tensors).
  * dropout (embedding output, residual branches): on CUDA a keep-mask from the Philox kernel of
    dropout_kernel.py (8 draws of 16 bits per Philox call; Inductor's own lowering draws one per
    element inside the fused kernel, which made the bias-dropout-add+LN kernel 61 us instead of
    18 us at 124M on the H200), the scaling fused by Inductor; the residual branches' masks, which
    the bias-dropout-add + LayerNorm saves for its backward, packed 8 to a byte. Attention dropout
    stays inside the attention kernel.
  * layer_norm / bias_dropout_add(_layer_norm): the forwards are one expression each on the native
    kernels (F.layer_norm), which Inductor fuses under torch.compile with the neighbouring residual
    adds, dropout scaling and casts. Their backward is ONE pass of hpcmeg/kernels/layernorm.py
    per LayerNorm: dx with the residual-gradient add and the dropout mask, and the partial sums of
    dw, db and the branch bias gradient (model.py ends both residual branches of a layer with
    bias_dropout_add_layer_norm: the MLP's with the next layer's input LayerNorm or the final one,
    so the only plain layer_norm is layer 0's), where Inductor ran a fused kernel and then column
    reductions re-reading its inputs (in CUDA-graph replays on the H200 at 124M's shape: 37.9 vs
    70.8 us; bench/results/layernorm_probe_h200_s9b.json).
  * linear layers (here and in model.py) go through hpcmeg/fused/wgrad.py's `linear`: F.linear, or
    with a main-grad sink attached from outside (gradient-accumulation fusion) a linear whose
    weight-gradient GEMM accumulates into the fp32 main grad itself.
  * linear_bias_gelu: the bias goes INTO the matmul (the GEMM's bias epilogue), then tanh-GELU.
    Measured on the H200 (bench/results/profile_h200_s3a.md): with the bias add left to
    Inductor, the backward recomputed GELU' in two kernels (141 us/layer at 124M) where
    addmm + GELU needs 83 us. The GELU forward and the backward with the bias gradient are
    hpcmeg/kernels/gelu.py's kernels (exp2-based; 38.5 + 62.8 us vs Inductor's libdevice-tanh
    45.6 + 80.1 us at 124M, bench/results/gelu_probe_h200_s9b.json).
  * With the LayerNorm and GELU kernels against Inductor's (bench/results/user_path_s9b_124M_kernels.md,
    124M user path, one call): 494.6K vs 482.7K tokens/s (+2.5 %).
  * linear_cross_entropy: hpcmeg/fused/linear_ce.py (never builds fp32 logits for the whole batch).

Everything here also runs on CPU in fp32 (tests compare it against ops.py within 1e-5).
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hpcmeg.fused import wgrad
from hpcmeg.fused.linear_ce import HAVE_TRITON_CE, autocast_cast, linear_cross_entropy  # noqa: F401  (the op set)

# the custom ops these register (torch.ops.hpcmeg.flash_attention, .layer_norm_backward,
# .gelu_tanh(_backward), .dropout_keep_mask/_bits) must exist before
# torch.compile traces the model; their CPU paths are the plain twins, so no triton needed
from hpcmeg.kernels import attention as attention_kernel, dropout as dropout_kernel
from hpcmeg.kernels import gelu, layernorm  # noqa: F401

# Import-time facts, never mutated: whether the flash-attn package exists, and whether Triton
# imports (then the keep-mask op runs its kernel on CUDA).
HAVE_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
HAVE_TRITON_DROPOUT = dropout_kernel.triton is not None

_SDPA_ORDER = {
    "auto": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    "cudnn": (SDPBackend.CUDNN_ATTENTION,),
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "flash_attn": (SDPBackend.FLASH_ATTENTION,),  # fallback when the package is missing
    "efficient": (SDPBackend.EFFICIENT_ATTENTION,),
    "math": (SDPBackend.MATH,),
}


class _LayerNorm(torch.autograd.Function):
    """F.layer_norm (Inductor fuses it with its neighbours) whose backward is hpcmeg/kernels/layernorm.py's one
    pass: dx and the partial sums of dw, db together, mean and rstd recomputed from x (read anyway),
    so nothing but x is saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, _, dw, db, _ = torch.ops.hpcmeg.layer_norm_backward(dy, x, weight, ctx.eps, None, None, 1.0)
        return dx.to(x.dtype), dw.to(weight.dtype), db.to(weight.dtype), None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim; with grad, its backward in one Triton pass (_LayerNorm)."""
    if torch.is_grad_enabled():
        return _LayerNorm.apply(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")


class _LinearBiasGelu(torch.autograd.Function):
    """tanh-GELU(x W^T + b) with hpcmeg/kernels/gelu.py's kernels: the bias in the GEMM's epilogue, GELU in one
    pass (exp2-based, memory-bound), and the backward's dGELU and bias gradient in one pass over
    [tokens, ffn] (Inductor: a pointwise kernel, then a reduction that re-reads both inputs).
    Saves x, W and the pre-activation h, as linear + GELU do. `flat`/`offset`: the weight's
    main-grad sink (hpcmeg/fused/wgrad.py) or None; on ctx, as in wgrad._LinearSink."""

    @staticmethod
    def forward(ctx, x, weight, bias, flat, offset):
        h = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight, h)
        ctx.flat, ctx.offset = flat, offset
        return torch.ops.hpcmeg.gelu_tanh(h)

    @staticmethod
    def backward(ctx, dg):
        x, weight, h = ctx.saved_tensors
        dh, dbias = torch.ops.hpcmeg.gelu_tanh_backward(dg.contiguous(), h)
        dx = dh.matmul(weight)  # [.., ffn] @ [ffn, h] -> [.., h]
        if ctx.flat is not None:
            torch.ops.hpcmeg.wgrad_accumulate_(ctx.flat, dh, x, ctx.offset)
            dw = None
        else:
            dw = dh.reshape(-1, dh.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return dx, dw, dbias.to(weight.dtype), None, None


def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, sink=None) -> torch.Tensor:
    """tanh-GELU(x W^T + b). sink: the weight's main-grad sink (hpcmeg/fused/wgrad.py), or None.
    With grad: _LinearBiasGelu (the Triton GELU kernels); without (evaluation): F.gelu."""
    if torch.is_grad_enabled():
        x, weight, bias = autocast_cast(x, weight, bias)
        flat, offset = sink if sink is not None else (None, 0)
        return _LinearBiasGelu.apply(x, weight, bias, flat, offset)
    return F.gelu(wgrad.linear(x, weight, bias, sink), approximate="tanh")


class _MLPRecomputeGelu(torch.autograd.Function):
    """GELU(x W1^T + b1) W2^T that keeps the pre-activation h but not the GELU output g: the
    backward recomputes g = GELU(h) for fc2's weight gradient with the forward's own kernel
    (hpcmeg::gelu_tanh, the same bits). Per layer it saves 2 * ffn bytes per token less (bf16; 100 MB
    at 124M, micro batch 16) for one more GELU pass in the backward. GPTConfig.recompute_gelu_layers
    picks the layers. x [M, K] (2-D; mlp() flattens); flat/offset pairs: the weights' main-grad sinks
    (hpcmeg/fused/wgrad.py) or None, as in wgrad._LinearSink."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, flat1, off1, flat2, off2, shared):
        h = F.linear(x, w1, b1).contiguous()
        ctx.save_for_backward(x, w1, w2, h)
        # shared: both weights' main grads live in flat1 (one ParamAndGradBuffer), given once: Dynamo
        # does not trace an autograd.Function.apply that gets the same tensor twice (a graph break)
        ctx.sinks = (flat1, off1, flat1 if shared else flat2, off2)
        return F.linear(torch.ops.hpcmeg.gelu_tanh(h), w2)

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, h = ctx.saved_tensors
        flat1, off1, flat2, off2 = ctx.sinks
        # gelu_tanh_recompute, not gelu_tanh: the same kernel, but an op torch.compile does not merge
        # with the forward's call (which would save g again)
        g = torch.ops.hpcmeg.gelu_tanh_recompute(h)
        dy = dy.contiguous()
        dh, db1 = torch.ops.hpcmeg.gelu_tanh_backward(dy.matmul(w2), h)
        dw1 = dw2 = None
        if flat2 is not None:
            torch.ops.hpcmeg.wgrad_accumulate_(flat2, dy, g, off2)
        else:
            dw2 = dy.t().matmul(g)
        if flat1 is not None:
            torch.ops.hpcmeg.wgrad_accumulate_(flat1, dh, x, off1)
        else:
            dw1 = dh.t().matmul(x)
        return dh.matmul(w1), dw1, db1.to(w1.dtype), dw2, None, None, None, None, None


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, sink1=None, sink2=None,
        recompute_gelu: bool = False) -> torch.Tensor:
    """The MLP without its output bias, GELU(x W1^T + b1) W2^T; sink1/sink2: the weights' main-grad
    sinks (wgrad.py) or None. With grad and recompute_gelu: _MLPRecomputeGelu (the Triton GELU, its
    output recomputed in the backward); else linear_bias_gelu, then fc2's linear."""
    if recompute_gelu and torch.is_grad_enabled():
        x, w1, b1, w2 = autocast_cast(x, w1, b1, w2)
        f1, o1 = sink1 if sink1 is not None else (None, 0)
        f2, o2 = sink2 if sink2 is not None else (None, 0)
        shared = f1 is not None and f2 is f1  # one buffer: passed once (see _MLPRecomputeGelu.forward)
        out = _MLPRecomputeGelu.apply(x.reshape(-1, x.shape[-1]), w1, b1, w2, f1, o1, None if shared else f2, o2,
                                      shared)
        return out.view(*x.shape[:-1], w2.shape[0])
    return wgrad.linear(linear_bias_gelu(x, w1, b1, sink1), w2, None, sink2)


def _mask_kernel_for(x: torch.Tensor) -> bool:
    """Whether dropout of x takes the Triton keep-mask (CUDA only: on CPU the op would run its
    PyTorch twin, slower than torch's dropout)."""
    return HAVE_TRITON_DROPOUT and x.is_cuda


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout; on CUDA the keep-mask comes from hpcmeg/kernels/dropout.py's Philox kernel (a bool [x.shape]
    tensor, 8 draws of 16 bits per Philox call, so p in steps of 2**-16) and the scaling
    x * keep * keep_scale(p) (65536 / (65536 - round(p * 65536)), 1 / (1 - p) to 8e-6) is left to
    Inductor, which fuses it (and its backward, grad * keep * keep_scale(p)) into the neighbouring
    kernel. The seed is drawn from torch's generator, so torch.manual_seed / the saved RNG state
    replay it. Elsewhere torch's dropout."""
    if not training or p == 0:
        return x
    if _mask_kernel_for(x):
        keep = torch.ops.hpcmeg.dropout_keep_mask(dropout_kernel.draw_seed(x.device), list(x.shape), p)
        return x * keep * dropout_kernel.keep_scale(p)
    return F.dropout(x, p=p, training=True)


def bias_dropout_add(x, bias, residual, p: float, training: bool):
    if bias is not None:
        x = x + bias.to(x.dtype)  # keep the residual in x's dtype (bias is an fp32 param under autocast)
    return residual + dropout(x, p, training)


class _BiasDropoutAddLayerNorm(torch.autograd.Function):
    """out = residual + (x + bias) * keep * scale, y = LayerNorm(out) -> (out, y). The forward is
    plain ops (Inductor fuses them into one kernel); the backward is ONE pass of hpcmeg/kernels/layernorm.py: the
    LN backward, plus the gradient arriving at `out` from the residual path, times the keep-mask
    (the gradient of x), and the partial sums of dw, db and the bias gradient, where Inductor ran a
    fused kernel and then column reductions re-reading its inputs. keep None: no dropout (all kept,
    scale 1); bool [..., H], or packed uint8 [..., H / 8] (saved packed: 1/8 the bytes). out_grad
    False: `out` is used only through y (the last layer's residual stream before the final
    LayerNorm), so it is marked non-differentiable and the backward gets no zero d_out to fill and
    read ([tokens, hidden] each); torch.compile honours that, where it would materialise the zeros
    of an unused output."""

    @staticmethod
    def forward(ctx, x, bias, residual, keep, scale, weight, ln_bias, eps, out_grad=True):
        branch = x + bias.to(x.dtype)
        if keep is not None:
            mask = dropout_kernel.unpack_bits(keep, list(x.shape)) if keep.dtype == torch.uint8 else keep
            branch = branch * mask * scale
        out = residual + branch
        y = F.layer_norm(out, (out.shape[-1],), weight, ln_bias, eps)
        ctx.save_for_backward(out, weight, keep)
        ctx.scale, ctx.eps, ctx.out_grad = scale, eps, out_grad
        ctx.set_materialize_grads(False)
        if not out_grad:
            ctx.mark_non_differentiable(out)
        return out, y

    @staticmethod
    def backward(ctx, d_out, dy):
        out, weight, keep = ctx.saved_tensors
        if dy is None:  # y unused (not in model.py): its gradient is zero
            dy = torch.zeros_like(out)
        if not ctx.out_grad:  # decided in forward, so a compiled backward never sees a zero d_out
            d_out = None
        d_res, d_x, dw, db, dbias = torch.ops.hpcmeg.layer_norm_backward(
            dy, out, weight, ctx.eps, d_out, keep, ctx.scale, keep is None)
        if keep is None:  # no dropout: the branch's gradient is the residual's
            d_x = d_res
        return (d_x.to(out.dtype), dbias.to(weight.dtype), d_res.to(out.dtype), None, None,
                dw.to(weight.dtype), db.to(weight.dtype), None, None)


def _keep(x: torch.Tensor, p: float) -> tuple[torch.Tensor, float]:
    """(keep-mask, scale) of a residual branch: on CUDA the Triton kernel's bits packed eight to a
    byte when the hidden size allows (what the backward keeps: 1/8 of a bool mask), else its bool
    mask; elsewhere a bool mask from torch.rand (torch's generator, as F.dropout)."""
    if not _mask_kernel_for(x):
        return torch.rand_like(x, dtype=torch.float32) >= p, 1.0 / (1.0 - p)
    seed, shape = dropout_kernel.draw_seed(x.device), list(x.shape)
    packed = shape[-1] % dropout_kernel.PER_CALL == 0
    keep = (torch.ops.hpcmeg.dropout_keep_bits if packed else torch.ops.hpcmeg.dropout_keep_mask)(seed, shape, p)
    return keep, dropout_kernel.keep_scale(p)


def bias_dropout_add_layer_norm(x, bias, residual, p, training, ln_weight, ln_bias, eps, out_grad: bool = True):
    """(residual + dropout(x + bias), LayerNorm of it): with grad, _BiasDropoutAddLayerNorm.
    out_grad False: the caller uses the new residual only through its LayerNorm (it gets no gradient)."""
    if torch.is_grad_enabled() and bias is not None:
        keep, scale = _keep(x, p) if training and p > 0 else (None, 1.0)
        return _BiasDropoutAddLayerNorm.apply(x, bias, residual, keep, scale, ln_weight, ln_bias, eps, out_grad)
    out = bias_dropout_add(x, bias, residual, p, training)
    return out, F.layer_norm(out, (out.shape[-1],), ln_weight, ln_bias, eps)


def causal_attention_qkv(qkv: torch.Tensor, dropout_p: float, training: bool, backend: str = "auto",
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of qkv [b, s, heads, 3 * head_dim] (per head its q, k, v) -> [b, s, heads,
    head_dim]. backend 'triton': hpcmeg/kernels/attention.py's kernels straight on the GEMM's
    layout (its gradient comes back as one dqkv, no concatenation), when they take the shape.
    bias [heads * 3 * head_dim]: the QKV bias when the caller added it to qkv detached (x W^T +
    b.detach()); its gradient, the sum of dqkv over tokens, then comes from here: from the Triton
    backward kernels' own row sums (no reduction re-reading dqkv: 13.9 us per 124M layer call), or,
    on the other backends, through a zero add (qkv + (b - b.detach()))."""
    p = dropout_p if training else 0.0
    if backend == "triton" and attention_kernel.supports(qkv):
        seed = attention_kernel.draw_seed(qkv.device) if p > 0 else \
            torch.zeros(1, dtype=torch.int64, device=qkv.device)
        return torch.ops.hpcmeg.flash_attention(qkv, seed, p, bias)[0]
    if bias is not None:
        qkv = qkv + (bias - bias.detach()).view(qkv.shape[-2:]).to(qkv.dtype)
    q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
    return causal_attention(q, k, v, dropout_p, training, "auto" if backend == "triton" else backend)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                     training: bool, backend: str = "auto") -> torch.Tensor:
    """Causal attention, q/k/v/out [b, s, heads, head_dim]."""
    p = dropout_p if training else 0.0
    if (HAVE_FLASH_ATTN and backend in ("auto", "flash_attn") and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)):
        from flash_attn import flash_attn_func
        return flash_attn_func(q, k, v, dropout_p=p, causal=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants [b, heads, s, d]
    if q.is_cuda:
        with sdpa_kernel(list(_SDPA_ORDER[backend]), set_priority=True):
            out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=True)
    return out.transpose(1, 2)
