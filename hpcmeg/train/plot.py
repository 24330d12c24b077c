"""`hpcmeg plot RUN`: loss (train + validation) and throughput curves of a run, to a PNG.

Contract: cli_plot(args) with args.run (a run directory holding metrics.jsonl, or the file itself)
and args.output (PNG path; default <run dir>/curves.png). Reads the JSONL written by
hpcmeg/train/metrics.py (last record per iteration wins, so resumed runs plot cleanly), draws with
matplotlib's Agg backend (no display needed), writes via a temp name + rename. `plot_run(path,
output) -> output path` is the library call. Exit 0, or 1 with one line when nothing can be drawn.
"""
from __future__ import annotations

import os
import sys

from hpcmeg.fsutil import atomic_path


def _metrics_path(run: str) -> str:
    return run if os.path.isfile(run) else os.path.join(run, "metrics.jsonl")


DEFAULT_NAME = "curves.png"
"""The PNG's name in the run directory, for `hpcmeg plot` and `hpcmeg demo` alike."""


def plot_run(run: str, output: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpcmeg.train.metrics import read_metrics

    path = _metrics_path(run)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no metrics file (has the run started training?)")
    m = read_metrics(path)
    train, evals = m["train"], m["eval"]
    if not train and not evals:
        raise ValueError(f"{path}: no train or eval records (yet); give a run directory or its metrics.jsonl")
    if output is None:
        output = os.path.join(os.path.dirname(os.path.abspath(path)), DEFAULT_NAME)
    parent = os.path.dirname(os.path.abspath(output))
    if os.path.isdir(output) or not os.path.isdir(parent):
        what = "is a directory" if os.path.isdir(output) else f"cannot be created: {parent} is not a directory"
        raise ValueError(f"{output}: {what}; give -o a PNG file path in an existing directory")
    name = os.path.basename(os.path.dirname(os.path.abspath(path)))

    fig, (ax_loss, ax_tp) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    if train:
        ax_loss.plot([r["iteration"] for r in train], [r["loss"] for r in train], label="train loss", lw=1.2)
    if evals:
        ax_loss.plot([r["iteration"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss",
                     lw=1.5, ms=4)
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.set_title(f"{name}")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    # CPU runs are not "per GPU": the start record names the device (the last start wins after a resume)
    per = "rank" if m["start"] and m["start"][-1].get("device") == "cpu" else "GPU"
    tp = [(r["iteration"], r["tokens_per_s_per_gpu"]) for r in train if r.get("tokens_per_s_per_gpu")]
    if tp:
        ax_tp.plot([i for i, _ in tp], [v for _, v in tp], color="tab:green", label=f"tokens/s per {per}")
    ax_tp.set_ylabel(f"tokens/s per {per}")
    ax_tp.set_xlabel("iteration")
    ax_tp.grid(alpha=0.3)
    mfu = [(r["iteration"], 100 * r["mfu"]) for r in train if r.get("mfu") is not None]
    if mfu:
        ax_mfu = ax_tp.twinx()
        ax_mfu.plot([i for i, _ in mfu], [v for _, v in mfu], color="tab:purple", alpha=0.6, label="MFU %")
        ax_mfu.set_ylabel("MFU (%)")
    fig.tight_layout()
    try:
        with atomic_path(output) as tmp:
            # format given: the temp name has no extension to infer it from (and PNG is what this
            # always wrote, whatever `output` ends in)
            fig.savefig(tmp, dpi=110, format="png")
    except OSError as e:  # name the file asked for, not the temporary next to it
        raise OSError(e.errno, e.strerror, output) from None
    finally:
        plt.close(fig)
    return output


def cli_plot(args) -> int:
    try:
        out = plot_run(args.run, getattr(args, "output", None))
    except (OSError, ValueError) as e:
        from hpcmeg.errors import one_line

        print(f"hpcmeg plot: {one_line(e)}", file=sys.stderr)
        return 1
    print(out)
    return 0
