"""The optimizer a model trains with: its parameter groups, and the ParamAndGradBuffer + FlatAdamW
built over it for this rank's parallel layout.

Owns:
  param_groups(model, weight_decay) -> two groups: decayed (matrices and embeddings) and not
    decayed (biases and LayerNorm weights: every tensor with ndim < 2), as Megatron does. Their
    order (group by group, model.parameters() order inside) is the checkpoint's optimizer order.
  build_optimizer(model, lr, ...) -> (buffer, optimizer): the model's parameters moved into a
    ParamAndGradBuffer (hpcmeg/parallel/grad_buffer.py: DP / TP / PP groups, distributed optimizer
    or not) and a FlatAdamW over it (hpcmeg/train/flat_adamw.py).
The fp16 loss scaler is hpcmeg/train/loss_scale.py's.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hpcmeg.model import wgrad
from hpcmeg.parallel.grad_buffer import ParamAndGradBuffer
from hpcmeg.train.flat_adamw import FlatAdamW


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable params: weight decay for ndim >= 2 (matrices, embeddings), none otherwise."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() de-duplicates the tied embedding
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, *,
                    param_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None,
                    dp_size: int = 1, dp_rank: int = 0, dp_group=None, distributed: bool = False,
                    bucket_numel: int | None = None, compiled: bool | None = None,
                    replicated: frozenset = frozenset(), partial_grads: frozenset = frozenset(),
                    tp_size: int = 1, tp_rank: int = 0, tp_group=None, tied: frozenset = frozenset(),
                    embedding_group=None, count_tied_in_norm: bool = True, pp_size: int = 1, pp_group=None,
                    accumulate: str = "bucketed", wgrad_fusion: bool = False) -> tuple[ParamAndGradBuffer, "FlatAdamW"]:
    """The model's parameters moved into a ParamAndGradBuffer of `param_dtype` (gradients in
    `grad_dtype`, default fp32), and a FlatAdamW over it (sharded over the data-parallel group when
    `distributed`); `accumulate` is the buffer's gradient path (bucketed | per_param); `wgrad_fusion`:
    every nn.Linear weight is sunk (its GEMM accumulates into its main grad, hpcmeg/model/wgrad.py;
    the model must be a fused one). Call before torch.compile; do not move or re-cast the model afterwards.

    Tensor parallelism (hpcmeg/parallel/tensor.py's plan): `replicated` holds the ids of parameters
    every TP rank has whole (LayerNorms, row-parallel biases, position embeddings): they are counted
    in the gradient norm on tp_rank 0 only, and the norm's sum of squares is added up over
    `tp_group`. `partial_grads` (a subset: under sequence parallelism each rank's gradient of them is
    a partial sum) are all-reduced over `tp_group` after the data-parallel reduction. Each kind gets
    its own buffer classes, so both are contiguous runs of the buffer.

    Pipeline parallelism: `tied` holds the word embedding (first stage) or its head copy (last
    stage); they get a class of their own (the same buckets and slices on both stages, so their
    gradients can be summed over `embedding_group` after the data-parallel reduction, Megatron's
    embedding all-reduce) and the copy is left out of the norm where `count_tied_in_norm` is False
    (the last stage); the sum of squares is added up over `pp_group`."""
    from hpcmeg.parallel.grad_buffer import DEFAULT_BUCKET_NUMEL

    def kind(p) -> str:
        if id(p) in tied:
            return ".tied"
        return ".partial" if id(p) in partial_grads else ".replicated" if id(p) in replicated else ""

    groups = param_groups(model, weight_decay)
    classes, extra = [], []
    for g, name in zip(groups, ("decay", "no_decay")):
        g["classes"] = []
        for suffix in (".tied", "", ".replicated", ".partial"):
            members = [p for p in g["params"] if kind(p) == suffix]
            if members or not suffix:
                g["classes"].append(name + suffix)
                classes.append((name + suffix, members))
                if suffix == ".partial":
                    extra.append((name + suffix, tp_group))
                if suffix == ".tied":  # None: the default group (the embedding group spans the world)
                    extra.append((name + suffix, embedding_group))
    if wgrad_fusion and not getattr(getattr(model, "cfg", None), "fused", False):
        raise ValueError("build_optimizer: wgrad_fusion needs a fused model (only fused layers take sinks)")
    if not wgrad_fusion:
        sunk = frozenset()
    elif hasattr(model, "sinkable_weights"):  # GPT: its linears, and the tied word embedding when it can
        sunk = frozenset(id(w) for w in model.sinkable_weights())
    else:
        sunk = frozenset(id(m.weight) for m in model.modules() if isinstance(m, nn.Linear))
    buffer = ParamAndGradBuffer(classes, param_dtype=param_dtype, grad_dtype=grad_dtype or torch.float32,
                                dp_size=dp_size, dp_rank=dp_rank, dp_group=dp_group, shard=distributed,
                                bucket_numel=bucket_numel or DEFAULT_BUCKET_NUMEL, extra_reductions=tuple(extra),
                                accumulate=accumulate, sunk=sunk)
    if sunk:
        wgrad.attach_sinks(model, lambda w: buffer.sink_of(w) if buffer.is_sunk(w) else None)
    norm_skip = {c for c, _ in classes if c.endswith((".replicated", ".partial")) and tp_rank != 0}
    norm_skip |= {c for c, _ in classes if c.endswith(".tied") and not count_tied_in_norm}
    norm_groups = ((tp_group,) if tp_size > 1 else ()) + ((pp_group,) if pp_size > 1 else ())
    return buffer, FlatAdamW(buffer, groups, lr=lr, betas=betas, eps=eps, compiled=compiled,
                             norm_skip=frozenset(norm_skip), norm_groups=norm_groups)
