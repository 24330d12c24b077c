"""Vocabulary-parallel cross-entropy: per-token loss from this rank's logits shard [N, V/tp], never
gathering the logits and never building fp32 logits (the fused single-device path's property).

Owns: `vocab_parallel_cross_entropy` (the fast path), `vocab_parallel_cross_entropy_plain` (its
obviously-correct twin: all-gather the logits, F.cross_entropy) and
`vocab_parallel_linear_cross_entropy` (hidden states + the local output-weight shard -> loss, the
tied LM head's use).

Contract
- logits_local [..., V/tp] of any float dtype (bf16 under autocast): columns
  [tp_rank * V/tp, (tp_rank + 1) * V/tp) of the padded vocabulary, rank = rank inside `group`.
  labels [...] int64, global ids, 0 <= label < V (= padded size; a label outside every shard
  gives lse as its loss, it is not "ignored"). Padding rows of the padded embedding are real
  columns here, in the softmax exactly as in the unsharded model.
- Returns the per-token loss, float32 [...], logsumexp(all V logits) - logit[label], the same
  bits on every rank of the group. The caller masks and averages (loss * mask: masked tokens
  get zero gradient).
- Backward, on each rank, for its shard only, in one elementwise pass:
  d loss / d logits_local = (softmax_local - onehot_local) * g, in the logits' dtype;
  softmax_local = exp(logits - lse_global), onehot_local only on the rank owning the label.
  No collective in backward: every rank holds the same loss and the same upstream grad, and
  its shard's gradient needs only the global lse saved from forward.
- Size-1 group: the single-device formula bit for bit (hpcmeg/model/ops.py), no communication.
- "No fp32 logits" holds where it matters: on CUDA (the kernel forward, the backward compiled
  into one kernel for eager callers) and inside torch.compile (Inductor fuses the .float()); the
  eager CPU path (tests) materialises fp32 temporaries, as hpcmeg/fused/linear_ce.py's does.

How the forward combines the shards: each rank computes, per token, the fp32 logsumexp of its
shard (on CUDA the one-pass Triton kernel torch.ops.hpcmeg.cross_entropy_lse of
hpcmeg/kernels/cross_entropy.py, which reads the bf16 logits once; elsewhere its plain twin, fused by
Inductor when compiled) and its target logit (gathered from the shard, 0 where the label lives in
another shard). One all-gather of the stacked [2, N] fp32 (lse_r, target_r) then gives every rank
lse = logsumexp_r(lse_r) and target = sum_r target_r (exact: one nonzero term). Chosen over
Megatron's three all-reduces (max, sum of exp, target logit): one latency-bound collective of
8N bytes per rank instead of three of 4N, and every rank reduces the same gathered values in the
same order, so the loss is bitwise replicated by construction.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hpcmeg.fused import linear_ce as fused_ce
from hpcmeg.model.ops import cross_entropy_with_lse
from hpcmeg.parallel import comm


def _local_stats(logits: torch.Tensor, labels: torch.Tensor, start: int, use_triton: bool):
    """logits [N, v] shard starting at vocabulary column `start`, labels [N] global ->
    (lse_local [N] fp32, target_local [N] fp32 (0 off-shard), local label [N] (0 off-shard),
    in_shard [N] bool)."""
    v = logits.shape[-1]
    in_shard = (labels >= start) & (labels < start + v)
    local = torch.where(in_shard, labels - start, torch.zeros_like(labels))
    if use_triton:  # one read of the logits; its loss output is not used (the target is gathered)
        lse = torch.ops.hpcmeg.cross_entropy_lse(logits, local)[1]
    else:
        lse = cross_entropy_with_lse(logits, local)[1]
    target = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float()
    target = torch.where(in_shard, target, torch.zeros_like(target))
    return lse, target, local, in_shard


def _grad_logits(logits, lse, local, in_shard, g):
    """(softmax_local - onehot_local) * g in the logits' dtype; fp32 only elementwise."""
    p = torch.exp(logits.float() - lse.unsqueeze(-1))
    cols = torch.arange(logits.shape[-1], device=logits.device)
    hit = (cols == local.unsqueeze(-1)) & in_shard.unsqueeze(-1)
    return ((p - hit.to(p.dtype)) * g.unsqueeze(-1)).to(logits.dtype)


@functools.cache
def _compiled_grad():
    """Eager CUDA callers get the backward pass compiled into one kernel (as hpcmeg/fused/linear_ce.py does);
    built on first use so CPU runs never import Inductor for it."""
    return torch.compile(_grad_logits)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, size, rank, name, use_triton):
        lse, target, local, in_shard = _local_stats(logits, labels, rank * logits.shape[-1], use_triton)
        if size > 1:
            stats = comm.all_gather(torch.stack([lse, target]), size, name).view(size, 2, -1)
            lse, target = torch.logsumexp(stats[:, 0], dim=0), stats[:, 1].sum(0)
        ctx.save_for_backward(logits, lse, local, in_shard)
        return lse - target

    @staticmethod
    def backward(ctx, g):
        logits, lse, local, in_shard = ctx.saved_tensors
        fn = _grad_logits
        if logits.is_cuda and not torch.compiler.is_compiling():
            fn = _compiled_grad()
        return fn(logits, lse, local, in_shard, g), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, labels: torch.Tensor, group,
                                 use_triton: bool | None = None) -> torch.Tensor:
    """logits_local [..., V/tp] (this rank's vocabulary shard), labels [...] global ids -> fp32 [...].

    use_triton None: the Triton lse kernel when the logits are on CUDA and Triton imports."""
    if labels.shape != logits_local.shape[:-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: labels {tuple(labels.shape)} do not match "
                         f"logits {tuple(logits_local.shape)}")
    if use_triton is None:
        use_triton = fused_ce.HAVE_TRITON_CE and logits_local.is_cuda
    n = comm.group_size(group)
    rank, name = (comm.group_rank(group), comm.group_name(group)) if n > 1 else (0, "")
    v = logits_local.shape[-1]
    loss = _VocabParallelCE.apply(logits_local.reshape(-1, v), labels.reshape(-1), n, rank, name, use_triton)
    return loss.view(labels.shape)


def vocab_parallel_cross_entropy_plain(logits_local: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """The twin: all-gather the logits to [..., V] (grad: own slice), fp32 F.cross_entropy."""
    full = comm.gather_from_tp_last_dim(logits_local, group)
    loss = F.cross_entropy(full.float().reshape(-1, full.shape[-1]), labels.reshape(-1), reduction="none")
    return loss.view(labels.shape)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight_local: torch.Tensor, labels: torch.Tensor,
                                        group, sequence_parallel: bool = False, plain: bool = False) -> torch.Tensor:
    """The vocabulary-parallel (tied) LM head + loss.

    hidden [b, s, h] replicated over the group (or [b, s/tp, h] token shards under sequence
    parallelism, comm.py's layout), weight_local [V/tp, h] this rank's rows of the padded
    embedding, labels [b, s] global ids -> per-token loss fp32 [b, s], replicated.
    f (copy_to_tp) or gather_seq before the matmul makes d hidden the sum over the shards' partial
    gradients (all-reduce, or reduce-scatter back to the token shards)."""
    x = comm.gather_seq(hidden, group) if sequence_parallel else comm.copy_to_tp(hidden, group)
    logits = F.linear(x, weight_local)  # [b, s, V/tp] in the autocast dtype; never fp32, never gathered
    if plain:
        return vocab_parallel_cross_entropy_plain(logits, labels, group)
    return vocab_parallel_cross_entropy(logits, labels, group)
