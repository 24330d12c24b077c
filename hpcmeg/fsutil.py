"""Atomic file writes: the one place hpcmeg writes "temp name, fsync, rename".

Owns the file-level protocol every writer in hpcmeg shares (run dir, recipes, markers, index cache,
checkpoint sidecars/manifest/tracker). Directory-level protocols (checkpoint iteration dirs,
convert's staging dirs) stay with their owners and only use `fsync_dir` from here.

Contract of every writer below: a reader of ``path`` sees either the old file or the whole new one,
never a torn one, and an exception leaves the old file untouched and no temporary behind.

Why it is done this way:
- The temporary lives in the SAME directory as the target (``.<name>.tmp-<pid>-<random>``):
  rename(2) is atomic only within one filesystem, and on Lustre/GPFS a cross-directory rename can
  cross MDTs/filesets. The leading dot hides it from globbing readers; `temp_prefix` lets cleanup
  code recognise leftovers of a killed writer (SIGKILL cannot be cleaned up by anyone but them).
- The name is created with O_EXCL and carries pid + random bits: ranks on different nodes share
  pids on a shared filesystem, and threads share one pid, so pid alone could collide.
- The final file gets ``0o666 & ~umask``, exactly what a plain ``open(path, "w")`` gives, unless
  ``mode=`` asks for other bits: the mode is set on the temporary BEFORE the rename, so the target
  never exists with the wrong bits. It is set explicitly even without ``mode=`` because libraries
  that write into the yielded path may replace it with a file of their own (safetensors' writer
  creates 0o600 files), and a converted model in a shared project directory must stay readable to
  the colleagues the user's umask admits. Executables use ``mode=executable_mode()``
  (``0o777 & ~umask``). An existing target's mode is not kept.
- Data is fsynced before the rename; otherwise a crash can leave the NEW name pointing at an empty
  or partial inode (ext4/XFS delayed allocation, and Lustre client caches). ``sync_dir=True`` also
  fsyncs the parent directory so the rename itself survives a crash (needed for commit points such
  as the checkpoint tracker; cheap to skip for advisory files such as status markers).
- On any exception (including KeyboardInterrupt) the temporary is removed and the error re-raised.

No torch, no numpy, no module state: importable from login-node tools.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from typing import Iterator, Optional

def current_umask() -> int:
    """This process's umask, read without changing it (Linux /proc); elsewhere set-and-restore."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # not thread-safe, hence only the fallback
    os.umask(old)
    return old


def default_mode() -> int:
    """Mode of a regular output file: what ``open(path, "w")`` would give (0o666 minus the umask)."""
    return 0o666 & ~current_umask()


def executable_mode() -> int:
    """Mode of a generated script: 0o777 minus the umask (a 0o027 umask gives 0o750, not 0o755)."""
    return 0o777 & ~current_umask()


def temp_prefix(path: str | os.PathLike) -> str:
    """Basename prefix of every temporary `atomic_path` creates for ``path`` (``.<name>.tmp-``)."""
    return f".{os.path.basename(os.fspath(path))}.tmp-"


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory entry change (create/rename/unlink): POSIX needs an fsync on the directory."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    # fsync flushes the file (inode), not one descriptor's writes, so a fresh read-only fd suffices
    # for data a caller wrote through its own, already closed, handle.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(path: str) -> str:
    parent = os.path.dirname(path)
    prefix = os.path.join(parent, temp_prefix(path))
    for _ in range(100):
        tmp = f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"{path}: could not create a unique temporary name next to it")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: Optional[int] = None, fsync: bool = True,
                sync_dir: bool = False) -> Iterator[str]:
    """Yield the path (str) of an empty temporary file next to ``path``; write it completely.

    On normal exit: fsync the temporary (``fsync``), chmod it to ``mode`` (default: `default_mode`), ``os.replace``
    it onto ``path``, fsync the parent directory (``sync_dir``). On an exception: remove the
    temporary, leave ``path`` as it was, re-raise. The parent directory must exist.
    Write to exactly the yielded path (reopen it with "w"/"wb"; do not let a library append a suffix).
    """
    path = os.fspath(path)
    tmp = _create_temp(path)
    try:
        yield tmp
        if fsync:
            _fsync_file(tmp)
        os.chmod(tmp, default_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, mode: Optional[int] = None,
                       fsync: bool = True, sync_dir: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically (see `atomic_path` for ``mode``/``fsync``/``sync_dir``)."""
    with atomic_path(path, mode=mode, fsync=False, sync_dir=sync_dir) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:  # on the writing descriptor, before close (atomic_path's own fsync is off)
                f.flush()
                os.fsync(f.fileno())


def write_text_atomic(path: str | os.PathLike, text: str, *, encoding: Optional[str] = None,
                      mode: Optional[int] = None, fsync: bool = True, sync_dir: bool = False) -> None:
    """Replace ``path`` with ``text`` atomically. ``encoding=None`` is open()'s default (the locale's),
    which is what hpcmeg's readers use; see `atomic_path` for ``mode``/``fsync``/``sync_dir``."""
    with atomic_path(path, mode=mode, fsync=False, sync_dir=sync_dir) as tmp:
        with open(tmp, "w", encoding=encoding) as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


__all__ = ["current_umask", "default_mode", "executable_mode", "atomic_path", "fsync_dir", "temp_prefix",
           "write_bytes_atomic", "write_text_atomic"]
