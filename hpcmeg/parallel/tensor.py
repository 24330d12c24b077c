"""Tensor (and sequence) parallelism applied from outside to the single-device GPT: Megatron's layout.

`parallelize_tensor(model, ctx, sequence_parallel=False, rng=None) -> TensorParallelPlan` changes a
GPT (or a pipeline chunk of one) in place for this rank of the TP group `ctx.tp_group`:
- every parameter with a split dimension (hpcmeg.megatron.layout.tp_split_dim: QKV and h->4h by
  rows, the two output projections by columns, the word embedding / head copy by vocabulary rows)
  is replaced by this rank's contiguous chunk of it, so `model.state_dict()` IS Megatron's
  mp_rank_TT shard (names, shapes, the padded-vocabulary rule). The model was initialised whole
  (name-keyed, hpcmeg/model/init.py), so the chunks are exactly the TP1 run's initial weights;
- f / g around the attention and MLP blocks (forward hooks; the model keeps calling F.linear on
  plain local Parameters): f = copy_to_tp before, g = reduce_from_tp after the row-parallel
  output, whose bias is added after the reduction (it is replicated). With sequence parallelism
  the activations between blocks are token shards [b, s/tp, h] (hpcmeg/parallel/comm.py's layout):
  f becomes gather_seq and g reduce_scatter_seq (same bytes), the embedding output is split after
  the position embeddings are added, and the head gathers the tokens back;
- the word embedding becomes a VocabParallelEmbedding over its row shard, and the output layer a
  vocabulary-parallel head (vocab_parallel_linear_cross_entropy: no logits gathered, no fp32 logits;
  logits for evaluation without labels are gathered);
- RNG (hpcmeg/parallel/random.py): attention dropout of the rank's own heads runs on the TP stream
  (`attend` wrapped); with sequence parallelism every dropout of a layer does (its activations
  differ per rank): the stream is entered in a forward pre-hook of the layer and left in a forward
  hook, so it holds around whatever runs the layer's forward (compiled per layer or not).
The plan names the parameters every TP rank holds whole (`replicated`: LayerNorms, row-parallel
biases, position embeddings: counted once in the gradient norm) and those among them whose
gradients are partial sums under sequence parallelism (`partial_grads`: LayerNorms and row-parallel
biases, which act on token shards: all-reduced over the TP group after the DP reduction).
At TP = 1 nothing changes (no hooks, no copies): the compiled single-device graph stays as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcmeg.megatron.layout import tp_split_dim
from hpcmeg.parallel import comm
from hpcmeg.parallel.vocab_ce import vocab_parallel_linear_cross_entropy
from hpcmeg.parallel.vocab_embedding import VocabParallelEmbedding

_ROW_PARALLEL_BIAS = ("self_attention.dense.bias", "mlp.dense_4h_to_h.bias")


@dataclass
class TensorParallelPlan:
    tp_size: int = 1
    sequence_parallel: bool = False
    replicated: frozenset = field(default_factory=frozenset)
    """ids of parameters every TP rank holds whole"""
    partial_grads: frozenset = field(default_factory=frozenset)
    """ids of replicated parameters whose gradients are partial sums over the TP group (SP only)"""


class VocabParallelHead(nn.Module):
    """The output layer over this rank's vocabulary rows (the tied weight's shard)."""

    def __init__(self, group, sequence_parallel: bool, plain: bool):
        super().__init__()
        self.group, self.sequence_parallel, self.plain = group, sequence_parallel, plain

    def forward(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if labels is None:  # logits (evaluation, generation): the vocabulary gathered
            x = comm.gather_seq(h, self.group) if self.sequence_parallel else comm.copy_to_tp(h, self.group)
            return comm.gather_from_tp_last_dim(F.linear(x, weight), self.group)
        return vocab_parallel_linear_cross_entropy(h, weight, labels, self.group,
                                                   sequence_parallel=self.sequence_parallel, plain=self.plain)


def _shard_parameters(model: nn.Module, tp: int, rank: int) -> set[int]:
    """Replace every splittable parameter by this rank's chunk; returns the ids of the others."""
    global_name = getattr(model, "global_name", lambda n: n)
    replicated = set()
    for mod_name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            name = f"{mod_name}.{pname}" if mod_name else pname
            dim = tp_split_dim(global_name(name))
            if dim is None:
                replicated.add(id(p))
                continue
            if p.shape[dim] % tp:
                raise ValueError(f"{name}: dimension {dim} of size {p.shape[dim]} does not split into tp={tp} parts")
            chunk = p.detach().chunk(tp, dim)[rank].clone()
            module._parameters[pname] = nn.Parameter(chunk, requires_grad=p.requires_grad)
    return replicated


def _fork_around_calls(module: nn.Module, rng) -> None:
    """Every call of `module` (its forward and whatever wraps that forward, e.g. a compiled one:
    hpcmeg/parallel/overlap.py) runs on the TP RNG stream: entered in a forward pre-hook, left in
    a forward hook."""
    entered = []

    def enter(m, args):
        fork = rng.fork()
        fork.__enter__()
        entered.append(fork)

    def leave(m, args, out):
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave)


def _forked(module: nn.Module, method: str, rng):
    """module.<method> on the TP RNG stream; the method is looked up on the module's class at each
    call, so a class swap after this (hpcmeg/fused/model.py's fuse) is still honoured."""
    def run(*args, **kwargs):
        with rng.fork():
            return getattr(type(module), method)(module, *args, **kwargs)
    return run


def parallelize_tensor(model: nn.Module, ctx, *, sequence_parallel: bool = False, rng=None) -> TensorParallelPlan:
    tp, rank, group = ctx.tp_size, ctx.tp_rank, ctx.tp_group
    if tp == 1:
        return TensorParallelPlan()
    cfg = model.cfg
    replicated = _shard_parameters(model, tp, rank)
    sp = sequence_parallel

    def enter(module, args):
        x = args[0]
        return (comm.gather_seq(x, group) if sp else comm.copy_to_tp(x, group),)

    def leave(module, args, out):
        y, bias = out
        return (comm.reduce_scatter_seq(y, group) if sp else comm.reduce_from_tp(y, group)), bias

    if model.embedding is not None:
        model.embedding.word_embeddings = VocabParallelEmbedding(model.embedding.word_embeddings.weight, group)
        if sp:  # positions are added before the split: every op after it is per token
            model.embedding.register_forward_hook(lambda m, a, out: comm.split_seq(out, group))
    dropout = cfg.attention_dropout > 0 or cfg.hidden_dropout > 0
    for layer in model.encoder.layers:
        for block in (layer.self_attention, layer.mlp):
            block.register_forward_pre_hook(enter)
            block.register_forward_hook(leave)
        if rng is not None and sp and dropout:  # every activation of the layer differs per rank
            _fork_around_calls(layer, rng)
        elif rng is not None and cfg.attention_dropout > 0:  # the rank's own heads
            layer.self_attention.attend = _forked(layer.self_attention, "attend", rng)
    if model.head is not None:
        model.head = VocabParallelHead(group, sp, plain=not cfg.fused)
    partial = set()
    if sp:
        for name, p in model.named_parameters():
            if id(p) in replicated and ("layernorm" in name or name.endswith(_ROW_PARALLEL_BIAS)):
                partial.add(id(p))
    return TensorParallelPlan(tp, sp, frozenset(replicated), frozenset(partial))
