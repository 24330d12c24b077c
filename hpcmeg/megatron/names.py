"""Megatron checkpoint file and directory names, and hpcmeg's train exit codes: pure, torch-free rules.

Spec: shared/docs/megatron-interop.md section 6.1. Everything that names a checkpoint file or reads the
tracker lives here, once; train (writing), launch (status, the supervisor's progress check, the
convert array) and convert (reading) all use it.

    <save>/latest_checkpointed_iteration.txt        "<int>" or "release"
    <save>/iter_{:07d}/ or <save>/release/
        mp_rank_{tp:02d}/model_optim_rng.pt         when pp_size == 1
        mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt when pp_size  > 1
        hpcmeg_manifest.json                        hpcmeg's size + crc32 list of the shards (not Megatron's)

Exit codes of `hpcmeg train` (the Slurm supervisor keys on them; hpcmeg's own, kept beside the
checkpoint names because the same two sides, train and launch, must agree on both):
    0 EXIT_OK  1 EXIT_ERROR  2 EXIT_BAD_RECIPE  3 EXIT_REQUEUE (every rank saved the same iteration:
    requeue and rerun the same command to resume).
"""
from __future__ import annotations

import os
import re

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
SHARD_FILENAME = "model_optim_rng.pt"
RELEASE_DIRNAME = "release"
MANIFEST_FILENAME = "hpcmeg_manifest.json"
CHECKPOINT_VERSION = 3.0  # per-head [q, k, v] row order of query_key_value (section 6.3)
_ITER_DIR_RE = re.compile(r"^iter_(\d{7})$")
_SHARD_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")

EXIT_OK, EXIT_ERROR, EXIT_BAD_RECIPE, EXIT_REQUEUE = 0, 1, 2, 3
REQUEUE_EXIT_CODES = (EXIT_REQUEUE,)


def iter_dirname(iteration: int | str) -> str:
    """'iter_0000100' for 100; 'release' for the string "release"."""
    if iteration == RELEASE_DIRNAME:
        return RELEASE_DIRNAME
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ValueError(f"checkpoint iteration must be a non-negative int or 'release', got {iteration!r}")
    return f"iter_{iteration:07d}"


def parse_iter_dirname(name: str) -> int | None:
    """Inverse of iter_dirname for iteration dirs; None for anything else (tmp dirs, release, files)."""
    m = _ITER_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def shard_dirname(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """mp_rank_TT when pp_size == 1 else mp_rank_TT_PPP (Megatron's get_checkpoint_name)."""
    if pp_size == 1:
        if pp_rank != 0:
            raise ValueError(f"pp_rank {pp_rank} with pp_size 1")
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def shard_relpath(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Path of one shard file relative to an iteration dir."""
    return f"{shard_dirname(tp_rank, pp_rank, pp_size)}/{SHARD_FILENAME}"


def all_shard_relpaths(tp_size: int, pp_size: int) -> list[str]:
    """Every shard a complete (tp_size x pp_size) checkpoint must contain."""
    return [shard_relpath(t, p, pp_size) for p in range(pp_size) for t in range(tp_size)]


def checkpoint_path(save_dir: str, iteration: int | str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(save_dir, iter_dirname(iteration), shard_relpath(tp_rank, pp_rank, pp_size))


def read_tracker(save_dir: str) -> int | str | None:
    """Iteration named by latest_checkpointed_iteration.txt: an int, "release", or None if absent.

    Raises ValueError naming the file when its content is neither (a hand-edited or foreign file)."""
    path = os.path.join(save_dir, TRACKER_FILENAME)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if text == RELEASE_DIRNAME:
        return RELEASE_DIRNAME
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number or 'release', found {text[:40]!r}; "
                         f"fix or delete the file") from None


def parse_shard_dirname(name: str) -> tuple[int, int | None] | None:
    """'mp_rank_01' -> (1, None), 'mp_rank_01_002' -> (1, 2); None for anything else."""
    m = _SHARD_DIR_RE.match(name)
    if not m:
        return None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)


def latest_iteration(ckpt_dir: str | os.PathLike) -> int | None:
    """The tracker's iteration for progress checks ('release' counts as 0); None when there is no
    readable tracker (absent, or not a number: the readers that must fail on that call read_tracker)."""
    try:
        it = read_tracker(str(ckpt_dir))
    except (ValueError, OSError):
        return None
    return 0 if it == RELEASE_DIRNAME else it


def resume_candidates(ckpt_dir: str | os.PathLike, tracker: int | str | None) -> list[int | str]:
    """The iterations a resume may load, newest first: ["release"] when ``tracker`` (what read_tracker
    found) is "release"; else the ``iter_XXXXXXX`` names not newer than the tracker (newer ones are
    leftovers of an interrupted save), every one of them without a tracker. The one rule the loader
    (checkpoint.store), the layout check before a submit (checkpoint.saved_layout) and the committed
    list (committed_iterations) share; [] when ``ckpt_dir`` is not a directory."""
    if tracker == RELEASE_DIRNAME:
        return [RELEASE_DIRNAME]
    try:
        names = os.listdir(ckpt_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = sorted((i for i in map(parse_iter_dirname, names) if i is not None), reverse=True)
    return [i for i in found if tracker is None or i <= tracker]


def committed_iterations(ckpt_dir: str | os.PathLike) -> list[int]:
    """Sorted iterations with an ``iter_XXXXXXX`` directory not newer than the tracker ('release'
    counts as 0); [] without a readable tracker."""
    latest = latest_iteration(ckpt_dir)
    if latest is None:
        return []
    return sorted(i for i in resume_candidates(ckpt_dir, latest)
                  if os.path.isdir(os.path.join(ckpt_dir, iter_dirname(i))))
