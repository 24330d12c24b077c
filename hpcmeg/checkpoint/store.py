"""Atomic, verifiable save of Megatron-layout checkpoints (spec: megatron-interop.md §6-7).

The format (names, dict contents) lives in hpcmeg/megatron/, safe unpickling in safe.py beside this
file; this file owns the save protocol, load.py the load protocol. Distributed-aware through explicit
arguments only: the caller passes its (tp, pp) coordinates, whether it writes a shard (dp_rank == 0),
whether it is global rank 0, and a `barrier` callable (a world barrier; `lambda: None` in a single
process). No process group is read.

Save protocol (every rank calls save_checkpoint with the same iteration):
  1. global rank 0 removes leftovers of crashed saves (`*.tmp`, `*.trash`), then barrier.
  2. each shard writer writes `<save>/iter_XXXXXXX.tmp/mp_rank_../model_optim_rng.pt` via a temp name,
     fsync, rename, plus a small sidecar `hpcmeg_shard.<mp_rank..>.json` = {size, crc32} computed while
     writing (no re-read). The tmp name derives from the iteration, so ranks agree without talking.
     The save's id (shard_set.py), which rank 0 wrote into the tmp dir before the barrier, goes into
     every shard as state["hpcmeg"]["save_id"]: it ties the shards of one save together.
  3. barrier; rank 0 merges sidecars into `hpcmeg_manifest.json` (with the save id; fails if a shard is
     missing), fsyncs,
     renames the tmp dir to `iter_XXXXXXX` (a stale one is moved away first), fsyncs the parent, writes
     the tracker via temp+rename+fsync (the commit point), rotates old iterations (keep_last); barrier.
  A crash before the tracker write leaves the previous iteration as latest: nothing half-written is ever
  named `iter_XXXXXXX` *and* pointed to by the tracker.

Why crc32 (zlib) and not sha256: the threat is truncation/bit rot/partial writes, not tampering (unsafe
pickles are stopped by weights_only loading). crc32 is computed in C at several GB/s as bytes stream
to disk, so the writer never re-reads a multi-GB shard; sizes catch truncation on every rank via stat().

Load (the newest usable iteration, with fallback and the cross-rank shard checks): load.py beside
this file; its names (load_checkpoint, CheckpointWarning, CheckpointLoadError) are importable from here.

Async save (`async_save=True`): the state is copied to CPU synchronously (host memory doubles for one
shard), files are written by a background thread, and steps 3 (barrier + commit) run in the returned
handle's `wait()`, which the trainer must call from the main thread before the next save and before
exit. Trade-off: training continues during the disk write, but the checkpoint is only committed at
`wait()`; a crash before that loses it (the previous one stays latest), and the copy costs host memory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hpcmeg import fsutil
# the load side, re-exported: callers import both directions of the protocol from here
from hpcmeg.checkpoint.load import CheckpointLoadError, CheckpointWarning, file_crc32, load_checkpoint  # noqa: F401
from hpcmeg.checkpoint.shard_set import new_save_id, with_save_id
from hpcmeg.fsutil import fsync_dir
from hpcmeg.megatron.names import (MANIFEST_FILENAME, SHARD_FILENAME, TRACKER_FILENAME, all_shard_relpaths,
                                   iter_dirname, resume_candidates, shard_dirname)

_TMP_SUFFIX = ".tmp"
_TRASH_SUFFIX = ".trash"
_SIDECAR_RE = re.compile(r"^hpcmeg_shard\.(mp_rank_[0-9_]+)\.json$")
_SAVE_ID_FILENAME = "hpcmeg_save_id"  # in the tmp dir during a save; the manifest keeps it afterwards


# ------------------------------------------------------------------------------------ file helpers

def write_text_atomic(path: str, text: str) -> None:
    """Sidecars, manifest and tracker: temp + fsync + rename + parent-dir fsync (the tracker write is
    the commit point, so the rename itself must be durable)."""
    fsutil.write_text_atomic(path, text, sync_dir=True)


class _CrcWriter:
    """File-like wrapper that crc32s bytes on their way to disk (torch.save only calls write/flush)."""

    def __init__(self, file):
        self.file, self.crc, self.size = file, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _cpu_copy(obj: Any) -> Any:
    """Deep copy of tensors to CPU (clone even CPU tensors: training mutates parameters in place)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.clone() if t.device.type == "cpu" else t.to("cpu")
    if isinstance(obj, argparse.Namespace):  # the trainer keeps updating args (consumed samples)
        return argparse.Namespace(**{k: _cpu_copy(v) for k, v in vars(obj).items()})
    if isinstance(obj, dict):
        return type(obj)((k, _cpu_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def _remove_tree(path: str) -> None:
    """Rename away first so a half-deleted dir is never mistaken for a checkpoint."""
    trash = path + _TRASH_SUFFIX
    if os.path.exists(trash):
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)


# -------------------------------------------------------------------------------------------- save

def _write_shard(tmp_iter_dir: str, state: dict, tp_rank: int, pp_rank: int, pp_size: int) -> None:
    shard_dir = os.path.join(tmp_iter_dir, shard_dirname(tp_rank, pp_rank, pp_size))
    os.makedirs(shard_dir, exist_ok=True)
    final = os.path.join(shard_dir, SHARD_FILENAME)
    partial = final + ".partial"
    with open(partial, "wb") as f:
        w = _CrcWriter(f)
        torch.save(state, w)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, final)
    fsync_dir(shard_dir)
    sidecar = os.path.join(tmp_iter_dir, f"hpcmeg_shard.{shard_dirname(tp_rank, pp_rank, pp_size)}.json")
    write_text_atomic(sidecar, json.dumps({"size": w.size, "crc32": w.crc}))


