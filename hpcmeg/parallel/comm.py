"""Megatron's tensor- and sequence-parallel communication functions, as autograd Functions.

Owns the collectives that parallel layers put at their boundaries (Megatron-LM's mappings.py:
"f" and "g" of the Megatron paper, and the three sequence-parallel ones). Nothing else: no
layers, no module-level state; every function takes the process group it works on.

Contract
- `group`: a torch ProcessGroup, or None for the default (world) group, as ParallelContext
  stores it. A group of size 1, or no torch.distributed at all, makes every function the
  identity (split/gather of one piece) with no communication and no autograd node, so the
  TP = 1 graph is the single-device graph.
- Tensor-parallel region functions (x is replicated over the group unless said otherwise):
    copy_to_tp(x)              f: forward identity,            backward all-reduce (sum)
    reduce_from_tp(x)          g: forward all-reduce (sum),    backward identity
    scatter_to_tp_last_dim(x)  forward own 1/tp slice of the last dim, backward all-gather it
    gather_from_tp_last_dim(x) forward all-gather the last dim (rank order), backward own slice
- Sequence-parallel functions, on activations [b, s, h] ([b, s, ..., h] too; a 2-D [N, h] is
  tokens x features, N playing s, so token ids [b, s] go in as ids.unsqueeze(-1)):
    split_seq(x)               [b, s, h] -> [b, s/tp, h]: own shard; backward all-gather
    gather_seq(x)              [b, s/tp, h] -> [b, s, h]: all-gather; backward reduce-scatter
                               (grad_partial=True: the consumer is a column-/vocab-parallel
                               layer whose input grads are partial sums) or own shard
                               (grad_partial=False: the consumer is replicated)
    reduce_scatter_seq(x)      [b, s, h] partial sums -> [b, s/tp, h] summed; backward all-gather
  s must be divisible by the group size (ValueError otherwise).
  THE SHARD LAYOUT: rank r's shard is the r-th contiguous 1/tp of the tokens of the row-major
  [b*s, h] view, viewed as [b, s/tp, h]: for b = 1 exactly the positions [r*s/tp, (r+1)*s/tp);
  for b > 1 a run of b*s/tp consecutive tokens (b % tp == 0: whole samples). Every op outside
  the TP regions is per token (LayerNorm, dropout, residual/bias adds, the embedding sum), so
  any fixed partition gives the same numbers; this one makes every collective a dim-0
  collective of a contiguous tensor, no transpose. (Megatron gets the same by keeping [s, b, h].)
  A literal dim-1 split of [b, s, h] costs a chunk+cat copy of the full tensor after every
  all-gather and before every reduce-scatter: on the H200, bf16 at TP2, 16-19 us for 124M's
  18.9 MB (b 12, s 1024, h 768) and 29 us at h 2048, against ~26 / ~68 us for the all-gather
  itself at ~370 GB/s NVLink (bench/results/tp_blocks_h200.md). No position-dependent op may run
  on a shard (GPT-2 adds position embeddings before the split, so none does).
- Raw dim-0 collectives without autograd, for the other parallel/ modules: all_reduce(x, name),
  all_gather(x, size, name) -> [size*d0, ...], reduce_scatter(x, size, name) -> [d0/size, ...];
  name = group_name(group).
- Units: sums in the tensor's dtype, in another order than one process (~1e-7 relative in
  fp32); copies, splits and gathers are bitwise.

Implementation, risk R2 of docs/parallel-design.md answered: the `_c10d_functional` ops behind
torch.distributed._functional_collectives, on every backend, each waited at once and wrapped in
an autograd.Function. Funcol everywhere, no dist.* fallback needed. Measured
(bench/results/tp_blocks_h200.md has the numbers and the spike):
  * gloo/CPU, torch 2.13 here (bench/dev/funcol_gloo.py): right values on the world and sub-groups;
    eager latency equal to dist.* (fastest of 40 on 2 shared cores: all-reduce 128 KB 0.40 vs
    0.42 ms, 4 MB 4.8 vs 5.0 ms; all-gather 0.30 vs 0.33, 3.6 vs 4.5 ms); torch.compile
    (fullgraph=True; Inductor and aot_eager) traces the Functions with no graph break, group
    None and sub-groups resolved at trace time, results equal to eager.
  * torch 2.11 (H200 image): the ops exist (the *_single wrapper names do not); the gloo tests
    pass there, compiled cases included; on NCCL (one rank) eager and Inductor match the math.
  * not the public wrappers: on 2.13 all_gather_tensor / reduce_scatter_tensor warn "deprecated"
    (renamed *_single), wrap results in AsyncCollectiveTensor, and the first eager call took
    3.5 s of lazy imports; 2.13's ops have autograd formulas of their own, which the Functions
    make irrelevant, so gradients are the same on 2.11 and 2.13.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_C = torch.ops._c10d_functional


def _running() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group) -> int:
    """Members of `group` (None: the world); 1 when torch.distributed is not running."""
    return dist.get_world_size(group) if _running() else 1


def group_rank(group) -> int:
    """This process's rank inside `group` (0 when torch.distributed is not running)."""
    return dist.get_rank(group) if _running() else 0


