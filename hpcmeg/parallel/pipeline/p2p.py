"""Blocking point-to-point transfer of activations and their grads between pipeline stages.

Contract
- `PipelineP2P(pp_ranks, pp_rank, shape, dtype, device, group=None)`: `pp_ranks[i]` is the global
  rank of pipeline rank i in this rank's PP group (the rank grid's PP group members, e.g.
  `ctx.members["pp"]`, ordered by pipeline rank); `group` is the torch ProcessGroup of those
  ranks (None = the default group, which is right when the PP group spans the world).
- Every tensor on the wire has the same `shape` and `dtype`: an activation [mb, s, h] between
  chunks, or the grad of one (same shape and dtype). [mb, s/tp, h] under sequence parallelism. Both
  sides know them from the config, so no shape is exchanged (Megatron's default, too); a send of
  anything else raises before touching the wire, because on NCCL a mismatched pair hangs or
  corrupts silently.
- `send(t, peer)` / `recv(peer) -> Tensor` take a pipeline rank and block in the sense of the
  schedule: torch.distributed.send/recv in the order the action list gives. On gloo the host
  blocks until the transfer is done. On NCCL the calls return once queued and the current stream
  waits for them, so the device executes them in the same per-rank order; NCCL matches
  point-to-point calls between two ranks by their order (tags are ignored), which is why both
  sides must issue them in matching orders: the schedule (schedule.py) guarantees that, and all
  transfers here use tag 0 so gloo matches by order exactly as NCCL does.
- recv returns a fresh tensor (the caching allocator makes that cheap); the runner marks it
  requires_grad itself. Nothing here holds state between calls besides the fixed config.
- `from_context(ctx, shape, dtype)` builds it from a ParallelContext (members["pp"], pp_rank,
  pp_group, device).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class PipelineP2P:
    def __init__(self, pp_ranks: Sequence[int], pp_rank: int, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str, group=None):
        if not 0 <= pp_rank < len(pp_ranks):
            raise ValueError(f"pipeline rank {pp_rank} outside the PP group {list(pp_ranks)}")
        self.pp_ranks = list(pp_ranks)
        self.pp_rank = pp_rank
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N, never "cuda"
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = group

    @classmethod
    def from_context(cls, ctx, shape: Sequence[int], dtype: torch.dtype) -> "PipelineP2P":
        return cls(ctx.members["pp"], ctx.pp_rank, shape, dtype, ctx.device, ctx.pp_group)

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    def _peer(self, peer: int) -> int:
        if peer == self.pp_rank or not 0 <= peer < self.pp_size:
            raise ValueError(f"pipeline rank {self.pp_rank} cannot talk to pipeline rank {peer} "
                             f"(PP group of {self.pp_size})")
        return self.pp_ranks[peer]

    def send(self, t: torch.Tensor, peer: int) -> None:
        if t.shape != self.shape or t.dtype != self.dtype or t.device != self.device:
            raise ValueError(f"pipeline send of {tuple(t.shape)} {t.dtype} on {t.device}, but the stages "
                             f"exchange {tuple(self.shape)} {self.dtype} on {self.device}")
        dist.send(t.detach().contiguous(), dst=self._peer(peer), group=self.group)

    def recv(self, peer: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self._peer(peer), group=self.group)
        return buf
