"""The parallel context: where this rank sits in the tp-dp-pp grid, and its process groups.

Contract
- Megatron's default 'tp-dp-pp' order (megatron-interop.md §5.5), fastest-varying first:
      global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)
  so TP groups are runs of consecutive ranks (keep TP within a node), DP groups are strided by tp,
  PP groups by tp * dp. Example world 16, tp 2, pp 4 (dp 2): TP [0,1],[2,3],..; DP [0,2],[1,3],[4,6],..;
  PP [0,4,8,12],[1,5,9,13],...
- `rank_grid(world, tp, pp)` returns the grid as nested lists [pp][dp][tp] of global ranks;
  `group_ranks(...)` slices it into the member lists of every TP / DP / PP group (pure, testable).
- `init_distributed(env, ...)` starts torch.distributed (gloo on CPU, NCCL on CUDA) when the
  world has more than one process, creates every group by slicing the grid (all ranks create all
  groups in the same order, as torch requires), and returns a `ParallelContext`. Nothing is stored
  in module globals: the context is passed to whoever needs a group. A group that spans the
  whole world is the default group (None), so pure data parallelism creates no extra communicator.
- `ctx.all_reduce_max(int) -> int`: every rank gets the maximum; used for "did any rank get the
  exit signal / see a bad checkpoint" agreement. Single process: returns the value unchanged.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpcmeg.launch.env import DistEnv


def rank_grid(world_size: int, tp: int = 1, pp: int = 1) -> list[list[list[int]]]:
    """Global ranks as grid[pp_rank][dp_rank][tp_rank] (Megatron tp-dp-pp order)."""
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp {tp} x pp {pp}")
    dp = world_size // (tp * pp)
    return [[[t + tp * (d + dp * p) for t in range(tp)] for d in range(dp)] for p in range(pp)]


def grid_coords(rank: int, world_size: int, tp: int = 1, pp: int = 1) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    dp = world_size // (tp * pp)
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def group_ranks(world_size: int, tp: int = 1, pp: int = 1) -> dict[str, list[list[int]]]:
    """Members of every group, by kind: {'tp': [...], 'dp': [...], 'pp': [...]} (sorted lists)."""
    g = rank_grid(world_size, tp, pp)
    dp = world_size // (tp * pp)
    return {
        "tp": [g[p][d] for p in range(pp) for d in range(dp)],
        "dp": [[g[p][d][t] for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[g[p][d][t] for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


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
    """torch ProcessGroups of this rank (None = the default group, or no group in one process)."""
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

    def destroy(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
            self.backend = None


class DeviceUnavailableError(RuntimeError):
    """The requested device is not there (no CUDA, or fewer GPUs than local ranks); one-line message."""


def pick_device(env: DistEnv, device: str = "auto") -> torch.device:
    """'auto' -> cuda:local_rank when CUDA is available, else cpu; 'cuda' fails loudly without it."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible to this task"
        raise DeviceUnavailableError(f"train.device=cuda but torch sees no CUDA device ({why}); use "
                                     f"train.device=cpu (or auto), or run where GPUs are allocated")
    n = torch.cuda.device_count()
    if env.local_rank >= n:
        raise DeviceUnavailableError(f"local rank {env.local_rank} has no GPU: this node shows {n} device(s); "
                                     f"start at most one task per GPU (cluster.gpus_per_node)")
    return torch.device("cuda", env.local_rank)


def init_distributed(env: DistEnv, *, tp: int = 1, pp: int = 1, backend: str = "auto",
                     device: str = "auto", timeout_minutes: float = 30.0) -> ParallelContext:
    """Start torch.distributed for `env` (if world > 1) and build this rank's ParallelContext."""
    dev = pick_device(env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tp_rank, dp_rank, pp_rank = grid_coords(env.rank, env.world_size, tp, pp)
    dp = env.world_size // (tp * pp)
    groups = group_ranks(env.world_size, tp, pp)
    mine = {k: next(m for m in v if env.rank in m) for k, v in groups.items()}
    ctx = ParallelContext(world_size=env.world_size, rank=env.rank, local_rank=env.local_rank, tp_size=tp,
                          pp_size=pp, dp_size=dp, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank,
                          device=dev, members=mine)
    if env.world_size == 1:
        return ctx
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    ctx.backend = backend
    for kind in ("tp", "dp", "pp"):
        for members in groups[kind]:  # every rank creates every group, in the same order
            if len(members) == env.world_size:
                continue  # the default group already spans them
            pg = dist.new_group(ranks=members)
            if env.rank in members:
                setattr(ctx, f"{kind}_group", pg)
    return ctx
