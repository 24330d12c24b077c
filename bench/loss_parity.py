"""Loss parity: hpcmeg's trainer against Hugging Face GPT2LMHeadModel on the same data and schedule.

Owns bench/results/loss_parity_<tag>.{json,png}. One process, one device:
  * hpcmeg: build_trainer + Trainer.run (bench/train_throughput.run_trainer) on the Python stdlib
    corpus (.bin/.idx from bench/train_throughput.stdlib_dataset), GPT-2 shape `--size`
    (default 124M = 12/768/12), seq 1024, micro batch = global batch `--mb`, `--steps` steps,
    cosine LR with warmup, AdamW (0.9, 0.95), wd 0.1, clip 1.0, bf16, dropout 0; validation loss
    every `--eval-interval` steps on the trainer's fixed validation batches (on CUDA: bf16
    parameters with fp32 masters in the ParamAndGradBuffer). `--hpcmeg-variants` names the runs
    (VARIANTS: the shipped defaults, and each choice a recipe still offers: attention backend,
    the cross-entropy that keeps no [tokens, vocab] gradient, a recomputed GELU layer).
  * HF: GPT2LMHeadModel(GPT2Config with the same shape, vocab 50257, dropout 0, SDPA attention),
    HF's own init, torch AdamW(fused on CUDA) over hpcmeg's param_groups rule, the SAME LR
    schedule object type (hpcmeg.megatron.lr_schedule), clip 1.0, bf16 autocast; the SAME training batches
    in the same order (TrainBatches over the trainer's GPTDataset from consumed 0) and the SAME
    validation batches and loss mask. Loss = mean token cross-entropy in fp32 (hpcmeg's labels).
JSON: {runs: {name: {val: [[iter, loss]], train: [[iter, mean loss of the last window]], step_ms}}};
PNG: validation (and train) loss against iteration. Acceptance: hpcmeg's validation loss tracks HF's
(the script prints the largest |difference| of the validation curves).
Usage: python bench/loss_parity.py --steps 200 --eval-interval 50 [--tok DIR] [--device cpu --size 2,64,4 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import train_throughput as tt  # noqa: E402  (shared helpers)
from hpcmeg.recipe import derive  # noqa: E402
from hpcmeg.train.metrics import read_metrics  # noqa: E402
from hpcmeg.train.optim import param_groups  # noqa: E402


# --hpcmeg-variants: recipe overrides per named hpcmeg run. "default" is the shipped fused path (on
# Hopper the Triton attention); the others are the choices a recipe still offers, so each one's
# numerics are checked against the same Hugging Face curve.
VARIANTS = {"default": [], "attn_triton": ["model.attention_backend=triton"],
            "attn_cudnn": ["model.attention_backend=cudnn"],
            "backward_in_forward": ["model.cross_entropy=backward_in_forward"],
            "recompute_gelu": ["model.recompute_gelu_layers=1"]}


def run_hpcmeg(r) -> dict:
    times, trainer = tt.run_trainer(r)
    m = read_metrics(os.path.join(derive(r).run_dir, "metrics.jsonl"))
    return dict(val=[[e["iteration"], e["val_loss"]] for e in m["eval"]],
                train=[[e["iteration"], e["loss"]] for e in m["train"]],
                step_ms=round(1e3 * sorted(times)[len(times) // 2], 2)), trainer


def run_hf(r, trainer, device: torch.device, log_interval: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from hpcmeg.train.data import TrainBatches
    from hpcmeg.megatron.lr_schedule import schedule_from_recipe

    m, t = r.model, r.train
    torch.manual_seed(t.seed)
    cfg = GPT2Config(n_layer=m.num_layers, n_embd=m.hidden_size, n_head=m.num_attention_heads, vocab_size=50257,
                     n_positions=r.data.seq_length, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    try:
        model.set_attn_implementation("sdpa")
    except Exception:  # older transformers: the config field decides
        model.config._attn_implementation = "sdpa"
    model.to(device).train()
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                            eps=t.adam_eps, **kw)
    d = derive(r)
    sched = schedule_from_recipe(t, t.global_batch_size, d.train_samples)
    batches = TrainBatches(trainer.train_dataset, 0, t.micro_batch_size, trainer.config.grad_accum_steps, 0, 1, device,
                           num_workers=r.data.num_workers, seed=t.seed)
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16")

    def loss_of(tokens, labels):
        with torch.autocast(**amp):
            logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot, n = 0.0, 0.0
        for tokens, labels, mask in trainer.eval_set:
            tokens, labels, mask = tokens.to(device), labels.to(device), mask.to(device)
            tot += float((loss_of(tokens, labels) * mask).sum())
            n += float(mask.sum())
        model.train()
        return tot / n

    val, train, window, times = [], [], [], []
    for it in range(1, d.train_iters + 1):
        t0 = time.perf_counter()
        sched.apply(opt)
        micro = next(batches)
        batches.prefetch()
        total = torch.zeros((), device=device)
        for tokens, labels in micro:
            loss = loss_of(tokens, labels).mean() / len(micro)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step(t.global_batch_size)
        times.append(time.perf_counter() - t0)
        window.append(float(total))  # one host sync per step, as the trainer's
        if it % log_interval == 0 or it == d.train_iters:
            train.append([it, sum(window) / len(window)])
            window = []
        if t.eval_interval and it % t.eval_interval == 0:
            val.append([it, evaluate()])
    return dict(val=val, train=train, step_ms=round(1e3 * sorted(times)[len(times) // 2], 2))


def plot(runs: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        if run.get("val"):
            axes[0].plot(*zip(*run["val"]), marker="o", label=name)
        if run.get("train"):
            axes[1].plot(*zip(*run["train"]), label=name)
    for ax, what in zip(axes, ("validation loss", "train loss (window mean)")):
        ax.set_xlabel("iteration")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    os.replace(path + ".tmp.png", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="12,768,12", help="layers,hidden,heads")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=12)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-iters", type=int, default=4)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--hpcmeg-variants", default="default", help=f"comma list of hpcmeg runs from {sorted(VARIANTS)}")
    ap.add_argument("--n-files", type=int, default=None, help="stdlib files to tokenize (default all)")
    ap.add_argument("--data", default=os.path.join(ROOT, "runs", "bench-data"))
    ap.add_argument("--tok", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "bench", "results")))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip runs that would start after this")
    a = ap.parse_args(argv)
    unknown = [v for v in a.hpcmeg_variants.split(",") if v and v not in VARIANTS]
    if unknown:
        ap.error(f"--hpcmeg-variants {unknown}: want a comma list of {sorted(VARIANTS)}")
    t_start = time.time()
    size = tuple(int(x) for x in a.size.split(","))
    vocab, merge = tt.gpt2_files(a.tok)
    prefix = tt.stdlib_dataset(a.data, vocab, merge, a.n_files)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    runs, report = {}, {}
    os.makedirs(a.out, exist_ok=True)
    jpath, ppath = (os.path.join(a.out, f"loss_parity_{a.tag}.{e}") for e in ("json", "png"))

    def save():
        report.update(config=dict(size=size, seq=a.seq, mb=a.mb, steps=a.steps, warmup=a.warmup, lr=a.lr,
                                  eval_interval=a.eval_interval, eval_iters=a.eval_iters, device=str(dev),
                                  data=os.path.basename(prefix)), runs=runs)
        with open(jpath + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(jpath + ".tmp", jpath)

    state = {"trainer": None, "recipe": None}

    def over_budget() -> bool:
        return bool(a.budget_s) and time.time() - t_start > a.budget_s

    def hf_run():
        if state["trainer"] is None or "hf_gpt2" in runs:
            return
        if over_budget():
            runs["hf_gpt2"] = dict(error="skipped: over --budget-s")
            return
        try:
            runs["hf_gpt2"] = run_hf(state["recipe"], state["trainer"], dev, a.log_interval)
        except Exception as ex:  # keep what the other runs give
            runs["hf_gpt2"] = dict(error=repr(ex)[:400])
        print("hf_gpt2", json.dumps(runs["hf_gpt2"])[:600], flush=True)
        save()

    # HF right after the first hpcmeg run (it needs that run's datasets), then the other variants
    for variant in [v for v in a.hpcmeg_variants.split(",") if v]:
        name = f"hpcmeg_{variant}"
        if over_budget():
            runs[name] = dict(error="skipped: over --budget-s")
            continue
        r = tt.bench_recipe(a.data, f"parity_{variant}_{int(time.time())}", prefix, vocab, merge, size=size,
                            seq=a.seq, mb=a.mb, iters=a.steps, lr=a.lr, warmup=a.warmup,
                            eval_interval=a.eval_interval, eval_iters=a.eval_iters, device=str(dev.type),
                            precision="bf16", extra=[f"train.log_interval={a.log_interval}", *VARIANTS[variant]])
        try:
            runs[name], trainer_v = run_hpcmeg(r)
            if state["trainer"] is None:
                state.update(trainer=trainer_v, recipe=r)
        except Exception as ex:  # keep what the other runs give
            runs[name] = dict(error=repr(ex)[:400])
        print(name, json.dumps(runs[name])[:600], flush=True)
        save()
        hf_run()
    hf = dict(runs.get("hf_gpt2", {}).get("val", []))
    for name, run in runs.items():
        if name.startswith("hpcmeg") and run.get("val") and hf:
            diffs = [v - hf[i] for i, v in run["val"] if i in hf]
            run["max_abs_val_diff_vs_hf"] = round(max(abs(x) for x in diffs), 4) if diffs else None
            run["final_val_diff_vs_hf"] = round(diffs[-1], 4) if diffs else None
            print(f"{name}: max |val - hf| {run['max_abs_val_diff_vs_hf']}, final {run['final_val_diff_vs_hf']}")
    save()
    try:
        plot(runs, ppath, f"GPT-2 {size} on the Python stdlib: hpcmeg vs HF ({dev.type})")
    except Exception as ex:
        print("plot failed:", repr(ex), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
