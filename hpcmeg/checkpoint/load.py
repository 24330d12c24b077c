"""Loading a Megatron-layout checkpoint: this rank's shard of the newest usable iteration.

Owns the load protocol (spec: megatron-interop.md §6-7; hpcmeg.checkpoint.store writes what this
reads, and re-exports these names): ``load_checkpoint``, the checks that decide whether an iteration
is usable, ``CheckpointWarning`` and ``CheckpointLoadError``. Distributed-aware through explicit
arguments only (the caller's tp/pp coordinates and an optional MAX all-reduce); no process group is
read.

The tracker names the target (the iterations tried, newest first, are
hpcmeg.megatron.names.resume_candidates); if its manifest, a listed file's size, this rank's shard
crc32 or the unpickling fails, a CheckpointWarning names the bad file and the newest older valid
iteration is used. Iteration dirs newer than the tracker are uncommitted and ignored. `release`
loads as iteration 0. A shard that does not belong with the others (hpcmeg/checkpoint/shard_set.py:
its iteration is not its directory's, its save id not the manifest's, or its iteration/args/save id
differ from shard (0, 0)'s, compared across ranks with two MAX all-reduces when `all_reduce_max` is
given) is refused with CheckpointLoadError naming the shard, on every rank together, with no
fallback: it is a copied-in file, not a damaged one.
"""
from __future__ import annotations

import json
import os
import shlex
import warnings
import zlib
from typing import Any, Callable

