"""Test processes that start with torch already imported: one multiprocessing forkserver per test
session whose server has imported torch and hpcmeg's training modules; processes fork from it.

`python -m hpcmeg.cli train ...` spends ~4 s of CPU importing torch, Dynamo and hpcmeg's training
modules; the multi-process tests start ~90 such ranks and the gloo pools (tests/dist_pool.py) ~17
more (~2 s each for torch), on 2 cores. A process forked from this server has all of that
imported already and starts in milliseconds; from there it runs the same code a fresh
interpreter runs (the CLI's main(), or the pool's worker function).

Why a fork of the server is a clean process: the server only imports (it runs no torch operation,
so no OpenMP/MKL thread pool exists to be lost in the fork), and it is started with what torch's
native libraries read once when they load: OMP_NUM_THREADS=1 (libgomp), as every test rank sets
it, and MKL_CBWR (tests/conftest.py). Everything else is read when used, and each child sets its
own os.environ before it runs anything.

Contract
- ``context()``: the multiprocessing forkserver context, its server started (once) and preloaded.
- ``CliProcess(args, env, stdout, stderr, cwd=None)``: ``python -m hpcmeg.cli ARGS`` with environment
  ``env`` (the whole environment, as subprocess's env=), stdout and stderr appended to the files at
  those paths, in ``cwd`` (default: this process's), in a process forked from the server. Popen's interface as far as the tests use it: pid,
  poll(), wait(timeout) (raises subprocess.TimeoutExpired), returncode (-N for signal N),
  send_signal(sig), kill(). The child ends like an interpreter: exit code of main(), non-daemon
  threads joined, atexit handlers run. It may start processes of its own (DataLoader workers).
- ``run_cli(args, env, timeout, cwd=None) -> subprocess.CompletedProcess``: a CliProcess to its end, text
  stdout and stderr (subprocess.run(..., capture_output=True, text=True)'s result).
- ``kill_leftovers()``: tests/conftest.py calls it when the session ends.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

# imported by the server, in this order, before any fork: what a `hpcmeg train` rank imports that
# costs time (measured, CPU: torch 1.6 s, torch._dynamo 1.8 s, the trainer 0.5 s, tensorboard 0.1 s)
PRELOAD = ["numpy", "torch", "torch.distributed", "torch._dynamo", "torch.utils.tensorboard", "hpcmeg.cli",
           "hpcmeg.recipe", "hpcmeg.train.entry", "hpcmeg.train.build", "hpcmeg.train.trainer"]
# read by native libraries when torch loads them, so they must be in the server's environment
LOAD_TIME_ENV = {"OMP_NUM_THREADS": "1"}
NAME = "hpcmeg.cli"  # the multiprocessing name of every CliProcess, which kill_leftovers looks for


def context():
    import multiprocessing as mp
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    before = {k: os.environ.get(k) for k in LOAD_TIME_ENV}
    os.environ.update(LOAD_TIME_ENV)
    try:
        forkserver.ensure_running()  # a no-op once the server runs; it inherits this environment
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def run_cli(args: list[str], env: dict, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    import tempfile

    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        p = CliProcess(args, env, out.name, err.name, cwd)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        return subprocess.CompletedProcess(args, code, out.read(), err.read())


def kill_leftovers() -> None:
    """SIGKILL every CliProcess still running (a test that timed out waiting for one): at exit,
    multiprocessing would otherwise wait for them, where an orphaned subprocess was just left."""
    import multiprocessing as mp

    for p in mp.active_children():
        if p.name == NAME:
            p.kill()
            p.join(5)


def _cli_child(args: list[str], env: dict, stdout: str, stderr: str, cwd: str | None) -> None:
    """In the forked child: become `python -m hpcmeg.cli ARGS` with stdout/stderr on those files."""
    import atexit
    import threading

    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    # line-buffered text streams on the new fds (a fresh interpreter's, to a file, would block-buffer
    # unless PYTHONUNBUFFERED: either way everything is flushed at exit)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    from hpcmeg import cli

    sys.argv = [cli.__file__, *args]
    code = 1
    try:
        code = cli.main(args)
    finally:
        # what the interpreter does before it exits, which multiprocessing's child skips
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class CliProcess:
    def __init__(self, args: list[str], env: dict, stdout: str, stderr: str, cwd=None):
        self._p = context().Process(target=_cli_child, name=NAME,
                                    args=(list(args), dict(env), stdout, stderr, None if cwd is None else str(cwd)))
        self._p.start()
        self.pid = self._p.pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(["hpcmeg.cli", *self.args], timeout)
        return self._p.exitcode

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended between the check and the signal
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
