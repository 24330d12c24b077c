"""hpcmeg/kernels/layernorm.py on the GPU: agreement with its twin, and its time against the
way Inductor computes the same backward today, at the model sizes' LayerNorm shapes.

Shapes (tokens x hidden, bf16 activations, fp32 LN weight): 12288 x 768 (124M), 12288 x 1024 (355M),
8192 x 2048 (1.3B), micro batches as trained.
Agreement (fresh random inputs; keep = rand > 0.1, scale = 1 / 0.9): the op's bf16 kernels against
the twin in fp32 on the same bf16 values, ||a - b|| / ||b|| of dx, d_branch, dw, db, dbias, with
(d_res, keep) and without; the Inductor baseline against the twin too; and whether two calls of the
op give bit-identical outputs (the partial sums have a fixed order).
Time (triton.testing.do_bench_cudagraph: median of CUDA-graph replays, as the compiled model runs
under CUDA graphs; plain do_bench timed mostly the ops' Python launch), per shape:
  ours_full   torch.ops.hpcmeg.layer_norm_backward(dy, x, w, eps, d_res, keep, scale): both kernels
  ours_plain  the same without d_res and keep (a plain LayerNorm backward: dx, dw, db)
  ind_full    torch.compile'd aten.native_layer_norm_backward (mean/rstd from native_layer_norm,
              computed outside the timed region as autograd saves them) + the residual add, the
              mask multiply and the three column sums: what Inductor generates for the model now
  ind_plain   the compiled native_layer_norm_backward alone
  ours_full_graph  ours_full replayed in a CUDA graph (do_bench_cudagraph, no L2 flush), as the
              model runs it under CUDA graphs (no launch gap between the two kernels)
  and TB/s = the bytes that must cross HBM (reads dy, x [, d_res, keep], writes dx [, d_branch]) / time.
Then, while the time budget lasts, a few other triton_layernorm.Launch settings (rows per iteration,
warps, programs per SM, prefetch) on the full variant at each shape.
Usage: python bench/dev/layernorm_probe.py [--shapes 12288x768,...] [--no-sweep] [--budget 35]
Writes $OUT/layernorm_probe.json (OUT defaults to '.'); prints a table last. ~30-50 s on the H200,
most of it compiling (Inductor: 6 graphs, Triton: ~12 kernels, more with the sweep).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hpcmeg.kernels import layernorm as tln  # noqa: E402

SHAPES = "12288x768,12288x1024,8192x2048"
EPS = 1e-5
P_DROP = 0.1
SCALE = 1.0 / (1.0 - P_DROP)
# Launch settings tried besides the default (the default's reasoning is in triton_layernorm's docstring)
SWEEP = (
    tln.Launch(prefetch=False),
    tln.Launch(programs_per_sm=5),           # at H <= 1024: 20 warps per SM (96 registers: 5 fit)
    tln.Launch(rows=2),                      # R = 2: 8 warps at H = 768, 2 programs per SM
    tln.Launch(rows=1, warps=8, programs_per_sm=4),  # 4 elements per thread at H <= 1024
    tln.Launch(rows=4),                      # R = 4: 16 warps at H = 768, one program per SM
)
AGREE_TOL = {"dx": 1e-2, "d_branch": 1e-2, "dw": 1e-4, "db": 1e-4, "dbias": 1e-4}  # bf16 outputs; fp32 sums
NAMES = ("dx", "d_branch", "dw", "db", "dbias")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(n: int, h: int, seed: int, device: str = "cuda") -> dict:
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g)
    return dict(dy=randn(n, h).bfloat16(), x=(randn(n, h) * 2 + 0.3).bfloat16(), d_res=randn(n, h).bfloat16(),
                keep=torch.rand(n, h, device=device, generator=g) > P_DROP,
                w=1 + 0.1 * randn(h), b=0.1 * randn(h))


def saved_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mean, rstd [N, 1] fp32 as autograd saves them from the forward (independent of w, b)."""
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], None, None, EPS)
    return mean, rstd


def inductor_full(dy, x, mean, rstd, w, b, d_res, keep, scale: float):
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])
    dx = dx + d_res
    d_branch = dx * keep * scale
    return dx, d_branch, dw, db, d_branch.sum(0, dtype=torch.float32)


