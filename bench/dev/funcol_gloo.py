"""Risk R2 of docs/parallel-design.md: functional collectives on gloo (CPU), the spike behind
hpcmeg/parallel/comm.py's choice. Spawns `world` gloo processes (default 2) and prints:

- eager latency of the `_c10d_functional` ops comm.py calls (+ wait_tensor) against the
  torch.distributed ones, interleaved repetitions, median and minimum (shared cores are noisy);
- the sequence-parallel layouts: all-gather / reduce-scatter of [b, s/tp, h] shards as a dim-0
  collective of the flattened tokens (comm.py) vs a literal dim-1 split (chunk + cat copy);
- whether torch.compile(fullgraph=True) traces comm.py's functions with the default group and a
  sub-group, and gives the eager values.
Usage: python bench/dev/funcol_gloo.py [world]
"""
from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _median_min(fn, reps=40):
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return f"median {ts[len(ts) // 2] * 1e3:7.3f} ms  min {ts[0] * 1e3:7.3f} ms"


def _worker(rank: int, world: int, port: int) -> None:
    from hpcmeg.parallel import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    name = comm.group_name(None)
    rows = []
    for b, s, h in ((2, 64, 256), (8, 256, 512)):
        full = torch.randn(b, s, h)
        loc = torch.randn(b, s // world, h)
        kb = full.numel() * 4 // 1024
        cases = {
            "all_reduce funcol": lambda: comm.all_reduce(full, name),
            "all_reduce dist": lambda: dist.all_reduce(full.clone()),
            "all_gather funcol (dim 0 = token shards)": lambda: comm.all_gather(loc, world, name),
            "all_gather dist": lambda: dist.all_gather_into_tensor(full.new_empty(world * b, s // world, h), loc),
            "all_gather literal dim 1 (+ chunk/cat)":
                lambda: torch.cat(comm.all_gather(loc, world, name).chunk(world, 0), 1),
            "reduce_scatter funcol (token shards)": lambda: comm.reduce_scatter(full.view(b * s, h), world, name),
            "reduce_scatter literal dim 1 (+ chunk/cat)":
                lambda: comm.reduce_scatter(torch.cat(full.chunk(world, 1), 0), world, name),
        }
        for k, fn in cases.items():
            rows.append(f"{kb:5d} KB  {k:45s} {_median_min(fn)}")
    sub = dist.new_group(list(range(world)))
    for label, group in (("default group", None), ("sub-group", sub)):
        def f(x, group=group):
            return comm.reduce_from_tp(comm.gather_seq(comm.split_seq(x, group), group) * 2, group)
        x = torch.randn(2, 4 * world, 8)
        t0 = time.perf_counter()
        got = torch.compile(f, fullgraph=True)(x)
        rows.append(f"compile fullgraph, {label}: {time.perf_counter() - t0:.1f} s, equal to eager: "
                    f"{torch.allclose(got, f(x), rtol=1e-6, atol=1e-6)}")
    if rank == 0:
        print(f"torch {torch.__version__}, gloo, world {world}, 1 thread per process")
        print("\n".join(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(world, port), nprocs=world)
