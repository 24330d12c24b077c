"""Vocabulary-parallel word embedding: each tensor-parallel rank holds rows
[tp_rank * V/tp, (tp_rank + 1) * V/tp) of the padded embedding and looks up only those ids.

Owns: `vocab_parallel_embedding` (the function) and `VocabParallelEmbedding` (an nn.Module with the
same `weight` attribute name as nn.Embedding, so it can replace `embedding.word_embeddings` and
the state_dict key stays Megatron's `embedding.word_embeddings.weight`, holding the local shard).

Contract
- ids [b, s] int64 global ids in [0, V) (V = padded vocabulary = tp * weight_local.shape[0]);
  weight_local [V/tp, h]; rank = rank inside `group`.
- Rank r looks up the ids it owns (others read row 0 and are zeroed), giving partial sums
  [b, s, h] that are exact once added over the group (each id is owned by one rank: x + 0 = x,
  so the result is bitwise the unsharded lookup). Then, by `reduce`:
    "all_reduce"      reduce_from_tp -> [b, s, h] replicated (plain tensor parallelism)
    "reduce_scatter"  reduce_scatter_seq -> [b, s/tp, h], comm.py's token-shard layout
                      (sequence parallelism); s % tp == 0
    "none"            the partial sums, for a caller that adds something first and reduces itself
- Backward: the weight gradient of the owned rows is the unsharded one (rows of ids owned
  elsewhere get exactly 0: masked positions carry zero gradient into row 0); the all-reduce or
  reduce-scatter's backward gives each rank the full upstream gradient it needs.
- Size-1 group: F.embedding, no masking, no communication.
Why not reduce before adding the position embedding: the sum word + position is per token, so
the lead layer may add position embeddings (replicated, or split_seq'ed under sequence
parallelism) after this; Megatron does the same.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcmeg.parallel import comm

REDUCE_MODES = ("all_reduce", "reduce_scatter", "none")


def vocab_parallel_embedding(ids: torch.Tensor, weight_local: torch.Tensor, group,
                             reduce: str = "all_reduce") -> torch.Tensor:
    """ids [b, s] global -> [b, s, h] (all_reduce | none) or [b, s/tp, h] (reduce_scatter)."""
    if reduce not in REDUCE_MODES:
        raise ValueError(f"vocab_parallel_embedding: reduce={reduce!r}: use one of {REDUCE_MODES}")
    n = comm.group_size(group)
    if n == 1:
        return F.embedding(ids, weight_local)
    v = weight_local.shape[0]
    start = comm.group_rank(group) * v
    outside = (ids < start) | (ids >= start + v)
    local = torch.where(outside, torch.zeros_like(ids), ids - start)
    out = F.embedding(local, weight_local).masked_fill(outside.unsqueeze(-1), 0.0)
    if reduce == "all_reduce":
        return comm.reduce_from_tp(out, group)
    if reduce == "reduce_scatter":
        return comm.reduce_scatter_seq(out, group)
    return out


class VocabParallelEmbedding(nn.Module):
    """Drop-in for nn.Embedding(V, h) holding rows [rank * V/tp, (rank + 1) * V/tp).

    weight: the local shard [V/tp, h] (an existing Parameter is kept as is, so a tied LM head
    that holds the same Parameter stays tied). `group` is kept as an attribute: it is the
    module's configuration, like nn.Embedding's padding_idx, not shared state."""

    def __init__(self, weight: torch.Tensor, group, reduce: str = "all_reduce"):
        super().__init__()
        if reduce not in REDUCE_MODES:
            raise ValueError(f"VocabParallelEmbedding: reduce={reduce!r}: use one of {REDUCE_MODES}")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.group, self.reduce = group, reduce
        self.num_embeddings = weight.shape[0] * comm.group_size(group)  # the padded V, as nn.Embedding's
        self.embedding_dim = weight.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.group, self.reduce)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local_rows={self.weight.shape[0]}, reduce={self.reduce}"
