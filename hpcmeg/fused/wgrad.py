"""Weight-gradient accumulation fused into the GEMM (Megatron's gradient_accumulation_fusion).

Why: with bf16 parameters the backward's weight-gradient GEMM writes a bf16 [out, in] gradient, and
the ParamAndGradBuffer then reads it back and adds it, converted, into the fp32 main grad: a
bandwidth pass over every weight per micro batch (~0.45 ms per micro batch at 124M on the H200,
bench/results/profile_h200_s7_124M_gbs192.md). Here the GEMM itself accumulates in fp32 into the
main grad (cuBLAS with beta = 1 and an fp32 C: `torch.addmm(..., out_dtype=torch.float32)`), and
autograd gets no weight gradient at all.

Contract:
  linear(x [.., in], weight [out, in], bias [out] | None, sink) -> x W^T + b, as F.linear.
    sink None: F.linear itself. sink = (flat, offset): `flat` is a 1-D main-grad buffer (the
    ParamAndGradBuffer's grad_data; fp32) and flat[offset : offset + out*in] the weight's main
    grad, viewed [out, in]. The backward ADDS dy^T x to it (the caller zeroes it at step start)
    and returns None as the weight's gradient (weight.grad stays None, no hook fires).
  embedding(ids [..], weight [V, h], sink) -> weight[ids], as F.embedding; with a sink its backward
    ADDS each dy row into row ids[i] of the main grad (index_add_, fp32) and returns None as the
    weight's gradient: no dense [V, h] gradient, no zero-fill, no later add into the main grad
    (with the tied output layer's GEMM accumulating into the same main grad, ops.py's
    linear_cross_entropy with a sink, the word embedding is a sunk weight too).
  attach_sinks(model, sink_of) gives each nn.Linear and nn.Embedding its sink from outside (the
    trainer: sink_of = ParamAndGradBuffer.sink_of of the sunk weights); layer_sink(layer) reads it
    back (the fused modules of model.py pass it to linear / embedding).
  torch.ops.hpcmeg.embedding_grad_accumulate_(flat, dy [.., h], ids [..], offset, rows) -> None: the
    embedding's accumulation (index_add_ on CUDA and CPU alike; on CUDA its fp32 atomic adds order
    repeated ids' rows as they come, as Inductor's embedding backward already did).
  torch.ops.hpcmeg.main_grad_add_(flat, grad, offset) -> None: flat[offset : offset + grad.numel()] +=
    grad (a gradient computed elsewhere, e.g. fused_ce's backward_in_forward, added in a backward).
  torch.ops.hpcmeg.wgrad_accumulate_(flat, dy [.., out], x [.., in], offset) -> None: the accumulation;
    on CUDA one GEMM with beta = 1 (out_dtype=fp32 when flat is fp32 and dy/x are not); on CPU (the
    plain twin) the product in the operands' dtype, converted, then added. The op mutates `flat`
    only, so torch.compile keeps it inside the compiled backward (a backward mutation of a forward
    input that needs no grad; the buffer is a module buffer, so CUDA graphs treat it as a static
    input; Inductor reinplaces it: no copy of the buffer).
Measured (bench/results/user_path_h200_s7.md): +1.4 % tokens/s on the 124M user path (488K vs 481K).
Numerics: the fused GEMM sums in fp32 and rounds once (into fp32); the unfused path rounds the
gradient to bf16 first: they agree to bf16 rounding of each micro batch's gradient, not bitwise.
With fp32 operands both paths compute the same mm and agree exactly.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

_SINK = "main_grad_sink"  # the module buffer attach_sinks registers on each nn.Linear


@torch.library.custom_op("hpcmeg::wgrad_accumulate_", mutates_args=("flat",))
def wgrad_accumulate_(flat: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, offset: int) -> None:
    out_f, in_f = dy.shape[-1], x.shape[-1]
    main = flat[offset:offset + out_f * in_f].view(out_f, in_f)
    dy2, x2 = dy.reshape(-1, out_f), x.reshape(-1, in_f)
    if flat.is_cuda and dy.dtype != flat.dtype:  # C += A^T B in the GEMM's epilogue, C fp32
        torch.addmm(main, dy2.t(), x2, out_dtype=flat.dtype, out=main)
    elif flat.is_cuda:
        main.addmm_(dy2.t(), x2)
    else:  # the plain twin: the unfused path's product, then its add
        main.add_(torch.mm(dy2.t(), x2).to(flat.dtype))


@wgrad_accumulate_.register_fake
def _(flat, dy, x, offset):
    return None


@torch.library.custom_op("hpcmeg::main_grad_add_", mutates_args=("flat",))
def main_grad_add_(flat: torch.Tensor, grad: torch.Tensor, offset: int) -> None:
    flat[offset:offset + grad.numel()].add_(grad.reshape(-1).to(flat.dtype))


@main_grad_add_.register_fake
def _(flat, grad, offset):
    return None


@torch.library.custom_op("hpcmeg::embedding_grad_accumulate_", mutates_args=("flat",))
def embedding_grad_accumulate_(flat: torch.Tensor, dy: torch.Tensor, ids: torch.Tensor, offset: int,
                               rows: int) -> None:
    h = dy.shape[-1]
    main = flat[offset:offset + rows * h].view(rows, h)
    main.index_add_(0, ids.reshape(-1), dy.reshape(-1, h).to(flat.dtype))


@embedding_grad_accumulate_.register_fake
def _(flat, dy, ids, offset, rows):
    return None


class _EmbeddingSink(torch.autograd.Function):
    """F.embedding whose weight gradient goes into the sink (flat on ctx, as _LinearSink's)."""

    @staticmethod
    def forward(ctx, ids, weight, flat, offset):
        ctx.save_for_backward(ids)
        ctx.flat, ctx.offset, ctx.rows = flat, offset, weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        ids, = ctx.saved_tensors
        torch.ops.hpcmeg.embedding_grad_accumulate_(ctx.flat, dy, ids, ctx.offset, ctx.rows)
        return None, None, None, None


class _LinearSink(torch.autograd.Function):
    """F.linear whose weight gradient goes into the sink. `flat` rides on ctx, not in
    save_for_backward: every layer's backward mutates it, which would trip autograd's version
    check on the saved copy of the layers still to come."""

    @staticmethod
    def forward(ctx, x, weight, bias, flat, offset):
        ctx.save_for_backward(x, weight)
        ctx.flat, ctx.offset = flat, offset
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight)  # [.., out] @ [out, in] -> [.., in]
        torch.ops.hpcmeg.wgrad_accumulate_(ctx.flat, dy, x, ctx.offset)
        # a bias given detached (its gradient taken elsewhere: fused.causal_attention_qkv) is not summed
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, db, None, None