from hpcmeg.checkpoint.safe import UnreadableCheckpointError, UnsafeCheckpointError, safe_torch_load
from hpcmeg.checkpoint.shard_set import fingerprint, own_shard_problem
from hpcmeg.megatron.names import (MANIFEST_FILENAME, RELEASE_DIRNAME, TRACKER_FILENAME, iter_dirname, read_tracker,
                                   resume_candidates, shard_relpath)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (partial, truncated, corrupt) or loaded unverified."""


class CheckpointLoadError(RuntimeError):
    """A committed checkpoint exists but none is usable; the message names every bad file and the fix."""


def file_crc32(path: str, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while b := f.read(chunk):
            crc = zlib.crc32(b, crc)
    return crc


def _problem(iter_dir: str, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int, verify_crc: bool) -> str | None:
    """Why this iteration dir is unusable for this rank, or None. Size checks cover every shard (cheap
    stat, same answer on every rank); the crc covers this rank's shard only (it reads it anyway)."""
    own = shard_relpath(tp_rank, pp_rank, pp_size)
    mpath = os.path.join(iter_dir, MANIFEST_FILENAME)
    if not os.path.exists(mpath):
        if not os.path.exists(os.path.join(iter_dir, own)):
            return f"{os.path.join(iter_dir, own)} is missing"
        # stacklevel: _problem < _read_shard < load_checkpoint < its caller
        warnings.warn(f"{iter_dir} has no {MANIFEST_FILENAME} (not written by hpcmeg); loading it unverified",
                      CheckpointWarning, stacklevel=4)
        return None
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{mpath} is unreadable ({e})"
    if (manifest.get("tp_size"), manifest.get("pp_size")) != (tp_size, pp_size):
        load_dir = os.path.dirname(os.path.abspath(iter_dir))
        cmd = shlex.join(["hpcmeg", "reshard", load_dir, f"{load_dir}-tp{tp_size}-pp{pp_size}", "--tp", str(tp_size),
                          "--pp", str(pp_size)])
        raise ValueError(f"{iter_dir} was saved with tp={manifest.get('tp_size')} pp={manifest.get('pp_size')} but "
                         f"this run uses tp={tp_size} pp={pp_size}; a checkpoint loads only at the tensor/pipeline "
                         f"sizes it was saved with: use those sizes, or reshard it into a new directory ({cmd}) "
                         f"and point checkpoint.dir at that one (checkpoint.load: weights only)")
    for rel, meta in files.items():
        path = os.path.join(iter_dir, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            return f"{path} is missing"
        if size != meta["size"]:
            return f"{path} is truncated or altered ({size} bytes, manifest says {meta['size']})"
    if own not in files:
        return f"{os.path.join(iter_dir, own)} is not listed in {mpath}"
    if verify_crc and file_crc32(os.path.join(iter_dir, own)) != files[own]["crc32"]:
        return f"{os.path.join(iter_dir, own)} is corrupt (crc32 mismatch with {MANIFEST_FILENAME})"
    return None


def _manifest_save_id(iter_dir: str) -> str | None:
    """The save id in an iteration's manifest (None: no manifest, or one written before save ids)."""
    try:
        with open(os.path.join(iter_dir, MANIFEST_FILENAME)) as f:
            sid = json.load(f).get("save_id")
    except (OSError, ValueError, AttributeError):
        return None
    return sid if isinstance(sid, str) else None


def _mismatch_across_ranks(state: dict, path: str, iter_dir: str, own: str | None, tp_rank: int, pp_rank: int,
                           pp_size: int, all_reduce_max: Callable[[int], int]) -> str | None:
    """Every rank's shard against shard (0, 0)'s fingerprint (two MAX all-reduces, on every rank):
    this rank's problem, or a line naming the iteration when another rank found one."""
    mine = fingerprint(state)
    ref = all_reduce_max(mine if (tp_rank, pp_rank) == (0, 0) else -1)  # the readers of shard (0, 0) agree
    if own is None and mine != ref:
        own = (f"{path}: its iteration, args or save id differ from those of "
               f"{os.path.join(iter_dir, shard_relpath(0, 0, pp_size))}: the shards come from different saves; "
               f"put back the shard written by the same save as the others (or use another iteration)")
    if all_reduce_max(int(own is not None)) and own is None:
        own = f"another rank's shard of {iter_dir} does not belong with the others (that rank names it)"
    return own


def _load_order(load_dir: str, iteration: int | str | None) -> tuple[list, int | str | None] | None:
    """(iterations to try, newest first; the tracker's content); None when there is nothing to load.
    A forced `iteration` is the only one, without reading the tracker."""
    if iteration is not None:
        return [iteration], None
    tracker = read_tracker(load_dir)
    candidates = resume_candidates(load_dir, tracker)
    if tracker is None:
        if not candidates:
            return None
        warnings.warn(f"{load_dir}: no {TRACKER_FILENAME}; using the newest valid iteration dir",
                      CheckpointWarning, stacklevel=3)
    elif tracker != RELEASE_DIRNAME and tracker not in candidates:
        warnings.warn(f"{load_dir}/{TRACKER_FILENAME} names iteration {tracker} but "
                      f"{iter_dirname(tracker)} does not exist", CheckpointWarning, stacklevel=3)
    return candidates, tracker


def _read_shard(iter_dir: str, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int,
                verify_crc: bool) -> tuple[dict[str, Any] | None, str | None]:
    """(this rank's state, None), or (None, why this iteration's shard is unusable)."""
    path = os.path.join(iter_dir, shard_relpath(tp_rank, pp_rank, pp_size))
    if not os.path.isdir(iter_dir):
        return None, f"{iter_dir} is missing"
    problem = _problem(iter_dir, tp_rank, pp_rank, tp_size, pp_size, verify_crc)
    if problem is not None:
        return None, problem
    try:
        state = safe_torch_load(path)
    except UnsafeCheckpointError:
        raise
    except UnreadableCheckpointError as e:
        return None, str(e).split("; the file is")[0]
    except Exception as e:  # noqa: BLE001 - any unpickling failure means this shard is unusable
        return None, f"{path} cannot be loaded ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
    if not isinstance(state, dict):
        return None, f"{path} holds a {type(state).__name__}, not a checkpoint dict"
    return state, None


def load_checkpoint(load_dir: str, *, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int,
                    iteration: int | str | None = None, verify_crc: bool = True,
                    all_reduce_max: Callable[[int], int] | None = None) -> tuple[int, dict[str, Any]] | None:
    """Load this rank's shard of the latest valid checkpoint: (iteration, state), or None if there is none.

    `iteration` forces one (an int or "release"; no fallback, raises if unusable). Otherwise the tracker
    names the target and invalid ones fall back to the newest older valid iteration with a
    CheckpointWarning naming the bad file. "release" returns iteration 0. With several ranks pass
    `all_reduce_max` (a MAX all-reduce of an int over the world) so that all ranks fall back together
    when only one rank's shard is bad. Raises UnsafeCheckpointError for pickles that need code."""
    if not os.path.isdir(load_dir):
        return None
    order = _load_order(load_dir, iteration)
    if order is None:
        return None
    candidates, tracker = order
    forced = iteration is not None
    problems: list[str] = []
    for it in candidates:
        iter_dir = os.path.join(load_dir, iter_dirname(it))
        path = os.path.join(iter_dir, shard_relpath(tp_rank, pp_rank, pp_size))
        state, problem = _read_shard(iter_dir, tp_rank, pp_rank, tp_size, pp_size, verify_crc)
        mismatch = None if problem is not None else own_shard_problem(state, path, it, _manifest_save_id(iter_dir))
        if all_reduce_max is not None:
            if all_reduce_max(int(problem is not None)) and problem is None:
                problem = f"another rank's shard of {iter_dir} is unusable"
            elif problem is None:
                mismatch = _mismatch_across_ranks(state, path, iter_dir, mismatch, tp_rank, pp_rank, pp_size,
                                                  all_reduce_max)
        if mismatch is not None:
            raise CheckpointLoadError(mismatch)
        if problem is None:
            return (0 if it == RELEASE_DIRNAME else int(state.get("iteration", it))), state
        if forced:
            raise CheckpointLoadError(f"requested checkpoint unusable: {problem}")
        problems.append(problem)
        warnings.warn(f"skipping checkpoint: {problem}; falling back to an older iteration",
                      CheckpointWarning, stacklevel=2)
    if tracker is None and not forced:
        return None  # only untracked leftovers, all unusable: a fresh start is what the user had
    found = "; ".join(problems) if problems else f"it names iteration {tracker} and there is no iter_* directory"
    raise CheckpointLoadError(f"{load_dir}: {TRACKER_FILENAME} exists but no checkpoint is usable ({found}); restore "
                              f"the files, or move {load_dir} away to start from scratch")
