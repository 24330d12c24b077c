"""Refusing a recipe whose parallel layout differs from the checkpoint its train job would resume.

Contract (called from ``hpcmeg.launch.submit.prepare``, so ``submit`` and ``validate`` both run it
before anything is written):
- ``layout_problems(r, d) -> [line]``: [] when the train job can load what it finds; else one line
  naming the checkpoint, both layouts (recipe key names: tensor, pipeline, virtual_pipeline) and the
  two ways out: a fresh run (another ``run.name``, or another ``checkpoint.dir`` when the recipe sets
  one), or the exact ``hpcmeg reshard`` command and the ``--set`` that resumes from its output.

What is compared: the train job resumes the newest checkpoint of ``derived.checkpoint_dir``; when
that holds none it starts from ``checkpoint.load``'s weights. Either is read at the layout it was
saved with (hpcmeg.checkpoint.store refuses another tensor/pipeline size; the pipeline's model
chunks must match parallel.virtual_pipeline), so those three sizes must equal the recipe's. The
data-parallel size and parallel.distributed_optimizer may change: the optimizer state is stored
gathered over the data-parallel group (hpcmeg.checkpoint.saved_layout).

Why the suggested reshard writes a new directory beside the old one: ``hpcmeg reshard`` refuses an
existing non-empty output, and the old checkpoint stays as it was (a run can go back to it). The
resharded copy keeps the iteration, optimizer moments, schedule, RNG and sample counters, so
pointing ``checkpoint.dir`` at it resumes the run exactly where it stopped; ``checkpoint.load``
(weights only, iteration 0) is the remedy only where the recipe already starts from there.
"""
from __future__ import annotations

import os
import shlex
from typing import Optional

from hpcmeg.checkpoint.saved_layout import SavedLayout, saved_layout
from hpcmeg.recipe import Recipe, recipe_dims


def _layout_text(tp: int, pp: int, vpp: Optional[int], show_vpp: bool) -> str:
    text = f"tensor={tp} pipeline={pp}"
    return text + (f" virtual_pipeline={vpp if vpp is not None else '?'}" if show_vpp else "")


def _fits(saved: SavedLayout, tp: int, pp: int, vpp: int) -> bool:
    return (saved.tp, saved.pp) == (tp, pp) and (saved.vpp is None or saved.vpp == vpp)


def _reshard_target(src: str, tp: int, pp: int, vpp: int) -> tuple[str, bool]:
    """(directory for the resharded copy, whether it already holds this layout): '<src>-tp2-pp1'
    beside the source, or '-2', '-3', ... after it when that name is taken by something else."""
    base = f"{src.rstrip('/')}-tp{tp}-pp{pp}" + (f"-vpp{vpp}" if vpp > 1 else "")
    for k in range(1, 100):
        cand = base if k == 1 else f"{base}-{k}"
        if not os.path.exists(cand) or (os.path.isdir(cand) and not os.listdir(cand)):
            return cand, False
        try:
            have = saved_layout(cand)
        except ValueError:
            have = None
        if have is not None and _fits(have, tp, pp, vpp):
            return cand, True
    return f"{base}-new", False


def layout_problems(recipe: Recipe, derived) -> list[str]:
    """See the file header. ``r`` with absolute paths (submit.absolutize), ``d`` = derive(r)."""
    dims = recipe_dims(recipe)
    tp, pp, vpp = dims.tp, dims.pp, dims.vpp
    key, src = "checkpoint.dir", derived.checkpoint_dir
    try:
        saved = saved_layout(src)
        if saved is None and recipe.checkpoint.load:
            key, src = "checkpoint.load", recipe.checkpoint.load
            saved = saved_layout(src)
    except ValueError as e:  # a tracker that is neither a number nor 'release'
        return [f"{key}: {e}"]
    if saved is None or _fits(saved, tp, pp, vpp):
        return []
    show_vpp = vpp > 1 or (saved.vpp or 1) > 1
    have = _layout_text(saved.tp, saved.pp, saved.vpp, show_vpp)
    want = _layout_text(tp, pp, vpp, show_vpp)
    target, ready = _reshard_target(saved.dir, tp, pp, vpp)
    again = f"submit again with --set {shlex.quote(f'{key}={target}')}"
    if ready:
        reshard = f"{target} already holds it resharded to {want}: {again}"
    else:
        cmd = ["hpcmeg", "reshard", saved.dir, target, "--tp", str(tp), "--pp", str(pp)] + \
              (["--vpp", str(vpp)] if vpp > 1 else [])
        reshard = f"reshard it and resume from the copy: {shlex.join(cmd)}, then {again}"
    head = (f"{key} {saved.dir} holds iteration {saved.iteration} at {have}; this recipe asks {want}, and "
            f"training cannot resume at another tensor/pipeline layout (the data-parallel size may change)")
    if key == "checkpoint.load":
        return [f"{head}: {reshard}, or use the layout it was saved with"]
    if recipe.checkpoint.dir:  # set by the recipe: another run.name would resume the same directory
        fresh = "start a fresh run with another checkpoint.dir"
    else:
        fresh = (f"start a fresh run with another run.name "
                 f"(--set {shlex.quote(f'run.name={recipe.run.name}-tp{tp}-pp{pp}')})")
    return [f"{head}. Either {fresh}, or {reshard}"]