def attach_sinks(model: nn.Module, sink_of) -> int:
    """Give every nn.Linear and nn.Embedding of `model` whose weight `sink_of(weight)` maps to (flat,
    offset) (None: leave it) its sink: `flat` as a non-persistent module buffer (torch.compile and
    CUDA graphs see one static input; not in state_dict) and the offset. Returns how many layers
    got one."""
    n = 0
    for module in model.modules():
        sink = sink_of(module.weight) if isinstance(module, (nn.Linear, nn.Embedding)) else None
        if sink is not None:
            module.register_buffer(_SINK, sink[0], persistent=False)
            module.main_grad_offset = sink[1]
            n += 1
    return n


def layer_sink(layer: nn.Module):
    """The sink attach_sinks gave this layer, or None (then `linear` is F.linear)."""
    flat = getattr(layer, _SINK, None)
    return None if flat is None else (flat, layer.main_grad_offset)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, sink=None) -> torch.Tensor:
    if sink is None:
        return F.linear(x, weight, bias)
    flat, offset = sink
    return _LinearSink.apply(x, weight, bias, flat, offset)


def embedding(ids: torch.Tensor, weight: torch.Tensor, sink=None) -> torch.Tensor:
    if sink is None:
        return F.embedding(ids, weight)
    flat, offset = sink
    return _EmbeddingSink.apply(ids, weight, flat, offset)