def inductor_plain(dy, x, mean, rstd, w, b):
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])


def hbm_bytes(inp: dict, full: bool) -> int:
    """Bytes that must cross HBM: read dy, x (+ d_res, keep), write dx (+ d_branch)."""
    e = inp["dy"].numel()
    per = 3 * inp["dy"].element_size() + (inp["d_res"].element_size() + 1 + inp["dy"].element_size() if full else 0)
    return e * per


def agreement(inp: dict, compiled: dict) -> dict:
    dy, x, w, d_res, keep = inp["dy"], inp["x"], inp["w"], inp["d_res"], inp["keep"]
    out = {}
    for tag, r, k in (("full", d_res, keep), ("plain", None, None)):
        got = torch.ops.hpcmeg.layer_norm_backward(dy, x, w, EPS, r, k, SCALE if k is not None else 1.0)
        want = tln.reference_backward(dy.float(), x.float(), w, EPS, None if r is None else r.float(), k,
                                      SCALE if k is not None else 1.0)
        errs = {nm: rel(g, v) for nm, g, v in zip(NAMES, got, want) if v.numel()}
        again = torch.ops.hpcmeg.layer_norm_backward(dy, x, w, EPS, r, k, SCALE if k is not None else 1.0)
        errs["deterministic"] = all(torch.equal(a, b) for a, b in zip(got, again))
        errs["ok"] = errs["deterministic"] and all(errs[nm] < AGREE_TOL[nm] for nm in NAMES if nm in errs)
        out[f"ours_{tag}"] = errs
    mean, rstd = saved_stats(x)
    ind = compiled["full"](dy, x, mean, rstd, w, inp["b"], d_res, keep, SCALE)
    want = tln.reference_backward(dy.float(), x.float(), w, EPS, d_res.float(), keep, SCALE)
    out["inductor_full"] = {nm: rel(g, v) for nm, g, v in zip(NAMES, ind, want)}
    return out


