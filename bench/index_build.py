"""Benchmark: GPT dataset index build time for a synthetic 1-billion-token dataset.

Only the .idx sequence lengths matter for the indices, so the dataset is a sizes array: about
1.1 M documents with log-normal lengths (median ~500, mean ~900 tokens, capped at 64k), summing to
~1e9 tokens. Times hpcmeg's vectorized numpy build (document/sample/shuffle index, split 949,50,1,
seed 1234) for several sequence lengths and epoch counts, the plain loop twin of the sample index,
Megatron's compiled C++ helper when MEGATRON_PATH points at a Megatron-LM checkout with
helpers_cpp built (optional; checks the arrays are identical), the cached reload, and blending.

Usage: python bench/index_build.py [--tokens 1e9] [--out bench/results/index_build.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hpcmeg.data import index_cache  # noqa: E402
from hpcmeg.data.blended import blending_indices, blending_indices_loop  # noqa: E402
from hpcmeg.data.gpt_dataset import (build_document_index, build_gpt_indices, build_sample_index,  # noqa: E402
                                     build_sample_index_loop, num_epochs_for, split_ranges)


def synthetic_sizes(total_tokens: float, seed: int = 0) -> np.ndarray:
    rs = np.random.RandomState(seed)
    n = int(total_tokens / 900)
    sizes = np.minimum(rs.lognormal(6.2, 1.0, size=n), 65536).astype(np.int64) + 1
    sizes = (sizes * (total_tokens / sizes.sum())).astype(np.int32) + 1  # rescale to the target total
    return sizes


def timed(fn, repeat=3):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def megatron_helpers():
    path = os.environ.get("MEGATRON_PATH")
    if not path:
        return None
    sys.path.insert(0, os.path.join(path, "megatron", "core", "datasets"))
    try:
        import helpers_cpp  # the compiled module only; no Megatron Python imported
    except ImportError:
        return None
    return helpers_cpp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=float, default=1e9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument("--blend-samples", type=int, default=28_800_000)
    ap.add_argument("--blend-loop-samples", type=int, default=2_000_000,
                    help="prefix timed with the plain loop and compared element by element")
    args = ap.parse_args(argv)
    sizes = synthetic_sizes(args.tokens)
    beg, end = split_ranges("949,50,1", len(sizes))[0]
    docs = np.arange(beg, end, dtype=np.int32)
    T = int(sizes[docs].sum(dtype=np.int64))
    cpp = megatron_helpers()
    rows = []
    for L, epochs_wanted in [(1024, 1), (2048, 1), (1024, 3.1)]:
        n_req = int(epochs_wanted * (T - 1) // L)
        t_all, idx = timed(lambda: build_gpt_indices(sizes, docs, n_req, L, 1234))
        E = num_epochs_for(T, n_req, L)
        di = idx["document_index"]
        t_si, si = timed(lambda: build_sample_index(sizes, di, L, E, T))
        t_di, _ = timed(lambda: build_document_index(docs, E, np.random.RandomState(1234), False))
        row = {"L": L, "samples": n_req, "epochs": E, "docs": len(di), "rows": si.shape[0],
               "all": t_all, "doc": t_di, "sample": t_si, "cpp": None, "loop": None, "same": None}
        if cpp is not None:
            fn = cpp.build_sample_idx_int32
            t_cpp, ref = timed(lambda: fn(sizes, di, L, E, T, True, 1))
            row["cpp"], row["same"] = t_cpp, bool(np.array_equal(ref, si))
        if not args.skip_loop and L == 1024 and E == 1:
            row["loop"], ref = timed(lambda: build_sample_index_loop(sizes, di, L, E, T), repeat=1)
            assert np.array_equal(ref, si)
        with tempfile.TemporaryDirectory() as d:
            desc = {"bench": L, "n": n_req}
            t_cold, _ = timed(lambda: index_cache.load_or_build(d, "GPTDataset", "train", desc, lambda: idx,
                                                                 list(idx)), repeat=1)
            t_hit, _ = timed(lambda: index_cache.load_or_build(d, "GPTDataset", "train", desc, lambda: 1 / 0,
                                                                list(idx)))
        row["write"], row["hit"] = t_cold, t_hit
        rows.append(row)
        print(row, flush=True)
    blends = []
    rs = np.random.RandomState(3)
    for name, w in [("0.3/0.7", [0.3, 0.7]), ("0.2/0.3/0.5", [0.2, 0.3, 0.5]),
                    ("2 random (size-proportional)", rs.dirichlet([1, 1]).tolist()),
                    ("3 random (size-proportional)", rs.dirichlet([1, 1, 1]).tolist())]:
        w = (np.array(w, np.float64) / np.sum(w)).tolist()
        t_fast, (di, dsi) = timed(lambda: blending_indices(w, args.blend_samples), repeat=1)
        m = min(args.blend_loop_samples, args.blend_samples)
        t_loop, (ri, rsi) = timed(lambda: blending_indices_loop(w, m), repeat=1)
        same = bool(np.array_equal(ri, di[:m]) and np.array_equal(rsi, dsi[:m]))
        blends.append((name, t_fast, t_loop / m, m, same))
        print(name, t_fast, t_loop / m, same, flush=True)

    lines = [
        "# GPT dataset index build (hpcmeg, vectorized numpy; no compile step)",
        "",
        f"Synthetic dataset: {len(sizes):,} sequences, {int(sizes.sum(dtype=np.int64)):,} tokens; train split of "
        f"949,50,1 = {len(docs):,} sequences, {T:,} tokens; seed 1234. Best of 3 runs, seconds.",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, numpy {np.__version__}. Command: `python bench/index_build.py`"
        + (" with MEGATRON_PATH set" if cpp is not None else "") + ".",
        "",
        "| seq len | requested samples | epochs | document_index len | hpcmeg all 3 indices | document index "
        "| sample index (numpy) | sample index Megatron C++ | identical | sample index plain loop | cache write | cache hit load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = lambda v: "-" if v is None else f"{v:.3f}"
        lines.append(f"| {r['L']} | {r['samples']:,} | {r['epochs']} | {r['docs']:,} | {f(r['all'])} | {f(r['doc'])} "
                     f"| {f(r['sample'])} | {f(r['cpp'])} | {'-' if r['same'] is None else ('yes' if r['same'] else 'NO')} "
                     f"| {f(r['loop'])} | {f(r['write'])} | {f(r['hit'])} |")
    lines += ["", f"Blending indices, {args.blend_samples:,} samples (a CodeParrot-sized train blend). `numpy` is "
              "`blending_indices` (speculated blocks, every pick re-checked in double); the plain loop is timed on "
              "a prefix and extrapolated; `identical` compares that prefix element by element.", "",
              "| weights | numpy (s) | us/sample | plain loop us/sample | plain loop extrapolated (s) | speed-up "
              "| identical (prefix) |", "|---|---|---|---|---|---|---|"]
    for name, t_fast, per_loop, m, same in blends:
        lines.append(f"| {name} | {t_fast:.2f} | {t_fast / args.blend_samples * 1e6:.3f} | {per_loop * 1e6:.2f} "
                     f"| {per_loop * args.blend_samples:.1f} | {per_loop * args.blend_samples / t_fast:.1f}x "
                     f"| {'yes' if same else 'NO'} ({m:,}) |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
