"""Data-parallel scaling on one host: hpcmeg's trainer vs a DDP + compiled nanoGPT-style baseline.

Owns bench/results/scaling_<tag>.{json,md}. For each size (--sizes: 124M, 355M or
L,D,H) and each process count n in --gpus, it starts `torchrun --standalone --nproc_per_node n
bench/scaling.py --worker ...` once per kind:
  * hpcmeg: build_trainer + Trainer.run (bench/train_throughput.run_trainer) with rank detection
    from hpcmeg.procenv, exactly as `hpcmeg train` under torchrun: DDP over NCCL (gloo on CPU),
    micro batch --mb per rank, global batch mb x n (no accumulation), stdlib .bin/.idx data;
  * nano: bench/anchors_gpt2.py's Nano model (same shapes, vocabulary 50304 as nanoGPT's
    GPTConfig default, token ids < 50257), DistributedDataParallel, torch.compile
    (CUDA only), fused AdamW, bf16 autocast, random tokens; same micro batch per rank.
Per row: tokens/s (all ranks), tokens/s per GPU, MFU (6N + 12*L*d*T FLOPs/token against the bf16
peak measured on rank 0 / a 1,000 TFLOP/s nominal on CPU = n/a), scaling efficiency = (tokens/s per
GPU at n) / (at 1). Also prints the gradient all-reduce volume per step on paper: ring all-reduce
sends 2(n-1)/n x gradient bytes per GPU (fp32 grads: 4 bytes/param), and that time at --link-GBps
(NVLink per-GPU bus bandwidth, an assumption stated in the table) against the 1-GPU step time.
Keeps NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1) in every worker's environment.
Usage: python bench/scaling.py --gpus 1,2,4,8 --sizes 124M,355M [--kinds hpcmeg,nano] [--tok DIR]
CPU check (tests/test_scaling_bench.py): --device cpu --gpus 1,2 --sizes 2x64x4 --seq 64 --mb 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

SIZES = {"124M": (12, 768, 12), "355M": (24, 1024, 16)}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_size(s: str) -> tuple[int, int, int]:
    """'124M' | '355M' | 'LxDxH' (e.g. 2x64x4) | 'L,D,H' (the worker's form)."""
    return SIZES[s] if s in SIZES else tuple(int(x) for x in s.replace("x", ",").split(","))


def allreduce_table(sizes: dict[str, int], ns: list[int], step_s: dict[str, float], link_gbps: float,
                    grad_bytes: int = 4) -> str:
    """Ring all-reduce bytes per GPU per step, and their time at link_gbps, vs the 1-GPU step."""
    lines = [f"| size | params | n | bytes sent per GPU per step | time at {link_gbps:.0f} GB/s | 1-GPU step | ratio |",
             "|---|---|---|---|---|---|---|"]
    for name, n_params in sizes.items():
        for n in ns:
            if n < 2:
                continue
            vol = 2 * (n - 1) / n * n_params * grad_bytes
            t = vol / (link_gbps * 1e9)
            st = step_s.get(name)
            lines.append(f"| {name} | {n_params / 1e6:.1f} M | {n} | {vol / 1e6:.0f} MB | {t * 1e3:.2f} ms | "
                         f"{f'{st * 1e3:.1f} ms' if st else 'n/a'} | {f'{t / st:.1%}' if st else 'n/a'} |")
    return "\n".join(lines)


# ---- worker (one rank) ----------------------------------------------------------------------

def _worker_hpcmeg(a, size) -> dict:
    import train_throughput as tt
    from hpcmeg.procenv import dist_env
    env = dist_env()
    r = tt.bench_recipe(a.data, f"scale_{a.kind}_{'_'.join(map(str, size))}_n{env.world_size}_{a.run_id}",
                        a.prefix, a.vocab, a.merge, size=size, seq=a.seq, mb=a.mb, gbs=a.mb * env.world_size,
                        iters=a.warmup + a.steps, warmup=max(1, (a.warmup + a.steps) // 4), device=a.device,
                        precision=a.precision)
    times, trainer = tt.run_trainer(r)
    return dict(step_s=sum(times[a.warmup:]) / a.steps, n_params=trainer.model.num_params(), world=env.world_size,
                rank=env.rank)


def _worker_nano(a, size) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from hpcmeg.procenv import dist_env
    L, D, H = size
    import nano_anchor
    os.environ.update(LDH=f"{L},{D},{H}", MB=str(a.mb), VOCAB=str(nano_anchor.NANOGPT_VOCAB))  # nanoGPT's padded default
    import anchors_gpt2 as an
    env = dist_env()
    cuda = a.device != "cpu" and torch.cuda.is_available()
    dev = torch.device(f"cuda:{env.local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if env.world_size > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size, timeout=datetime.timedelta(minutes=10))
    try:
        torch.manual_seed(0)
        model = an.Nano().to(dev)
        n_params = sum(p.numel() for p in model.parameters())
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if cuda else None) \
            if env.world_size > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **({"fused": True} if cuda else {}))
        fwd = torch.compile(ddp) if cuda else ddp
        gen = torch.Generator(device=dev).manual_seed(1 + env.rank)
        data = [torch.randint(0, nano_anchor.GPT2_VOCAB, (a.mb, a.seq), device=dev, generator=gen)  # ids < 50257
                for _ in range(4)]

        def step(i):
            x = data[i % 4]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = fwd(x, torch.roll(x, -1, 1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for i in range(a.warmup):
            step(i)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(a.steps):
            loss = step(i)
        float(loss.detach())
        if cuda:
            torch.cuda.synchronize()
        return dict(step_s=(time.perf_counter() - t0) / a.steps, n_params=n_params, world=env.world_size,
                    rank=env.rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker(a) -> int:
    size = parse_size(a.size)
    res = (_worker_hpcmeg if a.kind == "hpcmeg" else _worker_nano)(a, size)
    if res["rank"] == 0:
        with open(a.result + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(a.result + ".tmp", a.result)
    return 0


# ---- launcher --------------------------------------------------------------------------------

def _peak(device: str) -> float | None:
    import torch
    if device == "cpu" or not torch.cuda.is_available():
        return None
    from hpcmeg.model.flops import measure_bf16_peak
    return measure_bf16_peak()


def launch(a) -> int:
    import train_throughput as tt
    from hpcmeg.model.flops import flops_per_token
    t_start = time.time()
    vocab, merge = tt.gpt2_files(a.tok)
    prefix = tt.stdlib_dataset(a.data, vocab, merge, a.n_files)
    peak = _peak(a.device)
    ns = [int(x) for x in a.gpus.split(",")]
    if a.device != "cpu":
        import torch
        have = torch.cuda.device_count()
        skipped = [n for n in ns if n > have]
        ns = [n for n in ns if n <= have]
        if skipped:
            print(f"scaling: {have} GPU(s) here; skipping n={skipped}", flush=True)
    rows, step1 = [], {}
    os.makedirs(a.out, exist_ok=True)
    run_id = str(int(time.time()))
    for size_name in a.sizes.split(","):
        size = parse_size(size_name)
        for kind in a.kinds.split(","):
            for n in ns:
                row = dict(size=size_name, kind=kind, n=n)
                if a.budget_s and time.time() - t_start > a.budget_s:
                    rows.append({**row, "error": "skipped: over --budget-s"})
                    continue
                result = os.path.join(a.data, f"scaling_{run_id}_{kind}_{size_name}_{n}.json")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                       os.path.abspath(__file__), "--worker", "--kind", kind, "--size", ",".join(map(str, size)),
                       "--seq", str(a.seq), "--mb", str(a.mb), "--steps", str(a.steps), "--warmup", str(a.warmup),
                       "--device", a.device, "--precision", a.precision, "--data", a.data, "--prefix", prefix,
                       "--vocab", vocab, "--merge", merge, "--result", result, "--run-id", run_id]
                env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
                if a.device == "cpu":
                    env.setdefault("OMP_NUM_THREADS", "1")
                t0 = time.time()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=a.timeout_s if a.timeout_s else None)
                if proc.returncode != 0 or not os.path.exists(result):
                    err = [ln for ln in (proc.stderr + proc.stdout).splitlines()
                           if "Error" in ln or "error" in ln][:3]  # the workers' exceptions, not torchrun's summary
                    tail = " | ".join(err)[-600:] or (proc.stderr or proc.stdout or "")[-600:]
                    rows.append({**row, "error": f"exit {proc.returncode}: {tail}"})
                else:
                    res = json.load(open(result))
                    toks = a.mb * a.seq * n / res["step_s"]
                    fpt = flops_per_token(res["n_params"], size[0], size[1], a.seq)
                    rows.append({**row, "step_ms": round(res["step_s"] * 1e3, 2), "tokens_per_s": round(toks),
                                 "tokens_per_s_per_gpu": round(toks / n), "n_params": res["n_params"],
                                 "mfu_pct": round(100 * toks / n * fpt / peak, 1) if peak else None,
                                 "wall_s": round(time.time() - t0, 1)})
                    if n == 1:
                        step1.setdefault(size_name, res["step_s"])
                base = next((r for r in rows if r["size"] == size_name and r["kind"] == kind and r["n"] == 1
                             and "tokens_per_s" in r), None)
                if base and "tokens_per_s" in rows[-1]:
                    rows[-1]["scaling_eff"] = round(rows[-1]["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)
                print(json.dumps(rows[-1]), flush=True)
                _write(a, rows, peak, step1, ns)
    _write(a, rows, peak, step1, ns)
    return 0 if all("tokens_per_s" in r for r in rows) else 1


def _write(a, rows, peak, step1, ns) -> None:
    n_params = {r["size"]: r["n_params"] for r in rows if "n_params" in r}
    ar = allreduce_table(n_params, sorted(set(ns) | {2, 4, 8}), step1, a.link_gbps)
    md = [f"# DP scaling ({a.device}; bf16 peak {peak / 1e12:.0f} TFLOP/s)" if peak else f"# DP scaling ({a.device})",
          "", "| size | kind | n | tokens/s | tokens/s/GPU | MFU % | scaling eff | step ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "tokens_per_s" in r:
            md.append(f"| {r['size']} | {r['kind']} | {r['n']} | {r['tokens_per_s']:,} | {r['tokens_per_s_per_gpu']:,} | "
                      f"{r['mfu_pct']} | {r.get('scaling_eff', 'n/a')} | {r['step_ms']} |")
        else:
            md.append(f"| {r['size']} | {r['kind']} | {r['n']} | error: {r['error'][:150]!r} |")
    md += ["", "Gradient all-reduce on paper (ring, fp32 grads):", "", ar, ""]
    text = "\n".join(md)
    for ext, body in (("json", json.dumps(dict(rows=rows, peak_tflops=peak / 1e12 if peak else None,
                                                  link_GBps=a.link_gbps), indent=1)), ("md", text)):
        path = os.path.join(a.out, f"scaling_{a.tag}.{ext}")
        with open(path + ".tmp", "w") as f:
            f.write(body)
        os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="hpcmeg")
    ap.add_argument("--size", default="124M")
    ap.add_argument("--prefix"), ap.add_argument("--vocab"), ap.add_argument("--merge")
    ap.add_argument("--result"), ap.add_argument("--run-id", default="0")
    ap.add_argument("--gpus", default="1,2,4,8")
    ap.add_argument("--sizes", default="124M,355M")
    ap.add_argument("--kinds", default="hpcmeg,nano")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--n-files", type=int, default=None)
    ap.add_argument("--link-GBps", dest="link_gbps", type=float, default=450.0,
                    help="assumed per-GPU all-reduce bus bandwidth for the on-paper table (H200 NVLink 4: ~450 GB/s one way)")
    ap.add_argument("--data", default=os.path.join(ROOT, "runs", "bench-data"))
    ap.add_argument("--tok", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "results")))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--timeout-s", type=float, default=0.0, help="per torchrun launch")
    a = ap.parse_args(argv)
    return worker(a) if a.worker else launch(a)


if __name__ == "__main__":
    sys.exit(main())
