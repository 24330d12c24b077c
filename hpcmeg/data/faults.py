"""How the data tools (preprocess, merge-datasets, corpus, tokenizer train) fail and stop.

Owns the user-facing failure contract of those four commands:
- Every fault is ONE line on stderr, ``hpcmeg <tool>: <where>: <what>; <what to do>``, no traceback.
  Exit status 2 when the command line is at fault (a bad flag value, an input path that does not
  exist or is not a file), 1 for data and runtime faults (file contents, an output location that
  cannot be written -- as hpcmeg convert does --, permission and I/O errors, a worker that died),
  128+N after signal N (143 for Slurm's SIGTERM, 130 for Ctrl-C). OSErrors are worded by
  hpcmeg.errors.os_error_line, the one formatter the other commands use too.
- SIGTERM and SIGINT only set a flag (`StopSignal`); the work loops poll it once per batch and raise
  `Interrupted` from ordinary code, so cleanup (temporary files, worker processes) runs normally.
  Why never raise inside the handler: the exception surfaces wherever the main thread happens to be,
  and some places swallow it -- inside logging's at-fork hook it is printed as "Exception ignored"
  and the run goes on to exit 0, which made a preempted preprocess ignore Slurm's SIGTERM.
- `OneLineArgumentParser`: argparse, but a usage error is one line (argparse prints the whole usage
  block first), still exit 2.
- `check_output_dir` refuses an output location that cannot be written BEFORE any work starts;
  `created_dirs` removes the directories a failed run made.
- `worker_process_setup` is what every worker process of these tools runs first: default SIGTERM
  (a terminate() kills it at once, whatever it is blocked in), SIGINT ignored (Ctrl-C reaches the
  whole process group; the parent decides), and death with its parent (PR_SET_PDEATHSIG on Linux,
  plus a parent-pid check for the race before it is set), so no worker outlives a killed parent.

No module state: a StopSignal is created by a command's main() and passed down as an argument.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from typing import Callable, Iterator, Sequence

from hpcmeg.errors import os_error_line

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ToolError(Exception):
    """A fault reported as one line; ``exit_code`` 1 = data/runtime fault."""

    exit_code = 1


class UsageError(ToolError, ValueError):
    """The command line is at fault (bad flag value, wrong kind of path): exit 2."""

    exit_code = 2


class MissingPathError(UsageError, FileNotFoundError):
    """A path named on the command line does not exist (or a glob matches nothing): exit 2."""


class DataError(ToolError, ValueError):
    """A file's contents are at fault (corrupt gzip, bad JSON, garbage vocabulary, no documents): exit 1."""


class Interrupted(ToolError):
    """A stop signal arrived; the work was abandoned and its partial outputs removed."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"stopped by {signal.Signals(self.signum).name}; partial outputs were removed, "
                         "nothing was written; run the same command again to redo it")


class StopSignal:
    """Flag-only handlers for SIGTERM/SIGINT while the block runs; `check()` raises Interrupted."""

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - only record it (see module docstring)
        if self.received is None:
            self.received = signum

    def __enter__(self) -> "StopSignal":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def __bool__(self) -> bool:
        return self.received is not None

    def check(self) -> None:
        if self.received is not None:
            raise Interrupted(self.received)


def check_stop(stop: StopSignal | None) -> None:
    """`stop.check()` when a StopSignal is in use (library callers pass None)."""
    if stop is not None:
        stop.check()


@contextlib.contextmanager
def signals_blocked(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Hold back `signals` in this thread (e.g. around fork, so a new worker cannot be stopped before it
    has installed its own handlers: a signal sent to it meanwhile stays pending, then acts)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _set_parent_death_signal(signum: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # the parent-pid checks in the worker loops still end an orphan


def worker_process_setup(parent_pid: int) -> None:
    """First thing a worker process does (see module docstring). Started with STOP_SIGNALS blocked."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2) instead of the usage block + line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")  # as hpcmeg.cli's parser


def positive_int(minimum: int = 1) -> Callable[[str], int]:
    """argparse type: an integer >= minimum (argparse names the flag in the one-line error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _is_read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & getattr(os, "ST_RDONLY", 1))
    except OSError:
        return False


def check_output_dir(path: str, flag: str, *, is_dir: bool = False) -> list[str]:
    """Refuse an output `path` (a file or prefix; `is_dir`: the directory itself) that cannot be
    written; returns the directories that do not exist yet and would be created (outermost first)."""
    if not path:
        raise UsageError(f"{flag}: give a path")
    # dirname before abspath: a prefix "out/" names files in out/, and "" would otherwise be the parent
    d = os.path.abspath(path if is_dir else (os.path.dirname(path) or "."))
    missing: list[str] = []
    while not os.path.isdir(d):
        if os.path.lexists(d):
            raise ToolError(f"{flag} {path}: {d} exists and is not a directory; choose a path in a directory")
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    if not os.access(d, os.W_OK | os.X_OK):
        why = "read-only file system" if _is_read_only_fs(d) else "permission denied"
        raise ToolError(f"{flag} {path}: cannot write in {d} ({why}); choose a directory you can write "
                        "or fix its permissions")
    return missing[::-1]


@contextlib.contextmanager
def created_dirs(dirs: Sequence[str]) -> Iterator[None]:
    """Create `dirs` (outermost first); if the block fails, remove those of them that are still empty."""
    made = []
    try:
        for d in dirs:
            try:
                os.mkdir(d)
                made.append(d)
            except FileExistsError:
                pass
        yield
    except BaseException:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise


def run_tool(prog: str, body: Callable[[], int]) -> int:
    """Run a tool's body; turn its faults into one line on stderr and the exit code (module docstring).
    Anything else is a bug in hpcmeg and keeps its traceback."""
    try:
        return int(body() or 0)
    except ToolError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"{prog}: {os_error_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a SIGINT outside a StopSignal block
        print(f"{prog}: {Interrupted(signal.SIGINT)}", file=sys.stderr)
        return 130
    except MemoryError:
        print(f"{prog}: out of memory; use fewer --workers or a node with more memory", file=sys.stderr)
        return 1


__all__ = ["DataError", "Interrupted", "MissingPathError", "OneLineArgumentParser", "StopSignal", "ToolError",
           "UsageError", "check_output_dir", "check_stop", "created_dirs", "positive_int",
           "run_tool", "signals_blocked", "worker_process_setup"]
