"""``hpcmeg demo``: the whole pipeline on the embedded default, on any machine, in minutes.

Writes the running Python's standard library as a CodeParrot-like JSONL corpus, then runs
``recipes/codeparrot_tiny.yaml`` through the same ``hpcmeg submit`` path users take: on the local
Slurm cluster when one answers (``slurm/local-cluster.sh start``), else with the no-Slurm ``local``
profile. preprocess -> train (2 ranks) -> convert; then it loads the converted model with
``AutoModelForCausalLM``, prints a generated code completion, draws the loss curve to a PNG and
writes ``summary.md`` (tokens/s, losses, where everything is) into the run directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpcmeg.fsutil import write_text_atomic
from hpcmeg.recipe import derive, load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "codeparrot_tiny.yaml"
PROMPT = "import os\n\n\ndef read_file(path):\n"


def slurm_is_up() -> bool:
    if not shutil.which("scontrol"):
        return False
    r = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return r.returncode == 0 and "is UP" in r.stdout


def generate(model_dir: Path, prompt: str = PROMPT, max_new_tokens: int = 48) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    torch.manual_seed(0)  # sampled, but the same text every run
    # a tiny model decoded greedily tends to repeat whitespace; light sampling with a repetition
    # penalty shows better what it learned (keywords, indentation, identifiers from the stdlib)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.7, top_k=40,
                             repetition_penalty=1.3, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0], skip_special_tokens=True)


def summarize(run_dir: Path, model_dir: Path | None, completion: str | None, png: str | None, elapsed_s: float) -> str:
    from hpcmeg.train.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    m = read_metrics(str(path)) if path.exists() else {"train": [], "eval": []}
    train, val = m["train"], m["eval"]
    tps = [r.get("tokens_per_s_per_gpu") for r in train[1:]]  # the first interval includes start-up
    tps = [t for t in tps if t]
    lines = [f"# hpcmeg demo: {run_dir.name}", "",
             f"- wall time (whole pipeline): {elapsed_s:.0f} s"]
    if train:
        lines += [f"- training loss: {train[0]['loss']:.3f} at step {train[0].get('iteration')} -> "
                  f"{train[-1]['loss']:.3f} at step {train[-1].get('iteration')}"]
    if val:
        lines += [f"- validation loss: {val[0]['val_loss']:.3f} -> {val[-1]['val_loss']:.3f}"]
    if tps:
        lines += [f"- throughput: {sum(tps) / len(tps):,.0f} tokens/s per rank (mean of logged intervals)"]
    lines += ["", "Where everything is:",
              f"- run directory: {run_dir}",
              f"- resolved recipe: {run_dir / 'recipe.yaml'}",
              f"- metrics: {run_dir / 'metrics.jsonl'}",
              f"- checkpoints: {run_dir / 'checkpoints'}"]
    if model_dir:
        lines += [f"- Hugging Face model: {model_dir}"]
    if png:
        lines += [f"- loss curve: {png}"]
    if completion is not None:
        lines += ["", "Generated completion (sampled: temperature 0.7, top-k 40, 48 tokens):", "", "```python", completion, "```"]
    return "\n".join(lines) + "\n"


def run_demo(output_root: str = "runs", profile: str | None = None) -> int:
    t0 = time.time()
    root = Path(output_root).resolve()
    corpus = root / "corpus" / "stdlib.jsonl"
    if not corpus.exists():
        from hpcmeg.data.corpus import write_stdlib_corpus

        # without the test suites: 12 MB of code is plenty for 200 tiny steps and tokenizes in seconds
        print(f"[demo] writing the Python standard library as JSONL to {corpus}", flush=True)
        write_stdlib_corpus(str(corpus), key="content", include_tests=False)
    profile = profile or ("local-slurm" if slurm_is_up() else "local")
    overrides = [f"run.output_root={root}", f"data.inputs=[{corpus}]"]
    r = load_recipe(RECIPE, overrides, profile)
    d = derive(r)
    run_dir = Path(d.run_dir)
    print(f"[demo] profile {profile}: preprocess -> train ({d.world_size} ranks) -> convert; run dir {run_dir}", flush=True)
    cmd = [sys.executable, "-m", "hpcmeg.cli", "submit", str(RECIPE), "--profile", profile, "--wait",
           *[a for o in overrides for a in ("--set", o)]]
    rc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    if rc != 0:
        print(f"[demo] the pipeline failed (exit {rc}); see: hpcmeg logs {run_dir}", file=sys.stderr)
        return rc
    hf_root = Path(r.convert.output_dir or run_dir / "hf")
    models = sorted(p for p in hf_root.glob("iter_*") if (p / "config.json").exists())
    model_dir = models[-1] if models else None
    completion = None
    if model_dir:
        completion = generate(model_dir)
        print("[demo] generated completion:\n" + completion, flush=True)
    else:
        print(f"[demo] no converted model under {hf_root}", file=sys.stderr)
    png = None
    try:
        from hpcmeg.train.plot import plot_run

        png = plot_run(str(run_dir), str(run_dir / "loss_curve.png"))
    except Exception as e:  # noqa: BLE001 - a missing plot must not hide the rest of the summary
        print(f"[demo] could not draw the loss curve: {e}", file=sys.stderr)
    text = summarize(run_dir, model_dir, completion, png, time.time() - t0)
    write_text_atomic(run_dir / "summary.md", text)
    print(text, flush=True)
    return 0 if model_dir else 1


def cli_demo(args: argparse.Namespace) -> int:
    return run_demo(args.output_root, args.profile)
