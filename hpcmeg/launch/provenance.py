"""Which hpcmeg wrote a run, and the check every stage makes that it is the same hpcmeg.

Contract: ``fingerprint() -> {"version", "source", "path"}`` of the hpcmeg this process imports
(``source``: SHA-256 over the package's ``.py`` files, first 12 hex digits, so an edited checkout or a
stale image is told apart from the one that wrote the run even when the version string is the same);
``write_record(run_root)`` stores it as ``<run_dir>/hpcmeg_version.json`` at submit;
``mismatch(record_path, side) -> Optional[str]`` is the one-line refusal (None when they agree).

Who checks: the host-side supervisor at the start of every job (side "host", the cluster.python
interpreter on the node), and ``hpcmeg.cli`` when ``HPCMEG_VERSION_FILE`` is set, which every
generated step script does for the command it runs inside the container (side from
``HPCMEG_VERSION_SIDE``, e.g. "the apptainer image /x/hpcmeg.sif"). Pure stdlib, no torch.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

RECORD_NAME = "hpcmeg_version.json"
ENV_FILE = "HPCMEG_VERSION_FILE"
ENV_SIDE = "HPCMEG_VERSION_SIDE"


def package_dir() -> Path:
    import hpcmeg

    return Path(hpcmeg.__file__).resolve().parent


def source_hash(root: Optional[Path] = None) -> str:
    """SHA-256 of every ``*.py`` file under the package (relative path + bytes, in sorted order)."""
    root = root or package_dir()
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def fingerprint() -> dict:
    from hpcmeg import __version__

    return {"version": __version__, "source": source_hash(), "path": str(package_dir())}


def describe(fp: dict) -> str:
    return f"hpcmeg {fp.get('version')} (source {fp.get('source')})"


def write_record(run_root: str | os.PathLike) -> Path:
    from hpcmeg.launch.rundir import write_atomic

    return write_atomic(Path(run_root) / RECORD_NAME, json.dumps(fingerprint(), indent=1) + "\n")


def mismatch(record_path: str | os.PathLike, side: str) -> Optional[str]:
    """One line naming both versions, the side that differs and what to do; None when they agree."""
    try:
        want = json.loads(Path(record_path).read_text())
    except FileNotFoundError:
        return (f"version check: {record_path} is missing (the run directory was not written by this "
                f"hpcmeg submit); resubmit the run")
    except ValueError as e:
        return f"version check: {record_path} is not valid JSON ({e}); resubmit the run"
    have = fingerprint()
    if have["version"] == want.get("version") and have["source"] == want.get("source"):
        return None
    if "image" in side or "container" in side:
        fix = ("rebuild the image from the checkout you submit from (bash containers/build.sh) and point "
               "container.image at it")
    else:
        fix = ("install the submitting checkout into that environment (pip install -e <checkout>) or point "
               "cluster.python at the interpreter you submit with")
    return (f"version check: the run was written by {describe(want)} but {side} runs {describe(have)} from "
            f"{have['path']}: {fix}, then resubmit; or resubmit with --set cluster.version_check=false to run "
            f"anyway")


def check_from_env(environ=None) -> Optional[str]:
    """The check ``hpcmeg.cli`` makes inside a job step (None: nothing to check or they agree)."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_FILE)
    if not path:
        return None
    return mismatch(path, env.get(ENV_SIDE) or "this job step")
