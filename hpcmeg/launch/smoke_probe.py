"""`hpcmeg smoke-probe RUN`: what one rank of `hpcmeg smoke`'s train step sees, run on every rank before training.

Contract: ``probe(run_dir) -> dict`` (rank, host, Python, hpcmeg and torch versions, container evidence,
CPUs, GPUs and device, an all-reduce over every rank of the step: NCCL on GPUs, gloo on CPU) written to
``<run_dir>/smoke/rank<R>.json``; ``cli_probe(args) -> 0`` prints one line of it. hpcmeg/launch/smoke.py
(the submitting side) reads those files and turns them into PASS/FAIL lines.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


def _container_evidence() -> str:
    env = os.environ
    for var, what in (("APPTAINER_CONTAINER", "apptainer image"), ("SINGULARITY_CONTAINER", "singularity image"),
                      ("FAKE_PYXIS_IMAGE", "pyxis image (the local cluster's no-op pyxis: on the host)"),
                      ("NVIDIA_PYTORCH_VERSION", "NGC PyTorch")):
        if env.get(var):
            return f"{what} {env[var]}"
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return f"no container marker; OS {line.split('=', 1)[1].strip(chr(34))}"
    except OSError:
        pass
    return "no container marker"


def probe(run_dir: str) -> dict:
    """What one rank sees; the all-reduce needs every rank of the step (hpcmeg.procenv)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hpcmeg.procenv import dist_env
    from hpcmeg.launch.provenance import fingerprint

    e = dist_env()
    fp = fingerprint()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    info = {"rank": e.rank, "world_size": e.world_size, "local_rank": e.local_rank,
            "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "python": sys.executable, "python_version": ".".join(map(str, sys.version_info[:3])),
            "hpcmeg_version": fp["version"], "hpcmeg_source": fp["source"], "torch": torch.__version__,
            "container": _container_evidence(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slurm_cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK"), "cpus_usable": affinity,
            "gpus": [], "device": "cpu"}
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = torch.cuda.device_count()
        dev = e.local_rank % n
        torch.cuda.set_device(dev)
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
        info["device"] = f"cuda:{dev}"
    backend = "nccl" if info["device"] != "cpu" else "gloo"
    t0 = time.time()
    # port + 1: the training step right after this one takes the job's port itself
    dist.init_process_group(backend, init_method=f"tcp://{e.master_addr}:{e.master_port + 1}", rank=e.rank,
                            world_size=e.world_size, timeout=timedelta(seconds=180))
    try:
        x = torch.tensor([float(e.rank + 1)], device=info["device"])
        dist.all_reduce(x)
        big = torch.ones(4 * 1024 * 1024, device=info["device"])  # 16 MiB of fp32
        dist.all_reduce(big)
        if info["device"] != "cpu":
            torch.cuda.synchronize()
        ok = float(big[0].item()) == float(e.world_size)
        info.update(backend=backend, allreduce_sum=float(x.item()),
                    allreduce_expected=e.world_size * (e.world_size + 1) / 2.0, allreduce_16mib_ok=ok,
                    allreduce_s=round(time.time() - t0, 3))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    from hpcmeg.launch.rundir import write_atomic

    out = write_atomic(Path(run_dir) / "smoke" / f"rank{e.rank}.json", json.dumps(info, indent=1) + "\n")
    info["wrote"] = str(out)
    return info


def cli_probe(args) -> int:
    info = probe(args.run)
    print(f"[smoke-probe] rank {info['rank']}/{info['world_size']} on {info['host']}: {info['device']}, "
          f"{info['backend']} all-reduce sum {info['allreduce_sum']:g} (expected {info['allreduce_expected']:g}), "
          f"wrote {info['wrote']}", flush=True)
    return 0
