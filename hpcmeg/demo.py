"""``hpcmeg demo``: the whole pipeline on the embedded default, on any machine, in minutes.

Writes the running Python's standard library as a CodeParrot-like JSONL corpus, then runs
``recipes/codeparrot_tiny.yaml`` through the same ``hpcmeg submit`` path users take: on the local
Slurm cluster when one answers (``slurm/local-cluster.sh start``), else with the no-Slurm ``local``
profile. preprocess -> train (2 ranks) -> convert; then it loads the converted model with
``AutoModelForCausalLM``, prints a generated code completion (labelled as what a ~7 M-parameter model
trained for minutes produces), draws the curves to ``curves.png`` (the name ``hpcmeg plot`` uses) and
writes ``summary.md`` (tokens/s, losses, where everything is) into the run directory.

The chain is followed on the console as it runs (hpcmeg.launch.watch: stage transitions, the
training lines with elapsed time and ETA, preprocessing percent and ETA; never 15 s without a line).
A re-run finds a finished chain (``finished_run``: markers + outputs + the same recipe) and says
there is nothing to do in seconds; over an unfinished one (a failed or cancelled train, a changed
recipe) it says first what it skips and where training resumes (``earlier_attempt``); ``--force``
deletes the demo's run directory and starts over.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

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
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its weight-loading bar would be the only stderr output of a good run

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


def _trained(train: list[dict], starts: list[dict]) -> tuple[float | None, float | None]:
    """(parameters, training wall seconds) from metrics.jsonl records (None when unknown)."""
    n = next((st.get("n_params") for st in reversed(starts) if st.get("n_params")), None)
    secs = None
    if starts and train and train[-1].get("time") and starts[0].get("time"):
        secs = float(train[-1]["time"]) - float(starts[0]["time"])
    return n, secs


def sample_label(n_params: float | None, train_s: float | None, tokens: int | None) -> str:
    """What the generated sample is: what a tiny model trained for minutes produces, not a code model."""
    size = f"~{n_params / 1e6:.0f} M-parameter" if n_params else "tiny"
    took = (f" for {train_s:.0f} seconds" if train_s < 90 else f" for {train_s / 60:.0f} minutes") if train_s else ""
    seen = f" on {tokens / 1e3:,.0f} K tokens" if tokens else ""
    return (f"what a {size} model trained{took}{seen} of the standard library produces: Python-looking keywords, "
            f"indentation and stdlib names, not working code (that takes a model like "
            f"recipes/codeparrot_small.yaml on a GPU cluster)")


def summarize(run_dir: Path, model_dir: Path | None, completion: str | None, png: str | None, elapsed_s: float,
              tokens: int | None = None) -> str:
    from hpcmeg.train.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    m = read_metrics(str(path)) if path.exists() else {"train": [], "eval": [], "start": []}
    train, val = m["train"], m["eval"]
    tps = [r.get("tokens_per_s_per_gpu") for r in train[1:]]  # the first interval includes start-up
    tps = [t for t in tps if t]
    n_params, train_s = _trained(train, m.get("start", []))
    lines = [f"# hpcmeg demo: {run_dir.name}", "",
             f"- wall time (whole pipeline): {elapsed_s:.0f} s"]
    if n_params:
        lines += [f"- model: {n_params / 1e6:.1f} M parameters" + (f", trained for {train_s:.0f} s" if train_s else "")]
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
        lines += [f"- loss and throughput curves: {png} (the same file `hpcmeg plot {run_dir}` writes)"]
    if completion is not None:
        lines += ["", "Generated completion (sampled: temperature 0.7, top-k 40, 48 tokens). This is "
                  + sample_label(n_params, train_s, tokens) + ":", "", "```python", completion, "```"]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _heartbeat(what: str, every_s: float = 10.0) -> Iterator[None]:
    """A '[demo] still <what>' line every ``every_s`` while the body runs (model loading can take a while)."""
    stop = threading.Event()
    t0 = time.time()

    def beat() -> None:
        while not stop.wait(every_s):
            print(f"[demo] still {what} ({time.time() - t0:.0f} s)", flush=True)

    th = threading.Thread(target=beat, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def finished_run(prep) -> str | None:
    """A one-line account of the finished chain ``prep``'s run directory already holds, or None.

    Finished means: the recorded recipe makes the same products (data, model, train, parallel,
    checkpoint, convert sections), the dataset matches its inputs (manifest), the train and convert
    markers say done and nothing of the run is queued, the checkpoint is at train_iters, and the
    converted model and summary.md exist."""
    import yaml

    from hpcmeg.launch.rundir import marker_state, read_markers
    from hpcmeg.launch.slurm_chain import active_jobs
    from hpcmeg.megatron.names import latest_iteration
    from hpcmeg.recipe import to_dict

    run, recipe, derived = prep.run, prep.recipe, prep.derived
    if not (run.jobs.is_file() and run.recipe.is_file() and (run.root / "summary.md").is_file()):
        return None
    try:
        stored = yaml.safe_load(run.recipe.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    cur = to_dict(recipe)
    if any(stored.get(k) != cur.get(k) for k in ("data", "model", "train", "parallel", "checkpoint", "convert")):
        return None
    markers = read_markers(run)
    if not prep.skip_preprocess or any(marker_state(markers.get(s, {})) != "COMPLETED" for s in ("train", "convert")):
        return None
    it = latest_iteration(derived.checkpoint_dir)
    model = Path(recipe.convert.output_dir or run.root / "hf") / f"iter_{it or 0:07d}"
    if it != derived.train_iters or not all((model / f).is_file() for f in ("config.json", "model.safetensors")):
        return None
    if active_jobs(run):
        return None
    return (f"preprocess, train (iteration {it}/{derived.train_iters}) and convert ({model.relative_to(run.root)}) "
            f"are done for this recipe")


def earlier_attempt(prep) -> str | None:
    """One line on what a re-run does with an unfinished earlier attempt in ``prep``'s run directory
    (a failed or cancelled train, a changed recipe), or None when there is none: which stages are
    skipped, where training resumes, and how the last train job ended, so a re-run never resubmits
    jobs without saying why."""
    import yaml

    from hpcmeg.launch.rundir import marker_state, read_markers
    from hpcmeg.megatron.names import latest_iteration
    from hpcmeg.recipe import to_dict

    run, recipe, derived = prep.run, prep.recipe, prep.derived
    it = latest_iteration(derived.checkpoint_dir)
    if not run.jobs.is_file() and it is None:
        return None
    parts = [] if recipe.data.data_path else \
        ["preprocess is skipped (the dataset matches its inputs)" if prep.skip_preprocess else "preprocess runs"]
    last = marker_state(read_markers(run).get("train", {}))
    ended = f" (its last train job: {last})" if last not in ("UNKNOWN", "COMPLETED") else ""
    if it is None:
        parts.append(f"train starts from scratch{ended}")
    elif it < derived.train_iters:
        parts.append(f"train resumes from its checkpoint at iteration {it}/{derived.train_iters}{ended}")
    else:
        parts.append(f"train is done (checkpoint at iteration {it}/{derived.train_iters}; the job only confirms it)")
    parts.append("convert runs")
    stored = {}
    if run.recipe.is_file():
        try:
            stored = yaml.safe_load(run.recipe.read_text()) or {}
        except (OSError, yaml.YAMLError):
            pass  # unreadable: nothing to compare, the submission rewrites it
    cur = to_dict(recipe)
    changed = [k for k in ("data", "model", "train", "parallel", "checkpoint", "convert")
               if stored and stored.get(k) != cur.get(k)]
    why = f"; the recipe's {', '.join(changed)} section(s) differ from its recipe.yaml" if changed else ""
    return f"{run.root} holds an unfinished earlier attempt{why}: {', '.join(parts)}"


def _remove_run(run_dir: Path) -> str | None:
    """--force: delete an earlier demo run directory (error line if it is not one, or still running)."""
    from hpcmeg.launch.rundir import RunDir
    from hpcmeg.launch.slurm_chain import active_jobs

    if not run_dir.exists():
        return None
    if not ((run_dir / "jobs.json").exists() or (run_dir / "recipe.yaml").exists()):
        return f"--force: {run_dir} is not a run directory hpcmeg wrote (no jobs.json, no recipe.yaml); not removing it"
    busy = active_jobs(RunDir(run_dir))
    if busy:
        return (f"--force: {run_dir} still has jobs in the queue ({', '.join(busy)}); "
                f"run 'hpcmeg cancel {run_dir}' first")
    shutil.rmtree(run_dir)
    print(f"[demo] --force: removed the earlier run directory {run_dir} (the corpus is kept)", flush=True)
    return None


def run_demo(output_root: str = "runs", profile: str | None = None, force: bool = False,
             overrides: list[str] | None = None) -> int:
    """The demo (see the module docstring); ``overrides`` are extra ``--set`` values for the recipe."""
    from hpcmeg.launch.submit import ALL_STAGES, cli_submit

    t0 = time.time()
    root = Path(output_root).resolve()
    corpus = root / "corpus" / "stdlib.jsonl"
    if not corpus.exists() and not _write_corpus(corpus):
        return 1
    profile = profile or ("local-slurm" if slurm_is_up() else "local")
    overrides = [f"run.output_root={root}", f"data.inputs=[{corpus}]", *(overrides or [])]
    recipe = load_recipe(RECIPE, overrides, profile)
    derived = derive(recipe)
    run_dir = Path(derived.run_dir)
    if force:
        err = _remove_run(run_dir)
        if err:
            print(f"hpcmeg demo: {err}", file=sys.stderr)
            return 1
    else:
        done = _finished_or_resumed(recipe, run_dir)
        if done is not None:
            return done
    print(f"[demo] profile {profile}: preprocess -> train ({derived.world_size} ranks) -> convert; run dir {run_dir}",
          flush=True)
    args = argparse.Namespace(recipe=str(RECIPE), overrides=overrides, profile=profile, dry_run=False,
                              stages=",".join(ALL_STAGES), wait=True)
    rc = cli_submit(args)  # the failing stage's one-line cause is already on stderr
    sys.stdout.flush()
    if rc != 0:
        return rc
    return _show_results(recipe, derived, t0)


def _write_corpus(corpus: Path) -> bool:
    """The standard library as JSONL at ``corpus``; False (with one line on stderr) where it cannot be written."""
    from hpcmeg.data.corpus import write_stdlib_corpus

    # without the test suites: 12 MB of code is plenty for 200 tiny steps and tokenizes in seconds
    print(f"[demo] writing the Python standard library as JSONL to {corpus}", flush=True)
    try:
        write_stdlib_corpus(str(corpus), key="content", include_tests=False)
    except OSError as e:
        print(f"hpcmeg demo: cannot write {corpus}: {e.strerror or e}; choose a writable --output-root",
              file=sys.stderr)
        return False
    return True


def _finished_or_resumed(recipe, run_dir: Path) -> int | None:
    """Without --force: exit 0 with its summary where ``run_dir`` already holds this recipe's finished run;
    else say what a re-run does with an unfinished earlier attempt, and go on (None)."""
    from hpcmeg.launch.submit import ALL_STAGES, prepare

    prep = prepare(recipe, ALL_STAGES)
    done = finished_run(prep)
    if done:
        print(f"[demo] nothing to do: {run_dir} already holds a finished run ({done}); its summary follows. "
              f"To run it again from scratch, add --force to the same command (hpcmeg demo --force)", flush=True)
        print((run_dir / "summary.md").read_text(), end="", flush=True)
        return 0
    again = earlier_attempt(prep)
    if again:
        print(f"[demo] {again}. To start over from scratch instead, add --force (hpcmeg demo --force)", flush=True)
    return None


def _show_results(recipe, derived, t0: float) -> int:
    """After the chain: sample from the converted model, draw the curves, write and print summary.md."""
    from hpcmeg.train.metrics import read_metrics

    run_dir = Path(derived.run_dir)
    hf_root = Path(recipe.convert.output_dir or run_dir / "hf")
    models = sorted(p for p in hf_root.glob("iter_*") if (p / "config.json").exists())
    if not models:
        print(f"hpcmeg demo: no converted model under {hf_root} although every stage completed; "
              f"see: hpcmeg logs {run_dir} --stage convert", file=sys.stderr)
        return 1
    model_dir = models[-1]
    print(f"[demo] loading {model_dir} with AutoModelForCausalLM and sampling 48 tokens", flush=True)
    with _heartbeat("loading the model and sampling"):
        completion = generate(model_dir)
    metrics_path = run_dir / "metrics.jsonl"
    metrics = read_metrics(str(metrics_path)) if metrics_path.exists() else {"train": [], "start": []}
    n_params, train_s = _trained(metrics["train"], metrics.get("start", []))
    tokens = derived.train_iters * derived.tokens_per_iteration
    print(f"[demo] generated completion ({sample_label(n_params, train_s, tokens)}):\n" + completion, flush=True)
    png = None
    try:
        from hpcmeg.train.plot import plot_run

        with _heartbeat("drawing the curves"):
            png = plot_run(str(run_dir))  # the default name: the same file `hpcmeg plot RUN` writes
    except Exception as e:  # noqa: BLE001 - a missing plot must not hide the rest of the summary
        print(f"[demo] could not draw the loss curve: {e}", flush=True)
    text = summarize(run_dir, model_dir, completion, png, time.time() - t0, tokens)
    write_text_atomic(run_dir / "summary.md", text)
    print(text, flush=True)
    return 0


def cli_demo(args: argparse.Namespace) -> int:
    return run_demo(args.output_root, args.profile, bool(getattr(args, "force", False)),
                    list(getattr(args, "overrides", None) or []))
