"""Activation recompute on one GPU: peak memory and tokens/s of each setting, and the largest model
each setting trains.

Each row builds one rank the way `hpcmeg train` does (hpcmeg/train/rank_model.py: rank_model,
rank_optimizer, rank_step; bf16 parameters with fp32 masters, the fused path, gradient-accumulation
fusion, torch.compile as the product runs it at DP 1), trains random tokens (vocabulary 50304, ids
< 50257) with dropout 0.1 for --warm steps, then times --steps steps; peak memory is CUDA's maximum
allocated over the whole row, warm-up included. A row that runs out of memory says so. Settings
(model.recompute_granularity / _method / _num_layers): none, selective, full (uniform groups of 1
layer), plus --extra ones as 'full:block:N' or 'full:uniform:N'.

    python bench/recompute_memory.py --sizes 1.3B,2.7B --seq 1024,2048 --mb 8 --accum 2
    python bench/recompute_memory.py --largest --seq 2048 --mb 1    # the largest size each setting trains
CPU check (tests/test_recompute_memory.py): --device cpu --sizes 2x64x4 --seq 32 --mb 2 --steps 1 --warm 0
Writes recompute_memory_<tag>.{json,md} into --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hpcmeg.fsutil import atomic_path  # noqa: E402
from hpcmeg.megatron.parallel_dims import ParallelDims  # noqa: E402
from hpcmeg.model.config import GPTConfig  # noqa: E402
from hpcmeg.parallel.context import context_for  # noqa: E402
from hpcmeg.train.build import attention_backend_for  # noqa: E402
from hpcmeg.train.optim import AdamWConfig  # noqa: E402
from hpcmeg.train.rank_model import rank_model, rank_optimizer, rank_step  # noqa: E402

SIZES = {"1.3B": (24, 2048, 16), "2.7B": (32, 2560, 32), "3.3B": (40, 2560, 32), "4.1B": (36, 3072, 32),
         "5.2B": (44, 3072, 32)}
LARGEST = ["2.7B", "3.3B", "4.1B", "5.2B"]
SETTINGS = {"none": (None, None, None), "selective": ("selective", None, None), "full": ("full", "uniform", 1)}


def parse_size(s: str) -> tuple[int, int, int]:
    if s in SIZES:
        return SIZES[s]
    layers, hidden, heads = (int(x) for x in s.split("x"))
    return layers, hidden, heads


def parse_setting(s: str) -> tuple:
    if s in SETTINGS:
        return SETTINGS[s]
    granularity, method, n = s.split(":")
    return granularity, method, int(n)


def run_row(size: str, seq: int, setting: str, mb: int, accum: int, steps: int, warm: int, device: str) -> dict:
    layers, hidden, heads = parse_size(size)
    granularity, method, n = parse_setting(setting)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    cfg = GPTConfig(layers, hidden, heads, 4 * hidden, seq, 50304, vocab_size=50257, hidden_dropout=0.1,
                    attention_dropout=0.1, fused=cuda, recompute_granularity=granularity,
                    recompute_method=method, recompute_num_layers=n,
                    attention_backend=attention_backend_for("auto", dev, "bf16" if cuda else "fp32"))
    row = {"size": size, "seq": seq, "setting": setting, "micro": mb, "accum": accum}
    dims = ParallelDims(1)
    ctx = context_for(dims, 0, 0, dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        model, plan, _ = rank_model(cfg, dims, ctx, 1234, dev)
        dtype = torch.bfloat16 if cuda else torch.float32
        buf, opt = rank_optimizer(model, plan, ctx, AdamWConfig(1e-4), param_dtype=dtype, grad_dtype=torch.float32,
                                  wgrad_fusion=cuda)
        step = rank_step(model, buf, opt, dims, ctx, micro_batch=mb, seq_length=seq, act_dtype=dtype,
                         precision="bf16" if cuda else "fp32", compile=cuda, device=dev)
        g = torch.Generator().manual_seed(0)
        batches = [(x[:, :-1].contiguous(), x[:, 1:].contiguous())
                   for x in (torch.randint(0, 50257, (mb, seq + 1), generator=g) for _ in range(accum))]
        for _ in range(warm):
            step.run(batches)
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step.run(batches).loss
        if cuda:
            torch.cuda.synchronize(dev)
        secs = time.perf_counter() - t0
        row.update(tokens_per_s=round(steps * accum * mb * seq / secs), step_ms=round(1e3 * secs / steps, 1),
                   loss=round(loss, 3), n_params=sum(p.numel() for p in model.parameters()))
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    finally:
        if cuda:
            row["peak_mem_GB"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
        model = buf = opt = step = None  # noqa: F841  (free the row's memory before the next one)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| size | seq | recompute | micro x accum | tokens/s | step ms | peak mem GB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = r.get("error") or f"{r['tokens_per_s']:,}"
        lines.append(f"| {r['size']} | {r['seq']} | {r['setting']} | {r['micro']} x {r['accum']} | {speed} | "
                     f"{r.get('step_ms', '')} | {r.get('peak_mem_GB', '')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1.3B,2.7B", help=f"names ({', '.join(SIZES)}) or LxDxH")
    ap.add_argument("--seq", default="1024,2048")
    ap.add_argument("--settings", default="none,selective,full")
    ap.add_argument("--extra", default="", help="more settings, e.g. full:block:8")
    ap.add_argument("--largest", action="store_true", help=f"for each setting, the sizes {LARGEST} in order "
                    "until one runs out of memory")
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "results")))
    a = ap.parse_args()
    settings = a.settings.split(",") + [s for s in a.extra.split(",") if s]
    rows = []
    for seq in (int(s) for s in a.seq.split(",")):
        for setting in settings:
            for size in (LARGEST if a.largest else a.sizes.split(",")):
                row = run_row(size, seq, setting, a.mb, a.accum, a.steps, a.warm, a.device)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if a.largest and "error" in row:
                    break
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"recompute_memory_{a.tag}")
    md = f"# Activation recompute on one GPU\n\n`python bench/recompute_memory.py {' '.join(sys.argv[1:])}`\n\n{table(rows)}\n"
    for path, text in ((base + ".json", json.dumps(rows, indent=1)), (base + ".md", md)):
        with atomic_path(path) as tmp, open(tmp, "w") as f:
            f.write(text)
    print(table(rows))


if __name__ == "__main__":
    main()