def timings(inp: dict, compiled: dict) -> dict:
    from triton.testing import do_bench, do_bench_cudagraph
    dy, x, w, b, d_res, keep = (inp[k] for k in ("dy", "x", "w", "b", "d_res", "keep"))
    mean, rstd = saved_stats(x)
    op = torch.ops.hpcmeg.layer_norm_backward
    fns = {
        "ours_full": lambda: op(dy, x, w, EPS, d_res, keep, SCALE),
        "ours_plain": lambda: op(dy, x, w, EPS, None, None, 1.0),
        "ind_full": lambda: compiled["full"](dy, x, mean, rstd, w, b, d_res, keep, SCALE),
        "ind_plain": lambda: compiled["plain"](dy, x, mean, rstd, w, b),
    }
    us = {}
    for k, f in fns.items():  # graph replays, as the model runs them (do_bench alone timed the Python)
        try:
            us[k] = do_bench_cudagraph(f, rep=50, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001  (a capture problem should not lose the other numbers)
            print(f"  do_bench_cudagraph {k} failed: {type(e).__name__}: {e}", flush=True)
            us[k] = do_bench(f, warmup=10, rep=50, return_mode="median") * 1e3
    us["ours_full_graph"] = us["ours_full"]
    return us


def sweep(inp: dict) -> list[dict]:
    from triton.testing import do_bench_cudagraph
    dy, x, w, d_res, keep = (inp[k] for k in ("dy", "x", "w", "d_res", "keep"))
    n, h = dy.shape
    rows = []
    for launch in (tln.DEFAULT_LAUNCH, *SWEEP):
        p = tln.plan(n, h, dy.device, launch)
        row = dict(launch=dataclasses.asdict(launch), plan=dataclasses.asdict(p))
        try:  # e.g. R = 4 at H = 2048 asks for 16 warps x 16 elements per thread: spills, but runs
            t = do_bench_cudagraph(lambda: tln.layer_norm_backward(dy, x, w, EPS, d_res, keep, SCALE, launch=launch),
                                   rep=50, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001  (one bad setting should not lose the others)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"  sweep {n}x{h} {launch}: {row['error']}", flush=True)
        else:
            row.update(us=round(t, 2), tbps=round(hbm_bytes(inp, True) / t / 1e6, 3))
            print(f"  sweep {n}x{h} {launch}: {t:.1f} us", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shapes", default=SHAPES, help="comma list of NxH (default: %(default)s)")
    ap.add_argument("--no-sweep", action="store_true", help="only the default Launch")
    ap.add_argument("--budget", type=float, default=35.0, help="seconds after which the sweep is skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where layernorm_probe.json goes ($OUT)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("layernorm_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    compiled = {"full": torch.compile(inductor_full, dynamic=False),
                "plain": torch.compile(inductor_plain, dynamic=False)}
    import triton
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  eps=EPS, scale=SCALE, results=[], sweep=[])
    path = os.path.join(a.out, "layernorm_probe.json")
    os.makedirs(a.out, exist_ok=True)

    def save():
        report["wall_s"] = round(time.time() - t0, 1)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)

    inputs = {}
    for i, (n, h) in enumerate(shapes):
        inp = inputs[(n, h)] = make_inputs(n, h, seed=10 + i)
        agree = agreement(inp, compiled)
        us = timings(inp, compiled)
        tbps = {k: (round(hbm_bytes(inp, "full" in k) / v / 1e6, 3) if v else None) for k, v in us.items()}
        report["results"].append(dict(shape=[n, h], plan=dataclasses.asdict(tln.plan(n, h, inp["dy"].device)),
                                      hbm_mb_full=hbm_bytes(inp, True) / 1e6, hbm_mb_plain=hbm_bytes(inp, False) / 1e6,
                                      agreement=agree, us={k: (round(v, 2) if v else None) for k, v in us.items()},
                                      tbps=tbps))
        print(f"{n}x{h} agreement {json.dumps(agree)}", flush=True)
        save()
    if not a.no_sweep:
        for n, h in shapes:
            if time.time() - t0 > a.budget:
                print(f"sweep skipped from {n}x{h} on: {time.time() - t0:.0f} s > --budget {a.budget}", flush=True)
                break
            report["sweep"].append(dict(shape=[n, h], rows=sweep(inputs[(n, h)])))
            save()
    save()
    print_table(report)
    print(f"wrote {path} ({report['wall_s']} s)")
    return 0 if all(r["agreement"][k]["ok"] for r in report["results"] for k in ("ours_full", "ours_plain")) else 1


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, torch {report['torch']}, triton {report['triton']}; times in us (TB/s)")
    print(f"{'shape':>12} {'ours_full':>14} {'ind_full':>14} {'speedup':>8} {'graph':>8} "
          f"{'ours_plain':>14} {'ind_plain':>14} {'speedup':>8}  agreement")
    for r in report["results"]:
        us, tb = r["us"], r["tbps"]
        ok = all(r["agreement"][k]["ok"] for k in ("ours_full", "ours_plain"))
        worst = max(v for k in ("ours_full", "ours_plain") for nm, v in r["agreement"][k].items()
                    if nm in AGREE_TOL)
        graph = f"{us['ours_full_graph']:.1f}" if us.get("ours_full_graph") else "-"
        print(f"{'x'.join(map(str, r['shape'])):>12} "
              f"{us['ours_full']:7.1f} ({tb['ours_full']:.2f}) {us['ind_full']:7.1f} ({tb['ind_full']:.2f}) "
              f"{us['ind_full'] / us['ours_full']:7.2f}x {graph:>8} "
              f"{us['ours_plain']:7.1f} ({tb['ours_plain']:.2f}) {us['ind_plain']:7.1f} ({tb['ind_plain']:.2f}) "
              f"{us['ind_plain'] / us['ours_plain']:7.2f}x  {'ok' if ok else 'FAIL'} (worst rel {worst:.1e})")
    for s in report["sweep"]:
        timed = [r for r in s["rows"] if "us" in r]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["us"])
        print(f"sweep {'x'.join(map(str, s['shape']))}: default {s['rows'][0].get('us', '-')} us, "
              f"best {best['us']:.1f} us with {best['launch']}")


if __name__ == "__main__":
    sys.exit(main())
