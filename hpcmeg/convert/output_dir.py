"""Output directories that appear complete or not at all: what `hpcmeg convert`, `reshard` and `import-hf` write into.

Contract: ``check_output_dir(out_dir, replaceable)`` refuses, before any work, a place
``atomic_output_dir`` could not create (OutputDirError, or FileExistsError for a non-empty foreign
directory); ``atomic_output_dir(out_dir, replaceable)`` yields a staging directory beside ``out_dir``
and renames it into place only when the body succeeds. ``replaceable(out_dir)`` says whether an
existing non-empty ``out_dir`` is an earlier output of the same tool, which may then be swapped out.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable, Iterator


class OutputDirError(ValueError):
    """The output directory cannot be created where asked (a file in the way, no permission)."""


def _existing_ancestor(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def check_output_dir(out_dir: str, replaceable: Callable[[str], bool] = lambda path: False) -> None:
    """Refuse, before any work is done, an output directory that atomic_output_dir could not create:
    a non-empty foreign directory (FileExistsError), a file in the way, or a place this user cannot
    write (OutputDirError). Every message names the path and what to do."""
    out_dir = os.path.abspath(out_dir)
    if os.path.lexists(out_dir):
        if not os.path.isdir(out_dir):
            raise OutputDirError(f"{out_dir} exists and is not a directory; choose another output directory")
        try:
            busy = bool(os.listdir(out_dir))
        except OSError as e:
            raise OutputDirError(f"{out_dir}: cannot list it ({e.strerror}); choose another output directory") from None
        if busy and not replaceable(out_dir):
            raise FileExistsError(f"{out_dir} exists and is not empty; choose another output directory or remove it")
    anc = _existing_ancestor(os.path.dirname(out_dir))
    if not os.path.isdir(anc):
        raise OutputDirError(f"{anc} is a file, not a directory, so {out_dir} cannot be created there; choose "
                             f"another output directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise OutputDirError(f"{anc}: permission denied: you cannot create {out_dir} there; choose a directory "
                             f"you can write")


@contextlib.contextmanager
def atomic_output_dir(out_dir: str, replaceable: Callable[[str], bool] = lambda path: False) -> Iterator[str]:
    """Yield a staging dir next to `out_dir`; on success rename it to `out_dir`, on error delete it.

    An existing `out_dir` is left alone unless it is empty or `replaceable(out_dir)` says it is an
    earlier output of the same tool (then it is swapped out only after the new one is complete), so
    a failure never leaves a half-written or half-deleted `out_dir`. Parent directories created on
    the way are removed again on failure: nothing of a failed run stays behind."""
    out_dir = os.path.abspath(out_dir)
    check_output_dir(out_dir, replaceable)
    parent = os.path.dirname(out_dir)
    created: list[str] = []
    path = parent
    while not os.path.isdir(path):
        created.append(path)
        path = os.path.dirname(path)
    stage = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{os.getpid()}")
    try:
        for path in reversed(created):
            os.mkdir(path)
        if os.path.exists(stage):
            shutil.rmtree(stage)
        os.makedirs(stage)
        yield stage
        old = None
        if os.path.exists(out_dir):
            old = os.path.join(parent, f".{os.path.basename(out_dir)}.old-{os.getpid()}")
            os.rename(out_dir, old)
        os.rename(stage, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for path in created:  # deepest first; only if still empty (another writer may use it now)
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise
