"""slurm/setup-dev.sh: the CPU build of torch without a GPU, visible downloads, no NumPy warning.

A full run from an empty venv takes minutes (it was checked by hand: HPCMEG_VENV=/tmp/v bash
slurm/setup-dev.sh); here: where torch would come from (asked of pip without downloading), what the
venv this suite runs in got, and a second run that must install nothing and warn about nothing.
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / "slurm" / "setup-dev.sh"
VENV = Path(sys.prefix)


def _source(tmp_path: Path, **env) -> str:
    e = dict(os.environ, HPCMEG_VENV=str(VENV), **env)
    r = subprocess.run(["bash", str(SCRIPT), "--print-torch-source"], env=e, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_torch_source_follows_the_gpu(tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"  # a machine with an NVIDIA GPU (only its presence is checked)
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert _source(tmp_path, PATH=f"{fake.parent}:{os.environ['PATH']}") == "default"
    assert _source(tmp_path, HPCMEG_TORCH_INDEX="cpu") == "cpu-index"
    # a CPU build that no configured source has: PyTorch's CPU index, never PyPI's CUDA wheel
    assert _source(tmp_path, HPCMEG_TORCH="torch==2.0.99") == "cpu-index"
    assert _source(tmp_path) in ("pip", "cpu-index")


def test_this_venv_got_the_cpu_build():
    import torch

    assert torch.version.cuda is None and not any(
        d.name.startswith("nvidia_") for d in (VENV / "lib").glob("python*/site-packages/*"))


def test_no_hidden_downloads_and_no_numpy_warning(tmp_path):
    text = SCRIPT.read_text()
    installs = [ln for ln in text.splitlines() if re.search(r"\bpip_? install\b", ln)]
    assert installs and all(" -q" not in ln for ln in installs if "--dry-run" not in ln), installs
    # torch is imported (which without numpy prints "Failed to initialize NumPy") only in the last line,
    # after hpcmeg's dependencies (numpy) are installed
    body = text.split("installing hpcmeg[test]")
    assert "import torch" not in body[0] and text.count("import torch") == 1
    e = dict(os.environ, HPCMEG_VENV=str(VENV), HPCMEG_NO_SLURM="1")
    r = subprocess.run(["bash", str(SCRIPT)], env=e, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Failed to initialize NumPy" not in r.stdout + r.stderr and "installing" not in r.stderr, r.stderr
    assert re.search(r"ready: .* \(torch 2\.\d+\.\d+", r.stderr)