def _commit(save_dir: str, iteration: int, tp_size: int, pp_size: int, keep_last: int | None) -> None:
    """Global rank 0 only, after all shards are on disk: manifest, rename, tracker, rotation."""
    name = iter_dirname(iteration)
    tmp, final = os.path.join(save_dir, name + _TMP_SUFFIX), os.path.join(save_dir, name)
    files = {}
    for rel in all_shard_relpaths(tp_size, pp_size):
        sidecar = os.path.join(tmp, f"hpcmeg_shard.{rel.split('/')[0]}.json")
        if not os.path.exists(sidecar):
            raise RuntimeError(f"checkpoint {tmp}: shard {rel} was not written (its writer failed or the "
                               f"tp/pp sizes disagree between ranks); iteration {iteration} not committed")
        with open(sidecar) as f:
            files[rel] = json.load(f)
    manifest = {"format": "megatron-torch-legacy", "checksum": "crc32", "iteration": iteration,
                "tp_size": tp_size, "pp_size": pp_size, "save_id": _read_save_id(tmp), "files": files}
    write_text_atomic(os.path.join(tmp, MANIFEST_FILENAME), json.dumps(manifest, indent=1))
    os.remove(os.path.join(tmp, _SAVE_ID_FILENAME))
    for entry in os.listdir(tmp):
        if _SIDECAR_RE.match(entry):
            os.remove(os.path.join(tmp, entry))
    fsync_dir(tmp)
    stale = None
    if os.path.exists(final):  # an uncommitted or older save of the same iteration: swap, then delete,
        stale = final + _TRASH_SUFFIX  # so the window without any iter dir is two renames long
        if os.path.exists(stale):
            shutil.rmtree(stale)
        os.rename(final, stale)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    if stale is not None:
        shutil.rmtree(stale)
    write_text_atomic(os.path.join(save_dir, TRACKER_FILENAME), f"{iteration}\n")
    if keep_last is not None:
        rotate_checkpoints(save_dir, keep_last, protect=iteration)


def _read_save_id(tmp_iter_dir: str) -> str:
    with open(os.path.join(tmp_iter_dir, _SAVE_ID_FILENAME)) as f:
        return f.read().strip()


