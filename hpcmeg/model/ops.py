"""Plain PyTorch reference ops: the obviously-correct twins of hpcmeg/fused/ops.py.

Every function here has a same-named fast version in hpcmeg/fused/ops.py (cross_entropy_with_lse and
cross_entropy_grad_: the Triton kernels of hpcmeg/kernels/cross_entropy.py; softmax_minus_onehot is their shared
gradient formula); tests/test_fused_ops.py checks that each pair agrees (fp32 on CPU, the
Triton one in its interpreter) and bench/gpu_agreement.py does so on the GPU in bf16.
hpcmeg/model/gpt.py is written with torch's own modules (nn.LayerNorm, F.gelu, F.dropout) and
calls the attention and loss here.

Shapes: x [b, s, h] activations; q, k, v [b, s, heads, head_dim]; bias [h] or [ffn];
labels [b, s] int64. Per-token losses are float32 [b, s].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GELU_C = math.sqrt(2.0 / math.pi)  # 0.7978845608..., the tanh-GELU constant


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, statistics in fp32 (as Megatron's mixed-precision LN)."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    return (y * weight.float() + bias.float()).to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU of (x + bias): GPT-2's `gelu_new`, Megatron's fused bias-GeLU."""
    y = x + bias
    return 0.5 * y * (1.0 + torch.tanh(GELU_C * (y + 0.044715 * y * y * y)))


def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(x W^T + b): the MLP's first half. x [b, s, h], weight [ffn, h], bias [ffn] -> [b, s, ffn]."""
    return bias_gelu(F.linear(x, weight), bias)


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The MLP without its output bias (bias-dropout-add adds it): GELU(x W1^T + b1) W2^T."""
    return F.linear(linear_bias_gelu(x, w1, b1), w2)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """torch's dropout (the fused twin draws its mask from a Philox kernel on CUDA)."""
    return F.dropout(x, p=p, training=training)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     p: float, training: bool) -> torch.Tensor:
    """residual + dropout(x + bias): the end of every residual branch."""
    if bias is not None:
        x = x + bias.to(x.dtype)  # keep the residual in x's dtype (bias is an fp32 param under autocast)
    return residual + dropout(x, p, training)


def bias_dropout_add_layer_norm(x, bias, residual, p, training, ln_weight, ln_bias, eps, out_grad: bool = True):
    """(new_residual, LayerNorm(new_residual)): the branch end fused with the next pre-LN. out_grad:
    a hint for the fused version (autograd here needs none: an unused output costs nothing)."""
    out = bias_dropout_add(x, bias, residual, p, training)
    return out, layer_norm(out, ln_weight, ln_bias, eps)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                     training: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, softmax in fp32. In/out [b, s, heads, d]."""
    b, s, nh, d = q.shape
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    probs = F.dropout(probs, p=dropout_p, training=training).to(v.dtype)
    return (probs @ v).transpose(1, 2)  # [b, s, heads, d]


def cross_entropy_with_lse(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, logsumexp), both fp32, of logits [..., V] against labels [...]: the one
    written-out formulation that the fused CE paths and hpcmeg/kernels/cross_entropy.py's twin share."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    return lse - lf.gather(-1, labels.unsqueeze(-1)).squeeze(-1), lse


def softmax_minus_onehot(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """fp32 d loss / d logits of cross_entropy_with_lse (before the upstream scale): softmax - onehot,
    from the logits [..., V] and their logsumexp [...]."""
    p = torch.exp(logits.float() - lse.unsqueeze(-1))
    hit = torch.arange(logits.shape[-1], device=logits.device) == labels.unsqueeze(-1)
    return p - hit.to(p.dtype)


def cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss fp32 [...], with the logits overwritten in place by softmax - onehot in their own
    dtype: the plain twin of hpcmeg/kernels/cross_entropy.py's grad-in-forward kernel (the fused 'grad_in_forward' CE)."""
    loss, lse = cross_entropy_with_lse(logits, labels)
    logits.copy_(softmax_minus_onehot(logits, labels, lse).to(logits.dtype))
    return loss


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token CE of logits = hidden @ weight^T against labels, via full fp32 logits.

    hidden [b, s, h], weight [V, h], labels [b, s] -> loss float32 [b, s].
    """
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