def group_name(group) -> str:
    """The registered name the functional collectives address a group by."""
    return (group if group is not None else dist.group.WORLD).group_name


# ---- raw collectives (no autograd; contiguous dim-0 layout) ---------------------------------

def all_reduce(x: torch.Tensor, name: str) -> torch.Tensor:
    return _C.wait_tensor(_C.all_reduce(x.contiguous(), "sum", name))


def all_gather(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """[d0, ...] -> [size * d0, ...], rank-major."""
    return _C.wait_tensor(_C.all_gather_into_tensor(x.contiguous(), size, name))


def reduce_scatter(x: torch.Tensor, size: int, name: str) -> torch.Tensor:
    """[size * d0, ...] -> [d0, ...]: the sum over ranks of this rank's dim-0 chunk."""
    return _C.wait_tensor(_C.reduce_scatter_tensor(x.contiguous(), "sum", size, name))


# ---- shard/gather helpers, all op(x, size, rank, name): token shards and last-dim slices ------

def _seq_dim(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 3 else 0  # [b, s, ..., h]: s; [N, h]: N


def _check_seq(x: torch.Tensor, size: int, what: str, full: bool) -> None:
    if size == 1:
        return
    if x.dim() < 2:
        raise ValueError(f"{what}: expected activations [b, s, ..., h] or [N, h], got shape {tuple(x.shape)}")
    if full and x.shape[_seq_dim(x)] % size:
        raise ValueError(f"{what}: sequence length {x.shape[_seq_dim(x)]} is not divisible by the "
                         f"tensor-parallel size {size} (sequence parallelism needs seq_length % tp == 0)")


def _resized(x: torch.Tensor, num: int, den: int) -> list[int]:
    """x's shape with the sequence dim scaled by num/den."""
    shape = list(x.shape)
    shape[_seq_dim(x)] = shape[_seq_dim(x)] * num // den
    return shape


def _seq_shard(x: torch.Tensor, size: int, rank: int, name: str) -> torch.Tensor:
    flat = x.contiguous().view(-1, x.shape[-1])  # [tokens, h]
    n = flat.shape[0] // size
    return flat[rank * n:(rank + 1) * n].view(_resized(x, 1, size))


def _seq_gather(x: torch.Tensor, size: int, rank: int, name: str) -> torch.Tensor:
    return all_gather(x, size, name).view(_resized(x, size, 1))


def _seq_reduce_scatter(x: torch.Tensor, size: int, rank: int, name: str) -> torch.Tensor:
    return reduce_scatter(x.contiguous().view(-1, x.shape[-1]), size, name).view(_resized(x, 1, size))


def _last_gather(x: torch.Tensor, size: int, rank: int, name: str) -> torch.Tensor:
    g = all_gather(x, size, name).view(size, *x.shape)  # [tp, ..., v]
    return g.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def _last_shard(x: torch.Tensor, size: int, rank: int, name: str) -> torch.Tensor:
    # always a fresh tensor (a strided slice needs the copy anyway): a Function returning
    # x[..., :].contiguous(), an alias of its input, got zero gradients under torch.compile on
    # torch 2.11 + CUDA (seen with a one-rank group on the H200, bench/tp_blocks_gpu.py)
    n = x.shape[-1] // size
    return x.narrow(-1, rank * n, n).clone(memory_format=torch.contiguous_format)


# ---- one autograd Function, eight (forward, backward) pairs ------------------------------------

def _identity(x, size, rank, name):
    return x.view_as(x)  # a view, never the input object itself


def _all_reduce(x, size, rank, name):
    return all_reduce(x, name)


_PAIRS = {  # a constant table: kind -> (forward, backward), as in the contract above
    "copy_to_tp": (_identity, _all_reduce),
    "reduce_from_tp": (_all_reduce, _identity),
    "scatter_to_tp_last_dim": (_last_shard, _last_gather),
    "gather_from_tp_last_dim": (_last_gather, _last_shard),
    "split_seq": (_seq_shard, _seq_gather),
    "gather_seq": (_seq_gather, _seq_reduce_scatter),
    "gather_seq_replicated_grad": (_seq_gather, _seq_shard),
    "reduce_scatter_seq": (_seq_reduce_scatter, _seq_gather),
}


class _Comm(torch.autograd.Function):
    """apply(x, kind, size, rank, name) with size > 1: _PAIRS[kind] forward, its partner backward."""

    @staticmethod
    def forward(ctx, x, kind: str, size: int, rank: int, name: str):
        ctx.kind, ctx.size, ctx.rank, ctx.name = kind, size, rank, name
        return _PAIRS[kind][0](x, size, rank, name)

    @staticmethod
    def backward(ctx, g):
        return _PAIRS[ctx.kind][1](g, ctx.size, ctx.rank, ctx.name), None, None, None, None


# ---- public API ----------------------------------------------------------------------------

def _apply(kind: str, x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    return x if n == 1 else _Comm.apply(x, kind, n, group_rank(group), group_name(group))


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """f: entering a TP region (before a column-parallel layer). Identity; grad all-reduced."""
    return _apply("copy_to_tp", x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """g: leaving a TP region (after a row-parallel layer). Partial sums all-reduced; grad identity."""
    return _apply("reduce_from_tp", x, group)


def scatter_to_tp_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """[..., v] replicated -> [..., v/tp] this rank's slice (a copy); grad all-gathered."""
    if x.shape[-1] % group_size(group):
        raise ValueError(f"scatter_to_tp_last_dim: last dim {x.shape[-1]} not divisible by {group_size(group)}")
    return _apply("scatter_to_tp_last_dim", x, group)


def gather_from_tp_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """[..., v/tp] -> [..., v] in rank order (a copy); grad: this rank's slice of it."""
    return _apply("gather_from_tp_last_dim", x, group)


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, h] replicated -> [b, s/tp, h] this rank's token shard (a view); grad all-gathered."""
    _check_seq(x, group_size(group), "split_seq", full=True)
    return _apply("split_seq", x, group)


def gather_seq(x: torch.Tensor, group, grad_partial: bool = True) -> torch.Tensor:
    """[b, s/tp, h] token shards -> [b, s, h]; grad reduce-scattered (or sliced: grad_partial=False)."""
    _check_seq(x, group_size(group), "gather_seq", full=False)
    return _apply("gather_seq" if grad_partial else "gather_seq_replicated_grad", x, group)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, h] partial sums -> [b, s/tp, h] summed token shard; grad all-gathered."""
    _check_seq(x, group_size(group), "reduce_scatter_seq", full=True)
    return _apply("reduce_scatter_seq", x, group)
