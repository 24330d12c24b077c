"""One-line reports of expected failures (the house rule: one line naming the file or key and the fix).

Owns only formatting: how an OSError on a user's path, or an exception re-raised from a DataLoader
worker, becomes one line. Which exceptions count as expected is decided where they are caught
(``hpcmeg.cli.main``, ``hpcmeg.train.entry.train``, the convert commands), never by catching
everything: an unexpected exception is a bug and keeps its traceback.
No torch, no module state.
"""
from __future__ import annotations

import errno

_OS_HINTS = {
    errno.EACCES: "check its permissions, or choose a path you can write",
    errno.EPERM: "check its permissions, or choose a path you can write",
    errno.EROFS: "the filesystem is read-only; choose another path",
    errno.ENOSPC: "the filesystem is full; free space or choose another path",
    errno.EDQUOT: "the disk quota is exceeded; free space or choose another path",
    errno.ENOTDIR: "a component of the path is a file; choose another path",
    errno.ENOENT: "check the path",
    errno.EISDIR: "it is a directory; give a file",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.EEXIST: "remove it or choose another path",
}


def os_error_line(e: OSError) -> str:
    """'PATH: Permission denied; check its permissions, ...' (the path, what failed, what to do)."""
    what = e.strerror or str(e) or type(e).__name__
    where = e.filename if e.filename is not None else None
    hint = _OS_HINTS.get(e.errno or -1)
    text = f"{where}: {what}" if where is not None else what
    return f"{text}; {hint}" if hint else text


def one_line(e: BaseException) -> str:
    """The exception's message on one line. An exception that a DataLoader worker raised comes back
    with the worker's traceback in its message: only the original message is kept."""
    if isinstance(e, OSError) and (e.strerror or e.filename):
        return os_error_line(e)
    text = str(e).strip() or type(e).__name__
    if "Original Traceback" in text:
        last = [ln for ln in text.splitlines() if ln.strip()][-1].strip()
        head, sep, rest = last.partition(": ")
        text = rest if sep and " " not in head else last  # drop the 'pkg.module.ErrorClass: ' prefix
    return " ".join(text.split())


__all__ = ["one_line", "os_error_line"]
