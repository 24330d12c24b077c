"""Deterministic, resumable batch order for pretraining (Megatron's MegatronPretrainingSampler).

Owns the mapping from a consumed-samples count to the next micro batches of one data-parallel rank
(docs/megatron-interop.md §3.6):
- global sample indices run consumed_samples, consumed_samples+1, ..., total_samples-1;
- they are cut into groups of micro_batch_size * dp_size (one micro batch per DP rank);
- rank r takes the slice [r*mbs, (r+1)*mbs) of each group.
Resume is pure arithmetic: restore consumed_samples from the checkpoint and the order continues
exactly (the dataset's shuffle index already fixes which sample each global index is).

`collate` stacks dataset items into torch tensors (tokens/labels int64 [mbs, L], loss_mask float32
[mbs, L]); hpcmeg/train/data.py wraps both in a torch DataLoader. torch is imported lazily so index
building and `prepare-cache` stay torch-free.
"""

from __future__ import annotations

from typing import Iterator, List, Sequence


class PretrainingSampler:
    """Yields, for one DP rank, the list of global sample indices of each of its micro batches."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"total_samples={total_samples}: nothing to sample")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} is outside [0, {total_samples}): "
                             "the checkpoint has consumed all samples of this dataset; ask for more iterations")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro_batch_size and data_parallel_size must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def group_size(self) -> int:
        """Samples consumed by all DP ranks for one micro batch each."""
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Number of micro batches this rank will yield."""
        left = self.total_samples - self.consumed_samples
        full, rest = divmod(left, self.group_size)
        lo = self.data_parallel_rank * self.micro_batch_size
        return full + (1 if rest > lo and not self.drop_last else 0)

    def __iter__(self) -> Iterator[List[int]]:
        lo = self.data_parallel_rank * self.micro_batch_size
        hi = lo + self.micro_batch_size
        g = self.group_size
        start = self.consumed_samples
        while start + g <= self.total_samples:
            yield list(range(start + lo, start + hi))
            start += g
        # the last partial group: Megatron slices it the same way (so a rank may get a short or empty list)
        if start < self.total_samples and not self.drop_last:
            piece = list(range(start, self.total_samples))[lo:hi]
            if piece:
                yield piece


def global_batch_indices(consumed_samples: int, global_batch_size: int) -> List[int]:
    """The global sample indices of the iteration that starts after `consumed_samples` (all ranks)."""
    return list(range(consumed_samples, consumed_samples + global_batch_size))


def collate(items: Sequence[dict]) -> dict:
    """List of dataset items -> dict of stacked torch tensors (int arrays -> int64, masks -> float32)."""
    import numpy as np
    import torch

    out = {}
    for key in items[0]:
        values = [it[key] for it in items]
        if isinstance(values[0], np.ndarray):
            stacked = np.stack(values)
            out[key] = torch.from_numpy(stacked.astype(np.int64) if stacked.dtype.kind in "iu" else stacked)
        else:
            out[key] = torch.tensor(values)
    return out
