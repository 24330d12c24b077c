"""The data-parallel reduction overlapped with the backward under torch.compile: one compiled region
per transformer layer, and markers that tell the grad buffer when a layer's backward is over.

Why: compiled as a whole, the model's backward is one autograd node. Every parameter gradient comes
out of it at its end, and the weights whose GEMMs write their own fp32 main grads
(gradient-accumulation fusion, hpcmeg/fused/wgrad.py) are complete only when the whole backward is,
so ParamAndGradBuffer could start no bucket's reduction before the backward ends: at 1.3B ~5 GB of
fp32 gradients per step waiting on the network. Compiled layer by layer (torchtitan compiles each
transformer block the same way), autograd runs one compiled backward per layer; the hooks of that
layer's other parameters fire right after it, and a marker reports its sunk weights.

Contract
- `compile_layers(model, **compile_kwargs) -> int`: each transformer layer of a GPT, or of every
  chunk of a pipeline StageModel, runs its forward through one function compiled with
  `compile_kwargs` that takes the layer as an argument (so the layers share their graphs); the
  layer's hooks stay outside the compiled region; the embedding, the final LayerNorm and the head
  run as they are. Returns the number of layers compiled. (TP's forked forward, an instance
  attribute, is replaced: apply it after this, or not at all.)
- `report_sunk_weights(model, buffer) -> int`: every transformer layer that holds weights the buffer
  sinks gets a forward pre-hook passing its input through `_Marker`, an identity whose backward calls
  `buffer.sunk_done(those weights)`: autograd runs it right after the layer's backward, which has
  issued every GEMM of the layer (each layer's backward is one compiled node, or its eager ops all
  precede the gradient of its input). Then `buffer.expect_sunk_reports()`. The tied word embedding,
  whose last gradient comes from the embedding's own backward at the very end, is not reported: its
  bucket starts in finish_grads, as before. Returns the number of layers marked.
Order on the GPU: the marker runs on the host after the layer's kernels are queued; the collective
the buffer launches then is queued behind them (the process group orders its stream after the
current one), so it reads finished main grads.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of a GPT, or of every chunk of a StageModel, in forward order."""
    chunks = list(model.chunks) if hasattr(model, "chunks") else [model]
    return [layer for chunk in chunks for layer in chunk.encoder.layers]


def _layer_forward(layer: nn.Module, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


def compile_layers(model: nn.Module, **compile_kwargs) -> int:
    layers = transformer_layers(model)
    # ONE compiled function with the layer as an argument: the layers share its graphs (the first,
    # the middle ones and the last differ); compiling each bound `layer.forward` would guard on the
    # layer and compile it again per layer, up to Dynamo's recompile limit, then run the rest eager
    compiled = torch.compile(_layer_forward, **compile_kwargs)

    def run(layer, *args, **kwargs):
        # integer attributes of the layers' modules (the main-grad sinks' offsets, one per weight) as
        # graph inputs, not constants: otherwise every layer is a graph of its own again
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return compiled(layer, *args, **kwargs)

    for layer in layers:
        # an instance attribute: the module's own call (its hooks) stays eager around the compiled forward
        layer.forward = functools.partial(run, layer)
    return len(layers)


class _Marker(torch.autograd.Function):
    """x -> x; in the backward, `report()` before passing the gradient on."""

    @staticmethod
    def forward(ctx, x, report):
        ctx.report = report
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.report()
        return grad, None


def report_sunk_weights(model: nn.Module, buffer) -> int:
    marked = 0
    for layer in transformer_layers(model):
        sunk = [p for p in layer.parameters() if buffer.is_sunk(p)]
        if not sunk:
            continue

        def mark(module, args, sunk=sunk):
            x = args[0]
            if not (torch.is_grad_enabled() and x.requires_grad):
                return None
            return (_Marker.apply(x, lambda: buffer.sunk_done(sunk)),) + tuple(args[1:])

        layer.register_forward_pre_hook(mark)
        marked += 1
    if marked:
        buffer.expect_sunk_reports()
    return marked
