"""The optimizer a model trains with: its parameter groups, and the ParamAndGradBuffer + FlatAdamW
built over it for this rank's place in the parallel layout.

Owns:
  Role: what a parameter is to the parallel layout (plain, tied, replicated, partial); it decides
    the parameter's buffer class, the extra reduction of its gradient and whether this rank counts
    it in the gradient norm. param_roles(tied=, partial=, replicated=) -> {id(p): Role}.
  BufferClass(group, role): the key of one class of the buffer (one contiguous run of it). The keys
    live in memory only: checkpoints hold torch AdamW's per-parameter layout (flat_adamw.py).
  AdamWConfig(lr, weight_decay, betas, eps): the hyper-parameters.
  param_groups(model, weight_decay) -> two groups: decayed (matrices and embeddings) and not
    decayed (biases and LayerNorm weights: every tensor with ndim < 2), as Megatron does. Their
    order (group by group, model.parameters() order inside) is the checkpoint's optimizer order.
  build_optimizer(model, hyper, ctx=None, roles=None, ...) -> (buffer, optimizer): the model's
    parameters moved into a ParamAndGradBuffer (hpcmeg/parallel/grad_buffer.py) laid out for the
    parallel context (hpcmeg/parallel/context.py; None: one process) and a FlatAdamW over it
    (hpcmeg/train/flat_adamw.py).
The fp16 loss scaler is hpcmeg/train/loss_scale.py's.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from hpcmeg.megatron.parallel_dims import ParallelDims
from hpcmeg.fused import wgrad
from hpcmeg.parallel.context import ParallelContext, context_for
from hpcmeg.parallel.grad_buffer import DEFAULT_BUCKET_NUMEL, ParamAndGradBuffer
from hpcmeg.train.flat_adamw import FlatAdamW


class Role(enum.Enum):
    """What a parameter is to the parallel layout. The definition order is the order of a group's
    classes in the buffer."""

    TIED = "tied"
    """The word embedding on the first pipeline stage, or its head copy on the last: the same buckets
    and slices on both stages, so their gradients are summed over the embedding group after the
    data-parallel reduction (Megatron's embedding all-reduce); the copy is left out of the norm."""
    PLAIN = "plain"
    """Reduced over the data-parallel group only: a tensor-parallel shard, or any parameter at TP 1."""
    REPLICATED = "replicated"
    """Whole on every TP rank (LayerNorms, row-parallel biases, position embeddings): counted in the
    gradient norm on tp_rank 0 only."""
    PARTIAL = "partial"
    """Replicated, and under sequence parallelism each TP rank's gradient is a partial sum: all-reduced
    over the TP group after the data-parallel reduction."""


def param_roles(*, tied: Iterable[int] = (), partial: Iterable[int] = (),
                replicated: Iterable[int] = ()) -> dict[int, Role]:
    """{id(p): Role} from the ids of the tied parameters (hpcmeg/parallel/pipeline/stages.py's
    tied_parameters) and of a TensorParallelPlan's partial_grads and replicated (partial ones are
    replicated too: the more specific role wins). Parameters not named are PLAIN."""
    roles = {i: Role.REPLICATED for i in replicated}
    roles.update({i: Role.PARTIAL for i in partial})
    roles.update({i: Role.TIED for i in tied})
    return roles


class BufferClass(NamedTuple):
    group: str
    """'decay' or 'no_decay' (param_groups' two groups)."""
    role: Role


@dataclass(frozen=True)
class AdamWConfig:
    lr: float
    """The starting learning rate of every group (the trainer's LR schedule rewrites it each step)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the decayed group (the other group has none)."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable params: weight decay for ndim >= 2 (matrices, embeddings), none otherwise."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() de-duplicates the tied embedding
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def one_process(device: torch.device | str = "cpu") -> ParallelContext:
    """The parallel context of a single process (no process groups) on `device`."""
    return context_for(ParallelDims(1), 0, 0, torch.device(device))


def build_optimizer(model: nn.Module, hyper: AdamWConfig, ctx: ParallelContext | None = None,
                    roles: Mapping[int, Role] | None = None, *, param_dtype: torch.dtype = torch.float32,
                    grad_dtype: torch.dtype | None = None, bucket_numel: int | None = None,
                    compiled: bool | None = None, accumulate: str = "bucketed",
                    wgrad_fusion: bool = False) -> tuple[ParamAndGradBuffer, FlatAdamW]:
    """The model's parameters moved into a ParamAndGradBuffer of `param_dtype` (gradients in
    `grad_dtype`, default fp32), and a FlatAdamW over it. Call before torch.compile; do not move or
    re-cast the model afterwards.

    `ctx`: this rank's parallel context (default: one process on the model's device). The buffer
    reduces over its data-parallel group and is sharded there when its layout asks for the
    distributed optimizer (ctx.dims.distributed_optimizer); the gradient norm's sum of squares is
    added up over its TP and pipeline groups. `roles`: {id(p): Role} (param_roles; default: every
    parameter PLAIN); each role gets buffer classes of its own, so each is a contiguous run of the
    buffer. `accumulate`: the buffer's gradient path, bucketed or its per_param twin (tests compare
    them). `wgrad_fusion`: every weight the model can sink (nn.Linear's; GPT.sinkable_weights) has
    its GEMM accumulate into its main grad (hpcmeg/fused/wgrad.py); the model must be a fused one."""
    ctx = ctx or one_process(next(model.parameters()).device)
    roles = roles or {}
    groups = param_groups(model, hyper.weight_decay)
    classes = _buffer_classes(groups, roles)
    sunk = _sunk_weights(model) if wgrad_fusion else frozenset()
    buffer = ParamAndGradBuffer(classes, param_dtype=param_dtype, grad_dtype=grad_dtype or torch.float32,
                                dp_size=ctx.dp_size, dp_rank=ctx.dp_rank, dp_group=ctx.dp_group,
                                shard=ctx.dims is not None and ctx.dims.distributed_optimizer,
                                bucket_numel=bucket_numel or DEFAULT_BUCKET_NUMEL,
                                extra_reductions=_extra_reductions(classes, ctx), accumulate=accumulate, sunk=sunk)
    if sunk:
        wgrad.attach_sinks(model, lambda w: buffer.sink_of(w) if buffer.is_sunk(w) else None)
    for g in groups:
        g.update(lr=hyper.lr, betas=tuple(hyper.betas), eps=hyper.eps)
    norm_groups = ((ctx.tp_group,) if ctx.tp_size > 1 else ()) + ((ctx.pp_group,) if ctx.pp_size > 1 else ())
    return buffer, FlatAdamW(buffer, groups, compiled=compiled, norm_skip=_norm_skip(classes, ctx),
                             norm_groups=norm_groups)


def _buffer_classes(groups: list[dict], roles: Mapping[int, Role]) -> list[tuple[BufferClass, list]]:
    """The buffer's classes, group by group, in Role order inside a group: a PLAIN class always (the
    checkpoint's group order needs every group in the buffer), the others where they have members.
    Each group dict gets its class keys under "classes"."""
    classes = []
    for g, name in zip(groups, ("decay", "no_decay")):
        g["classes"] = []
        for role in Role:
            members = [p for p in g["params"] if roles.get(id(p), Role.PLAIN) is role]
            if members or role is Role.PLAIN:
                g["classes"].append(BufferClass(name, role))
                classes.append((BufferClass(name, role), members))
    return classes


def _extra_reductions(classes: list[tuple[BufferClass, list]], ctx: ParallelContext) -> tuple:
    """(class, group) summed after the data-parallel reduction: partial gradients over the TP group,
    the tied embedding over the embedding group (None: the default group, when it spans the world)."""
    over = {Role.PARTIAL: ctx.tp_group, Role.TIED: ctx.embedding_group}
    return tuple((key, over[key.role]) for key, _ in classes if key.role in over)


def _norm_skip(classes: list[tuple[BufferClass, list]], ctx: ParallelContext) -> frozenset:
    """Classes this rank leaves out of the gradient norm, so the norm counts every parameter once:
    TP-replicated ones off tp_rank 0, the tied head copy on the last pipeline stage."""
    last_stage_only = ctx.pp_rank == ctx.pp_size - 1 and ctx.pp_rank != 0
    skip = {Role.REPLICATED, Role.PARTIAL} if ctx.tp_rank != 0 else set()
    if last_stage_only:
        skip.add(Role.TIED)
    return frozenset(key for key, _ in classes if key.role in skip)


def _sunk_weights(model: nn.Module) -> frozenset:
    """Ids of the weights whose GEMMs accumulate into their main grads (gradient-accumulation fusion)."""
    if not getattr(getattr(model, "cfg", None), "fused", False):
        raise ValueError("build_optimizer: wgrad_fusion needs a fused model (only fused layers take sinks)")
    if hasattr(model, "sinkable_weights"):  # GPT: its linears, and the tied word embedding when it can
        return frozenset(id(w) for w in model.sinkable_weights())
    return frozenset(id(m.weight) for m in model.modules() if isinstance(m, nn.Linear))
