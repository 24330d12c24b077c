"""The parallel context: where this rank sits in the tp-dp-pp grid, and its process groups.

Contract
- The sizes, the rank grid and the group member lists are `ParallelDims`'
  (hpcmeg/megatron/parallel_dims.py, torch-free: Megatron's 'tp-dp-pp' order, TP groups of consecutive
  ranks).
- `init_distributed(dims, rank=, local_rank=, master_addr=, master_port=, ...)` (plain values: this
  package does not read the launcher's environment) starts torch.distributed (gloo on CPU, NCCL on
  CUDA) when the world has more than one process and returns `context_for(dims, rank, ...)`, which
  creates every group of every kind in `dims.groups()` order (all ranks create all groups in the
  same order, as torch requires) over the default group, and returns a `ParallelContext`. Nothing is stored in module globals: the context is passed to whoever
  needs a group. A group that spans the whole world is the default group (None), so pure data
  parallelism creates no extra communicator.
- `ctx.all_reduce_max(int) -> int`: every rank gets the maximum; used for "did any rank get the
  exit signal / see a bad checkpoint" agreement. Single process: returns the value unchanged.
- `ctx.set_timeout(seconds)`: the timeout of every later collective on the default group and on each
  group this context created (the trainer shortens the start's 30 minutes once steps are timed, so a
  rank that stopped makes the others fail in minutes). Single process: nothing to change.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpcmeg.megatron.parallel_dims import ParallelDims


@dataclass
class ParallelContext:
    world_size: int
    rank: int
    local_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    device: torch.device
    """The device this rank computes on (cuda:local_rank or cpu)."""
    backend: str | None = None
    """'gloo' / 'nccl' when torch.distributed is running, None for a single process."""
    tp_group: Any = None
    dp_group: Any = None
    pp_group: Any = None
    embedding_group: Any = None
    """torch ProcessGroups of this rank (None = the default group, or no group in one process;
    embedding_group: first and last pipeline stage, only when pp > 1 and this rank holds one)."""
    dims: ParallelDims | None = None
    """The layout this context was built for."""
    members: dict[str, list[int]] = field(default_factory=dict)
    """Global ranks of this rank's tp / dp / pp groups (for logs and tests)."""

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def all_reduce_max(self, value: int | bool) -> int:
        """MAX of an int over all ranks (a collective: every rank must call it)."""
        if not self.distributed:
            return int(value)
        return int(self.all_reduce_max_(torch.tensor([int(value)], dtype=torch.int64, device=self.device)).item())

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place MAX of a tensor over all ranks, queued on the device's stream order (no host
        sync: with NCCL the result is ready once the work queued before it is)."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def dp_mean_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place average of a tensor over this rank's data-parallel group."""
        if self.distributed and self.dp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
            t /= self.dp_size
        return t

    def set_timeout(self, seconds: float) -> None:
        """Timeout of later collectives on the default group and this context's groups. torch sets a
        group's timeout in each member process separately: every rank calls it, with the same value."""
        if not self.distributed:
            return
        timeout = datetime.timedelta(seconds=float(seconds))
        # None is the default group; a subgroup that spans the world is the default group too (context_for)
        own = {id(g): g for g in (self.tp_group, self.dp_group, self.pp_group, self.embedding_group) if g is not None}
        for g in (None, *own.values()):
            dist.distributed_c10d._set_pg_timeout(timeout, g)

    def destroy(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
            self.backend = None


class DeviceUnavailableError(RuntimeError):
    """The requested device is not there (no CUDA, or fewer GPUs than local ranks); one-line message."""


def pick_device(local_rank: int, device: str = "auto") -> torch.device:
    """'auto' -> cuda:local_rank when CUDA is available, else cpu; 'cuda' fails loudly without it."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible to this task"
        raise DeviceUnavailableError(f"train.device=cuda but torch sees no CUDA device ({why}); use "
                                     f"train.device=cpu (or auto), or run where GPUs are allocated")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise DeviceUnavailableError(f"local rank {local_rank} has no GPU: this node shows {n} device(s); "
                                     f"start at most one task per GPU (cluster.gpus_per_node)")
    return torch.device("cuda", local_rank)


def init_distributed(dims: ParallelDims, *, rank: int = 0, local_rank: int = 0, master_addr: str = "127.0.0.1",
                     master_port: int = 29500, backend: str = "auto", device: str = "auto",
                     timeout_minutes: float = 30.0) -> ParallelContext:
    """Start torch.distributed for this rank (if world > 1) and build its ParallelContext."""
    dev = pick_device(local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dims.world > 1:
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=dims.world,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return context_for(dims, rank, local_rank, dev)


def context_for(dims: ParallelDims, rank: int, local_rank: int, device: torch.device) -> ParallelContext:
    """This rank's ParallelContext over an already-initialised default process group (or none, for one
    process): creates every group of every kind, in the same order on every rank, as torch requires."""
    tp_rank, dp_rank, pp_rank = dims.coords(rank)
    ctx = ParallelContext(world_size=dims.world, rank=rank, local_rank=local_rank, tp_size=dims.tp,
                          pp_size=dims.pp, dp_size=dims.dp, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank,
                          device=torch.device(device), members=dims.members(rank), dims=dims)
    if dims.world == 1:
        return ctx
    ctx.backend = dist.get_backend()
    for kind, groups in dims.groups().items():
        for members in groups:  # every rank creates every group, in the same order
            if len(members) == dims.world:
                continue  # the default group already spans them
            pg = dist.new_group(ranks=members)
            if rank in members:
                setattr(ctx, f"{kind}_group", pg)
    return ctx
