"""What the smoke test's jobs left behind, read back on the submitting side of `hpcmeg smoke`.

Contract (readers only; hpcmeg/launch/smoke.py turns their answers into PASS/FAIL lines):
``probe_results(run) -> [dict]`` the ranks' ``smoke/rank<R>.json`` files (written by
hpcmeg/launch/smoke_probe.py on every rank of the train step); ``describe_ranks(ranks, gpus_per_node)
-> (ok, text)`` the devices-per-rank verdict; ``first_loss_line(run)`` the first training line with a
loss; ``last_log_line(paths)`` the last meaningful line of the newest log, to show with a FAIL;
``checkpoint_detail(ckpt_dir, iters)`` where the checkpoint is; ``load_converted(hf_dir) -> (ok, text)``
the converted model loaded with ``AutoModelForCausalLM`` and run once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def probe_results(run) -> list[dict]:
    """The ranks' probe files that could be read, in file-name order."""
    out = []
    for path in sorted((run.root / "smoke").glob("rank*.json")):
        try:
            rank = json.loads(path.read_text())
        except (OSError, ValueError):  # a rank still writing it, or never done
            continue
        if rank:
            out.append(rank)
    return out


def last_log_line(paths: list[Path]) -> str:
    """The last meaningful line of the newest log (what to show with a FAIL)."""
    for p in sorted(paths, key=lambda q: q.stat().st_mtime if q.exists() else 0, reverse=True):
        try:
            lines = [ln.strip() for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            continue
        for ln in reversed(lines):
            if not ln.startswith(("=====", "[hpcmeg supervisor] step:", "submitit", "Traceback")):
                return f"{ln[:300]} ({p})"
    return "no log written"


def first_loss_line(run) -> Optional[str]:
    for p in sorted(run.logs("train").glob("train.*.0.log")):
        try:
            for ln in p.read_text(errors="replace").splitlines():
                if ln.lstrip().startswith("iteration") and "| loss " in ln:
                    return ln.strip()
        except OSError:
            continue
    return None


def describe_ranks(ranks: list[dict], gpus_per_node: int) -> tuple[bool, str]:
    """The devices-per-rank verdict: every rank got its own GPU, or CPU ranks when none were asked for."""
    if gpus_per_node <= 0:
        cpus = sorted({str(rank.get("cpus_usable")) for rank in ranks})
        per = sorted({str(rank.get("slurm_cpus_per_task")) for rank in ranks})
        return True, (f"CPU ranks: {len(ranks)} rank(s), no GPUs requested (cluster.gpus_per_node 0); "
                      f"--cpus-per-task {'/'.join(per)}, cores usable per rank {'/'.join(cpus)}")
    bad = [rank for rank in ranks if not rank.get("gpus")]
    if bad:
        return False, (f"rank(s) {', '.join(str(rank['rank']) for rank in bad)} see no GPU (CUDA_VISIBLE_DEVICES="
                       f"{bad[0].get('cuda_visible_devices')}, torch {bad[0].get('torch')}): check --gpus-per-node, "
                       f"the image's CUDA torch and, with Apptainer, --nv")
    devs = [(rank.get("host"), rank.get("device")) for rank in ranks]
    dup = len(set(devs)) != len(devs)
    names = sorted({n for rank in ranks for n in rank["gpus"]})
    text = "; ".join(f"rank {rank['rank']} {rank['device']}" for rank in sorted(ranks, key=lambda x: x["rank"]))
    return not dup, (f"{text} ({', '.join(names)}, CUDA_VISIBLE_DEVICES={ranks[0].get('cuda_visible_devices')})"
                     + ("; two ranks share a GPU" if dup else ""))


def checkpoint_detail(ckpt_dir: str, iters: int) -> str:
    from hpcmeg.megatron.names import latest_iteration

    return f"checkpoint at iteration {latest_iteration(ckpt_dir)}/{iters}"


def load_converted(hf_dir: Path) -> tuple[bool, str]:
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one line per check: no progress bars in between
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
        with torch.no_grad():
            logits = model(torch.tensor([[15496, 995, 198]])).logits
        n = sum(p.numel() for p in model.parameters())
        ok = bool(torch.isfinite(logits).all())
        return ok, (f"{hf_dir}: {type(model).__name__}, {n / 1e6:.1f} M parameters, "
                    f"logits {'finite' if ok else 'NOT finite'}")
    except Exception as e:  # noqa: BLE001 - any failure to load is the check's answer
        return False, f"{hf_dir}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
