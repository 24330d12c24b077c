"""Where `hpcmeg preprocess` spends its time: CPU seconds per stage on the stdlib corpus.

Each stage runs alone in this process (or, for interpreter start and imports, in a fresh child),
timed by CPU time (time.process_time / getrusage), not wall time, so that other load on a shared
host inflates the numbers less; the median of --repeat runs is reported. Stages: interpreter start,
the imports of `import hpcmeg.data.preprocess`, building the GPT-2 tokenizer (vocab.json,
merges.txt, tiktoken), reading the input as line batches, JSON parsing and validation
(parse_document), tokenizing with tiktoken's fast split pattern, encode_batch (parse + tokenize + arrays, what a worker does), and writing the
.bin/.idx. Then the CLI end to end with --workers N, whose CPU beyond the sum of the stages is the
price of the worker processes (fork, pickling batches and results through sockets). Last, the fast
split pattern against GPT-2's plain one, the two encoders alternating document by document so that
load changes on the host hit both alike.

Usage: python bench/preprocess_stages.py [--workdir /tmp/hpcmeg_ppstages] [--repeat 3] [--workers 2]
       [--out bench/results/preprocess_stages]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from hpcmeg.data import indexed  # noqa: E402
from hpcmeg.data.corpus import write_stdlib_corpus  # noqa: E402
from hpcmeg.data.jsonl import iter_line_batches, parse_document  # noqa: E402
from hpcmeg.data.preprocess import PreprocessConfig, encode_batch  # noqa: E402
from hpcmeg.data.tokenizer import GPT2_SPLIT_PATTERN, TiktokenBPE, default_gpt2_files  # noqa: E402


def _cpu() -> float:
    return time.process_time()


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _run_child(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall s, CPU s of the child and the processes it waited for)."""
    c0, t0 = _child_cpu(), time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0, _child_cpu() - c0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/hpcmeg_ppstages")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "preprocess_stages"))
    args = ap.parse_args(argv)

    os.makedirs(args.workdir, exist_ok=True)
    corpus = os.path.join(args.workdir, "stdlib.jsonl")
    stats = write_stdlib_corpus(corpus, key="content", include_tests=True)
    vocab, merges = default_gpt2_files()
    env = dict({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, PYTHONPATH=REPO)
    py = sys.executable
    cfg = PreprocessConfig(json_keys=("content",), append_eod=True, vocab_file=vocab, merge_file=merges)
    fast = TiktokenBPE(vocab, merges)
    plain = TiktokenBPE(vocab, merges, split_pattern=GPT2_SPLIT_PATTERN)
    batches = list(iter_line_batches([corpus], cfg.batch_bytes))
    docs = [parse_document(line, cfg.json_keys)[0]["content"] for b in batches for line in b.data.splitlines()]
    results = [encode_batch(b, cfg, fast, None, np.uint16) for b in batches]
    tokens = sum(int(r["keys"]["content"][0].size) for r in results)

    def stage_read():
        for _ in iter_line_batches([corpus], cfg.batch_bytes):
            pass

    def stage_parse():
        for b in batches:
            for line in b.data.splitlines():
                parse_document(line, cfg.json_keys)

    def stage_write():
        prefix = os.path.join(args.workdir, "stage_write")
        w = indexed.IndexedDatasetBuilder(indexed.data_file_path(prefix), np.uint16)
        for r in results:
            w.add_documents(*r["keys"]["content"])
        w.finalize(indexed.index_file_path(prefix))

    in_process = {
        "tokenizer build (vocab.json + merges.txt checks, tiktoken)": lambda: TiktokenBPE(vocab, merges),
        f"read input as {cfg.batch_bytes >> 10} KB line batches": stage_read,
        "JSON parse + validation (parse_document)": stage_parse,
        "tokenize: tiktoken, GPT2_SPLIT_PATTERN_FAST (used)": lambda: [fast.encode_np(d) for d in docs],
        "encode_batch (parse + tokenize + arrays: a worker's work)":
            lambda: [encode_batch(b, cfg, fast, None, np.uint16) for b in batches],
        "write .bin/.idx (IndexedDatasetBuilder)": stage_write,
    }
    times: dict[str, list] = {k: [] for k in ["interpreter start (python -c pass)",
                                              "imports of hpcmeg.data.preprocess"] + list(in_process)}
    e2e = []
    hp_cmd = [py, "-m", "hpcmeg.data.preprocess_cli", "--input", corpus, "--output-prefix",
              os.path.join(args.workdir, "e2e"), "--vocab-file", vocab, "--merge-file", merges,
              "--json-keys", "content", "--append-eod", "--workers", str(args.workers), "--quiet"]
    for _ in range(args.repeat):
        base = _run_child([py, "-c", "pass"], env)[1]
        times["interpreter start (python -c pass)"].append(base)
        times["imports of hpcmeg.data.preprocess"].append(
            _run_child([py, "-c", "import hpcmeg.data.preprocess"], env)[1] - base)
        for name, fn in in_process.items():
            c0 = _cpu()
            fn()
            times[name].append(_cpu() - c0)
        e2e.append(_run_child(hp_cmd, env))
    # the two split patterns, interleaved document by document so that load changes hit both alike
    pattern_cpu = {"fast": 0.0, "plain": 0.0}
    for _ in range(args.repeat):
        for d in docs:
            for name, tok in (("fast", fast), ("plain", plain)):
                c0 = _cpu()
                tok.encode_np(d)
                pattern_cpu[name] += _cpu() - c0
    med = {k: statistics.median(v) for k, v in times.items()}
    used = [k for k in med if not k.startswith(("JSON", "tokenize"))]
    stage_sum = sum(med[k] for k in used)
    wall, cpu = statistics.median(w for w, _ in e2e), statistics.median(c for _, c in e2e)
    loads = os.getloadavg()
    result = {"corpus": {"files": stats.files, "source_mb": stats.bytes / 1e6, "tokens": tokens},
              "stages_cpu_s": med, "all_runs_cpu_s": times, "stage_sum_cpu_s": stage_sum,
              "e2e": {"workers": args.workers, "wall_s": wall, "cpu_s": cpu, "runs": e2e},
              "load_1min_at_end": loads[0], "cpus": os.cpu_count(), "python": platform.python_version(),
              "hpcmeg_commit": subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                              capture_output=True, text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    lines = ["# Where `hpcmeg preprocess` spends its time (stdlib corpus)", "",
             f"Date {result['date']}, hpcmeg {result['hpcmeg_commit']}, Python {result['python']}, "
             f"{result['cpus']} CPUs (load average {loads[0]:.1f} at the end). Corpus: {stats.files} files, "
             f"{stats.bytes / 1e6:.1f} MB, {tokens / 1e6:.2f} M GPT-2 tokens. CPU seconds, median of {args.repeat}.", "",
             "| stage | CPU s | share of the end-to-end CPU |", "|---|---|---|"]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.3f} | {100 * v / cpu:.0f}% |")
    fast_s, plain_s = pattern_cpu["fast"] / args.repeat, pattern_cpu["plain"] / args.repeat
    result["split_patterns_cpu_s"] = {"GPT2_SPLIT_PATTERN_FAST": fast_s, "GPT2_SPLIT_PATTERN": plain_s}
    lines += ["", f"Split regex, the two tiktoken encoders interleaved document by document (mean of {args.repeat}): "
              f"GPT2_SPLIT_PATTERN_FAST {fast_s:.2f} s, GPT-2's plain GPT2_SPLIT_PATTERN {plain_s:.2f} s "
              f"({100 * (1 - fast_s / plain_s):.0f}% less with the fast one; same ids)."]
    lines += ["", f"End to end, `hpcmeg preprocess --workers {args.workers}` (median): wall {wall:.2f} s, CPU {cpu:.2f} s; "
              f"the stages it runs sum to {stage_sum:.2f} s, so the worker processes (fork, batches and results "
              f"pickled through sockets, waiting) cost about {cpu - stage_sum:.2f} s of CPU.", "",
              "Command: `python bench/preprocess_stages.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