def rotate_checkpoints(save_dir: str, keep_last: int, protect: int) -> list[int]:
    """Delete iteration dirs older than the newest `keep_last` at or below `protect` (the tracker's
    iteration, never deleted). Dirs newer than `protect` are left alone. Returns deleted iterations."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    doomed = [i for i in resume_candidates(save_dir, protect)[keep_last:] if i != protect]
    for i in doomed:
        _remove_tree(os.path.join(save_dir, iter_dirname(i)))
    return doomed


@dataclass
class PendingSave:
    """Handle for a save; `wait()` (collective: every rank calls it) commits it. Idempotent."""
    save_dir: str
    iteration: int
    tp_size: int
    pp_size: int
    is_global_rank0: bool
    barrier: Callable[[], None]
    keep_last: int | None
    thread: threading.Thread | None = None
    error: list = field(default_factory=list)
    committed: bool = False

    def wait(self) -> None:
        if self.committed:
            return
        if self.thread is not None:
            self.thread.join()
        # Every rank reaches both barriers even on failure, so one bad writer cannot hang the rest.
        self.barrier()
        err = self.error[0] if self.error else None
        if self.is_global_rank0 and err is None:
            try:
                _commit(self.save_dir, self.iteration, self.tp_size, self.pp_size, self.keep_last)
            except BaseException as e:  # noqa: BLE001 - re-raised after the barrier
                err = e
        self.barrier()
        self.committed = True
        if err is not None:
            raise err

    @property
    def writing(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def save_checkpoint(save_dir: str, iteration: int, state: dict[str, Any], *, tp_rank: int, pp_rank: int,
                    tp_size: int, pp_size: int, is_shard_writer: bool, barrier: Callable[[], None],
                    is_global_rank0: bool, keep_last: int | None = None, async_save: bool = False) -> PendingSave:
    """Collective save of `state` (the dict from make_checkpoint_dict) as iteration `iteration`.

    Every rank calls it. Synchronous: returns a committed handle. async_save: returns after the CPU copy;
    call `.wait()` on every rank before the next save and before exit. A previous async save must
    have been waited for."""
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
    if not 0 <= tp_rank < tp_size or not 0 <= pp_rank < pp_size:
        raise ValueError(f"rank (tp={tp_rank}, pp={pp_rank}) outside grid tp_size={tp_size} pp_size={pp_size}")
    tmp = os.path.join(save_dir, iter_dirname(iteration) + _TMP_SUFFIX)
    if is_global_rank0:
        os.makedirs(save_dir, exist_ok=True)
        for entry in os.listdir(save_dir):  # leftovers of a crashed save or rotation
            path = os.path.join(save_dir, entry)
            if entry.endswith(_TMP_SUFFIX) or entry.endswith(_TRASH_SUFFIX):
                shutil.rmtree(path, ignore_errors=True)
            elif entry.startswith((fsutil.temp_prefix(TRACKER_FILENAME), TRACKER_FILENAME + ".tmp-")):
                os.remove(path)  # a killed tracker write (fsutil's name, or the pre-fsutil one)
        os.makedirs(tmp)
        write_text_atomic(os.path.join(tmp, _SAVE_ID_FILENAME), new_save_id() + "\n")
    barrier()
    pending = PendingSave(save_dir, iteration, tp_size, pp_size, is_global_rank0, barrier, keep_last)
    if is_shard_writer:
        data = with_save_id(_cpu_copy(state) if async_save else state, _read_save_id(tmp))

        def write() -> None:
            try:
                _write_shard(tmp, data, tp_rank, pp_rank, pp_size)
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                pending.error.append(e)

        if async_save:
            pending.thread = threading.Thread(target=write, name=f"ckpt-save-{iteration}", daemon=False)
            pending.thread.start()
        else:
            write()
    if not async_save:
        pending.wait()
    return pending
