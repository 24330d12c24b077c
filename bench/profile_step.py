"""Where one training step's GPU time goes: torch.profiler over the trainer's real loop, summarized.

Owns bench/results/profile_<tag>.{json,md}, the kernel breakdown of a step. For each target it runs
a few warm-up iterations, records `--active` iterations with torch.profiler (CUDA activity only),
exports the Chrome trace to a temporary file and reduces it to
  * wall ms per step (first to last recorded kernel / steps) and GPU-busy ms per step (the union
    of kernel + memcpy/memset intervals): the difference is time the GPU waited for the host;
  * ms per step by category (gemm, attention, triton pointwise / reduction / persistent
    reduction, aten elementwise, embedding, memcpy, memset, other) and the top kernels by time.
Targets:
  trainer         hpcmeg.train.build.build_trainer + Trainer.run (its own choices: on CUDA bf16
                  parameters in the ParamAndGradBuffer with fp32 masters), the profiler stepped from
                  the trainer's own per-iteration callback;
  nano            the compiled nanoGPT-style anchor's step (bench/anchors_gpt2.py's Nano and loop
                  body, replicated here because the anchor's run() has no per-step hook).
Usage: python bench/profile_step.py --targets trainer,nano [--size 124M] [--tok DIR] [--set K=V ...] [--ops]
       [--no-cudagraphs]   (with --ops: which host op launches each kernel and memset, e.g. the memsets
                            before cuBLAS GEMMs that precede ~4 us idle gaps in the CUDA-graph profiles)
Writes <out>/profile_<tag>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import train_throughput as tt  # noqa: E402

# first match wins; kernel names as CUDA 12/13 + Triton 3 print them
CATEGORIES = [
    ("attention", r"flash|fmha|cudnn|sdpa|attention|attn"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|wgmma"),
    ("hpcmeg_triton", r"^_(gelu|ln|ce|sum_partials|sum_rows|keep_mask|keep_bits)"),  # hpcmeg/kernels/*.py
    ("triton_persistent_red", r"^triton_per"),
    ("triton_reduction", r"^triton_red"),
    ("triton_pointwise", r"^triton_poi"),
    ("triton_other", r"^triton"),
    ("embedding", r"embedding|index|scatter|gather|sort|radix"),
    ("aten_elementwise", r"elementwise|vectorized|unrolled|reduce_kernel|foreach|multi_tensor|adam"),
]


GAP_US = 3.0  # idle stretches shorter than this are launch latency between back-to-back kernels


def category(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return cat[4:]
    for c, pat in CATEGORIES:
        if re.search(pat, name, re.IGNORECASE):
            return c
    return "other"


def summarize(trace_path: str, steps: int) -> dict:
    with open(trace_path) as f:
        ev = json.load(f)["traceEvents"]
    ks = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ks:
        return {"error": "no GPU events in the trace"}
    ks.sort(key=lambda e: e["ts"])
    t0, t1 = ks[0]["ts"], max(e["ts"] + e["dur"] for e in ks)
    busy, cur_s, cur_e, last = 0.0, None, None, None  # union of [ts, ts+dur) intervals, microseconds
    gaps: dict[tuple, list] = {}  # (kernel before, kernel after) -> [idle us, count]: where the GPU waits
    for e in ks:
        s, d = e["ts"], e["ts"] + e["dur"]
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                if s - cur_e > GAP_US:
                    g = gaps.setdefault((last["name"][:70], e["name"][:70]), [0.0, 0])
                    g[0] += s - cur_e
                    g[1] += 1
            cur_s, cur_e, last = s, d, e
        elif d >= cur_e:
            cur_e, last = d, e
    busy += cur_e - cur_s
    by_cat: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for e in ks:
        c = category(e["name"], e["cat"])
        by_cat[c] = by_cat.get(c, 0.0) + e["dur"]
        k = by_name.setdefault(e["name"], [0.0, 0, c])
        k[0] += e["dur"]
        k[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]
    launched = _launching_ops(ev, ks)
    return {
        "steps": steps, "wall_ms_per_step": round((t1 - t0) / 1e3 / steps, 3),
        "gpu_busy_ms_per_step": round(busy / 1e3 / steps, 3),
        "kernels_per_step": round(len(ks) / steps, 1),
        "ms_per_step_by_category": {c: round(v / 1e3 / steps, 3) for c, v in sorted(by_cat.items(), key=lambda x: -x[1])},
        "idle_gaps": [{"before": k[0], "after": k[1], "ms_per_step": round(v[0] / 1e3 / steps, 3),
                       "per_step": round(v[1] / steps, 1)} for k, v in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:12]],
        "top_kernels": [{"name": n[:160], "category": v[2], "ms_per_step": round(v[0] / 1e3 / steps, 3),
                         "calls_per_step": round(v[1] / steps, 1),
                         **({"launched_by": launched[n]} if n in launched else {})} for n, v in top],
    }


def _launching_ops(ev: list, kernels: list) -> dict[str, list]:
    """kernel name -> the 3 commonest host ops (name + input shapes) that launched it, when the trace has
    CPU events (--ops): kernel args.correlation = runtime launch's; launch's args['External id'] = the
    op's. Kernels replayed from a CUDA graph have no op (their launch is cudaGraphLaunch)."""
    ops = {e["args"]["External id"]: f"{e['name']} {e['args'].get('Input Dims', '')}".strip()
           for e in ev if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    if not ops:
        return {}
    by_corr = {e["args"]["correlation"]: ops.get(e["args"].get("External id"))
               for e in ev if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    out: dict[str, dict[str, int]] = {}
    for k in kernels:
        op = by_corr.get(k.get("args", {}).get("correlation"))
        if op:
            c = out.setdefault(k["name"], {})
            c[op] = c.get(op, 0) + 1
    return {n: [f"{op} x{cnt}" for op, cnt in sorted(c.items(), key=lambda x: -x[1])[:3]] for n, c in out.items()}


def _profiler(active: int, warm: int, ops: bool = False):
    """CUDA activity only by default (least overhead); ops=True adds host ops with their input shapes,
    so summarize() can name what launched each eager kernel (the host side then runs slower)."""
    from torch.profiler import ProfilerActivity, profile, schedule
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    return profile(activities=acts, record_shapes=ops,
                   schedule=schedule(wait=0, warmup=warm, active=active, repeat=1))


def profile_trainer(size: str, data: dict, warm: int, active: int, extra: list[str] | None = None,
                    ops: bool = False) -> dict:
    L, D, H = tt.SIZES[size]
    iters = warm + active + 12  # compile + CUDA-graph recording happen in the first few iterations
    r = tt.bench_recipe(data["out"], f"prof_{size}_{int(time.time())}", data["prefix"],
                        data["vocab"], data["merge"], size=(L, D, H), iters=iters, warmup=2, extra=extra)
    prof = _profiler(active, 2, ops)
    seen = []

    def on_step(s: float) -> None:  # the trainer calls this once per iteration
        seen.append(s)
        if len(seen) == warm:
            prof.start()
        elif warm < len(seen) <= warm + 2 + active:
            prof.step()
        if len(seen) == warm + 2 + active:
            torch.cuda.synchronize()
            prof.stop()

    from hpcmeg.procenv import dist_env
    from hpcmeg.train.build import build_trainer
    trainer, ctx = build_trainer(r, dist_env(None), on_step_time=on_step)
    try:
        trainer._last_saved = trainer.config.train_iters
        trainer.run()
        trainer.metrics.close()
    finally:
        ctx.destroy()
    out = _export(prof, active)
    out["loop_ms_per_step"] = round(1e3 * sum(seen[warm + 2:warm + 2 + active]) / active, 3)
    out["optimizer"] = trainer.optimizer.name
    return out


def profile_nano(size: str, warm: int, active: int, mb: int = 12) -> dict:
    A = tt._anchor_module(size, mb, 10, vocab=tt.anchor_vocab("nano_compile"))  # nanoGPT's padded 50304
    torch.manual_seed(0)
    m = A.Nano().to("cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    fn = torch.compile(lambda x, y: m(x, torch.roll(y, -1, 1)))
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randint(0, tt.VOCAB, (mb, A.T), device="cuda", generator=gen) for _ in range(4)]  # GPT-2 ids

    def step(i):  # bench/anchors_gpt2.py run()'s step(), line for line
        x = data[i % 4]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warm):
        step(i)
    torch.cuda.synchronize()
    prof = _profiler(active, 2)
    with prof:
        for i in range(2 + active):
            step(i)
            prof.step()
        torch.cuda.synchronize()
    return _export(prof, active)


def _export(prof, active: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        return summarize(path, active)


def to_md(results: dict) -> str:
    lines = []
    for name, r in results.items():
        if "error" in r:
            lines.append(f"## {name}\n\nerror: {r['error']}\n")
            continue
        lines.append(f"## {name}\n\nwall {r['wall_ms_per_step']} ms/step, GPU busy {r['gpu_busy_ms_per_step']} ms/step, "
                     f"{r['kernels_per_step']} kernels/step" +
                     (f", trainer loop {r['loop_ms_per_step']} ms/step" if "loop_ms_per_step" in r else "") + "\n")
        lines.append("| category | ms/step |\n|---|---|")
        lines += [f"| {c} | {v} |" for c, v in r["ms_per_step_by_category"].items()]
        if r.get("idle_gaps"):
            lines.append(f"\n| GPU idle > {GAP_US} us: kernel before | kernel after | ms/step | per step |\n|---|---|---|---|")
            lines += [f"| `{g['before']}` | `{g['after']}` | {g['ms_per_step']} | {g['per_step']} |" for g in r["idle_gaps"]]
        lines.append("\n| kernel | category | ms/step | calls/step |\n|---|---|---|---|")
        lines += [f"| `{k['name'][:100]}` | {k['category']} | {k['ms_per_step']} | {k['calls_per_step']} |"
                  + (f" {'; '.join(k['launched_by'])} |" if k.get("launched_by") else "")
                  for k in r["top_kernels"][:25]]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="trainer,nano")
    ap.add_argument("--size", default="124M")
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--active", type=int, default=5)
    ap.add_argument("--tok", default=None)
    ap.add_argument("--data", default=os.path.join(ROOT, "runs", "bench-data"))
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "results")))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="recipe override for the trainer target (e.g. model.hidden_dropout=0.1 "
                         "train.global_batch_size=24: the user path's dropout and accumulation)")
    ap.add_argument("--ops", action="store_true",
                    help="trainer target: also record host ops and shapes, to name what launches each eager kernel")
    ap.add_argument("--no-cudagraphs", action="store_true",
                    help="trainer target: compile without CUDA graphs, so that --ops can name the host op behind "
                         "every kernel and memset (a replayed graph hides them); the times are then not the user's")
    a = ap.parse_args()
    if not torch.cuda.is_available():  # it profiles CUDA kernels; on a CPU it would train the model for real
        sys.exit("bench/profile_step.py: no CUDA GPU here; run it on the GPU machine (bench/lease.sh p124 ...)")
    if a.no_cudagraphs:  # the trainer's TrainStep asks this function for its compile options
        import hpcmeg.train.step as step_mod
        with_graphs = step_mod.default_cuda_compile_options
        step_mod.default_cuda_compile_options = lambda: {**with_graphs(), "triton.cudagraphs": False}
    data = None
    if any(t.startswith("trainer") for t in a.targets.split(",")):
        vocab, merge = tt.gpt2_files(a.tok)
        data = dict(out=a.data, prefix=tt.stdlib_dataset(a.data, vocab, merge), vocab=vocab, merge=merge)
    results = {}
    for t in a.targets.split(","):
        t0 = time.time()
        try:
            if t == "nano":
                results[t] = profile_nano(a.size, a.warm, a.active)
            else:
                results[t] = profile_trainer(a.size, data, a.warm, a.active, extra=a.sets, ops=a.ops)
        except Exception as ex:  # keep the other targets
            results[t] = {"error": repr(ex)[:400]}
        results[t]["seconds"] = round(time.time() - t0, 1)
        print(t, json.dumps({k: v for k, v in results[t].items() if k != "top_kernels"}), flush=True)
        tt._fresh()
    os.makedirs(a.out, exist_ok=True)
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    with open(os.path.join(a.out, f"profile_{a.tag}.json"), "w") as f:
        json.dump(dict(env=env, size=a.size, results=results), f, indent=1)
    md = f"# Step profile, {a.size}, {json.dumps(env)}\n\n" + to_md(results)
    with open(os.path.join(a.out, f"profile_{a.tag}.md"), "w") as f:
        f.write(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
