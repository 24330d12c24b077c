"""On-disk cache of dataset indices: `.npy` files keyed by the md5 of a JSON description.

Owns: naming (`<cache_dir>/<md5>-<kind>-<split>-<name>.npy` plus `...-description.txt`, the layout
Megatron's mcore uses, docs/megatron-interop.md §3.4), the build-once protocol and atomic writes.
Building every index of a data config ahead of time (`hpcmeg prepare-cache`) is
`hpcmeg.data.blended.prepare_cache`, which builds the datasets through this cache.

Protocol (why it is safe without torch.distributed):
- Hit: all files exist -> load with mmap_mode="r" (pages shared by all ranks of a node). No lock.
- Miss: take an exclusive `fcntl.flock` on `<md5>-<kind>-<split>.lock` in the cache dir; whoever
  gets it first builds, the others block in flock, then re-check and find a hit. The kernel drops
  the lock if the builder dies, so a crash never wedges the others.
- Every file is written to a temporary name in the same directory, fsynced and `os.replace`d
  (hpcmeg.fsutil), arrays first and the description last, so a reader never sees a torn file.
- The lock is only an optimisation: the indices are a deterministic function of the description,
  so where flock is unavailable (Lustre mounted without `-o flock`: ENOSYS) or only node-local
  (`-o localflock`), two builders write identical bytes and the renames are atomic. We then build
  without the lock instead of failing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
from typing import Callable, Dict, Iterator, Sequence

import numpy as np

from hpcmeg import fsutil


def describe(description: dict) -> tuple[str, str]:
    """(JSON text, md5 hex) of a description dict; the JSON text is what description.txt holds."""
    text = json.dumps(description, indent=4)
    return text, hashlib.md5(text.encode("utf-8")).hexdigest()


def cache_paths(cache_dir: str, md5: str, kind: str, split: str, names: Sequence[str]) -> Dict[str, str]:
    """Paths of the description and each named array for one cached object."""
    base = os.path.join(cache_dir, f"{md5}-{kind}-{split}-")
    paths = {name: base + f"{name}.npy" for name in names}
    paths["description"] = base + "description.txt"
    return paths


# File modes: fsutil's default (the user's umask decides), like every other output. The 0o600 these
# files once had was tempfile.mkstemp's, not a choice: an index_cache_dir shared by a project's users
# must be readable by them, and nothing in it is private (sample indices of public data).


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (hpcmeg.fsutil)."""
    fsutil.write_bytes_atomic(path, data)


def atomic_save_npy(path: str, array: np.ndarray) -> None:
    """np.save to `path` atomically (hpcmeg.fsutil); a failing save leaves the old file and no temp."""
    with fsutil.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # a file object: np.save would append ".npy" to a bare name
            np.save(f, np.ascontiguousarray(array), allow_pickle=False)


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[bool]:
    """Exclusive flock on `path` (created if needed); yields True if locked, False if the FS can't."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError as err:  # e.g. Lustre without -o flock; fall back to lock-free (still correct)
            if err.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            locked = False
        try:
            yield locked
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def load_or_build(cache_dir: str | None, kind: str, split: str, description: dict,
                  build: Callable[[], Dict[str, np.ndarray]], names: Sequence[str]) -> Dict[str, np.ndarray]:
    """Return the arrays `names` for `description`, building them once under a lock on a miss.

    `build()` must return a dict with every name in `names`. With cache_dir None nothing is cached.
    Loaded arrays are read-only memmaps.
    """
    if cache_dir is None:
        return build()
    text, md5 = describe(description)
    paths = cache_paths(cache_dir, md5, kind, split, names)

    def hit() -> bool:
        return all(os.path.isfile(p) for p in paths.values())

    if not hit():
        os.makedirs(cache_dir, exist_ok=True)
        with file_lock(os.path.join(cache_dir, f"{md5}-{kind}-{split}.lock")):
            if not hit():  # we are the builder (or the lock-free fallback)
                arrays = build()
                for name in names:
                    atomic_save_npy(paths[name], arrays[name])
                # description last: its presence means every array above is complete
                atomic_write_bytes(paths["description"], text.encode("utf-8"))
                return {name: arrays[name] for name in names}
    return {name: np.load(paths[name], mmap_mode="r", allow_pickle=False) for name in names}
