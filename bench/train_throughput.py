"""GPT-2 training throughput on one GPU: hpcmeg's step against the anchors, in one process.

Owns the benchmark table of issue 4 point 5. For each size (124M = 12/768/12, 355M = 24/1024/16;
seq 1024, micro batch 12, bf16, vocab 50257 padded to 50304 for hpcmeg) it runs
  * hpcmeg variants: GPT(fused=True) + build_optimizer + TrainStep, one micro batch per
    optimizer step like the anchors (fwd + bwd + clip + AdamW + the one host sync per step);
  * the anchors of bench/anchors_gpt2.py (a verbatim copy of ../shared/bench/anchors_gpt2.py),
    imported with LDH/MB/STEPS set, so their numbers come from the same GPU and process.
Prints one table: tokens/s, MFU (6N + 12*L*d*T FLOPs/token against the bf16 matmul peak measured
here), peak memory, ratio to each anchor. Writes <out>/train_throughput_<tag>.{json,md}.

TODO(integrator): swap `_ours` for the trainer's real step (data loader included) once it exists.
Usage: python bench/train_throughput.py --sizes 124M --variants compile,compile_cg --anchors nano_compile
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

from hpcmeg.model.config import GPTConfig, pad_vocab_size  # noqa: E402
from hpcmeg.model.flops import flops_per_token, measure_bf16_peak  # noqa: E402
from hpcmeg.model.gpt import GPT  # noqa: E402
from hpcmeg.train.optim import build_optimizer  # noqa: E402
from hpcmeg.train.step import TrainStep  # noqa: E402

SIZES = {"124M": (12, 768, 12), "355M": (24, 1024, 16)}
SEQ, VOCAB = 1024, 50257
CG = {"triton.cudagraphs": True}
CD = {"coordinate_descent_tuning": True}
# name -> TrainStep/GPTConfig knobs (defaults: compile on, no CUDA graphs, bf16 residual, cuDNN attn)
VARIANTS = {
    "eager": dict(compile=False),
    "compile": dict(),
    "compile_cg": dict(options=CG),
    "compile_cg_cd": dict(options={**CG, **CD}),
    "compile_cd": dict(options=CD),
    "compile_cg_fp32res": dict(options=CG, fp32_res=True),
    "compile_fp32res": dict(fp32_res=True),
    "compile_flash": dict(attn="flash"),
    "compile_cg_chunkce": dict(options=CG, ce="chunked"),
    "compile_cg_bf16params": dict(options=CG, bf16_params=True),  # speed bound only: bf16 Adam states
}


def _ours(size: str, variant: str, mb: int, steps: int, warmup: int) -> dict:
    L, D, H = SIZES[size]
    v = VARIANTS[variant]
    bf16p = v.get("bf16_params", False)
    cfg = GPTConfig(L, D, H, 4 * D, SEQ, pad_vocab_size(VOCAB), hidden_dropout=0.0,
                    attention_dropout=0.0, fused=True, attention_backend=v.get("attn", "auto"),
                    fused_ce=v.get("ce", "compiled"), fp32_residual_connection=v.get("fp32_res", False))
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    if bf16p:
        model = model.to(torch.bfloat16)
    opt, impl = build_optimizer(model, 3e-4, weight_decay=0.1)
    step = TrainStep(model, opt, "fp32" if bf16p else "bf16", grad_clip=1.0, compile=v.get("compile", True),
                     device="cuda", compile_options=v.get("options"))
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
    for i in range(steps):
        r = step.run([data[i % 4]])
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    n = model.num_params()
    toks = mb * SEQ / dt
    return dict(variant=f"hpcmeg_{variant}", micro_batch=mb, params_M=round(n / 1e6, 1),
                step_ms=round(dt * 1e3, 2), tokens_per_s=round(toks),
                tflops=round(toks * flops_per_token(n, L, D, SEQ) / 1e12, 1),
                peak_mem_GB=round(torch.cuda.max_memory_allocated() / 1e9, 2), loss=round(r.loss, 3),
                optimizer=impl, warmup_s=round(compile_s, 1))


def _anchor_module(size: str, mb: int, steps: int):
    L, D, H = SIZES[size]
    os.environ.update(LDH=f"{L},{D},{H}", MB=str(mb), STEPS=str(steps))
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
    ap.add_argument("--variants", default="compile,compile_cg", help="hpcmeg variants and a:ANCHOR entries, in run order")
    ap.add_argument("--anchors", default="hf_eager,hf_sdpa,hf_compile,nano_compile")
    ap.add_argument("--mb", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "results")))
    ap.add_argument("--tag", default="h200")
    a = ap.parse_args()
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
        anchors = _anchor_module(size, a.mb, a.steps) if any(i.startswith("a:") for i in items) else None
        for item in items:
            try:
                rows.append(anchors.run(item[2:]) if item.startswith("a:") else
                            _ours(size, item, a.mb, a.steps, a.warmup))
            except Exception as ex:  # keep the other variants' numbers
                rows.append(dict(variant=item, error=repr(ex)[:400]))
            print(json.dumps(rows[-1]), flush=True)
            _fresh()
            _write(a.out, a.tag, report, "\n".join(md + [f"## {size}\n\n{table(rows, peak)}\n"]))
        md.append(f"## {size}\n\n{table(rows, peak)}\n")
        print(f"\n{size}\n{table(rows, peak)}\n", flush=True)
        _write(a.out, a.tag, report, "\n".join(md))


def _write(out: str, tag: str, report: dict, md: str) -> None:
    os.makedirs(out, exist_ok=True)
    for ext, text in (("json", json.dumps(report, indent=1)), ("md", md)):
        path = os.path.join(out, f"train_throughput_{tag}.{ext}")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
