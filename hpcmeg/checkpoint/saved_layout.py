"""The parallel layout a checkpoint directory was saved with, read without loading its tensors.

Contract
- ``saved_layout(ckpt_dir) -> SavedLayout | None``: the iteration the trainer would resume from
  ``ckpt_dir`` (the newest one with shard files not newer than the tracker
  latest_checkpointed_iteration.txt, or ``release``; without a tracker the newest of all, as
  hpcmeg.checkpoint.store.load_checkpoint does), with its tensor/pipeline sizes and model chunks per
  stage. None when the directory holds no checkpoint (absent, empty): the trainer starts fresh there.
  ValueError names the tracker when its content is neither a number nor ``release`` (the trainer
  would refuse it too).

Where each size comes from: tp and pp from hpcmeg_manifest.json when the iteration has one (hpcmeg
wrote it), else from the ``mp_rank_TT[_PPP]`` directory names (a Megatron-LM checkpoint); the model
chunks per pipeline stage (virtual pipeline) from the keys of one shard ("model", or "model0" ..
"model{V-1}"), loaded with mmap so only its pickle is read, never its tensors; at pipeline size 1
there is one chunk and nothing is opened (no torch import: validate stays quick). A shard that cannot
be read leaves ``vpp`` None (unknown): the trainer's loader reports an unreadable shard itself, with
its fallback to an older iteration. The data-parallel size is not part of a layout: the optimizer
is stored gathered over the data-parallel group (with the distributed optimizer too), so a run
resumes at any DP size.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Union

from hpcmeg.megatron.args import checkpoint_models
from hpcmeg.megatron.names import (MANIFEST_FILENAME, SHARD_FILENAME, iter_dirname, parse_shard_dirname,
                                   read_tracker, resume_candidates)


@dataclass(frozen=True)
class SavedLayout:
    dir: str
    """The checkpoint directory (absolute)."""
    iteration: Union[int, str]
    """The iteration read (an int, or "release")."""
    tp: int
    pp: int
    vpp: Optional[int]
    """Model chunks per pipeline stage (1 = no interleaving); None when no shard could be read."""


def _shard_grid(iter_dir: str) -> Optional[tuple[int, int, str]]:
    """(tp, pp, path of one shard file) from the manifest or the mp_rank_* directories; None if none."""
    try:
        entries = os.listdir(iter_dir)
    except OSError:
        return None
    coords = [(c, e) for e in entries if (c := parse_shard_dirname(e)) is not None
              and os.path.isfile(os.path.join(iter_dir, e, SHARD_FILENAME))]
    if not coords:
        return None
    first = os.path.join(iter_dir, min(coords)[1], SHARD_FILENAME)
    try:
        with open(os.path.join(iter_dir, MANIFEST_FILENAME)) as f:
            m = json.load(f)
        return int(m["tp_size"]), int(m["pp_size"]), first
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tp = max(t for (t, _), _ in coords) + 1
    pp = max((p or 0) for (_, p), _ in coords) + 1
    return tp, pp, first


def _model_chunks(shard: str) -> Optional[int]:
    from hpcmeg.checkpoint.safe import safe_torch_load  # torch: only once there is a checkpoint to read

    try:
        state = safe_torch_load(shard, mmap=True)
    except Exception:  # noqa: BLE001 - unreadable here means unknown; the trainer's loader says why
        return None
    try:
        return len(checkpoint_models(state)) if isinstance(state, dict) else None
    except KeyError:  # no model entry: not a checkpoint the trainer could resume either
        return None


def saved_layout(ckpt_dir: str) -> Optional[SavedLayout]:
    """See the file header."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    # the iterations store.load_checkpoint would try, in its order: the first with shard files is it
    for it in resume_candidates(ckpt_dir, read_tracker(ckpt_dir)):
        grid = _shard_grid(os.path.join(ckpt_dir, iter_dirname(it)))
        if grid is not None:
            tp, pp, shard = grid
            # virtual stages are chunks of pipeline stages: at pp 1 there is one chunk, and no shard is opened
            return SavedLayout(os.path.abspath(ckpt_dir), it, tp, pp, 1 if pp == 1 else _model_chunks(shard))
    return None
