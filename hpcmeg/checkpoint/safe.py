"""Loading checkpoint files without running their code, and the RNG entry of a checkpoint.

Contract
- `safe_torch_load(path, mmap=False)`: torch.load(map_location="cpu", weights_only=True) with argparse.Namespace
  allow-listed. UnsafeCheckpointError names the global a pickle wanted (nothing of it ran);
  UnreadableCheckpointError is a corrupt or truncated file (not reported as an attack).
- `capture_rng_state(rng_tracker_states)` / `restore_rng_state(state)`: Megatron's per-rank
  rng_state entry (python, numpy, torch CPU and CUDA generators, and the tracker states of named
  streams), stored so that it stays weights_only-loadable (numpy's key array as an int64 tensor).
"""
from __future__ import annotations

import argparse
import contextlib
import pickle
import random
import re
import zipfile
from typing import Any

import numpy as np
import torch


class UnsafeCheckpointError(RuntimeError):
    """The file's pickle references a global outside the weights_only allow-list."""


class UnreadableCheckpointError(RuntimeError):
    """The file is not a torch checkpoint that weights_only loading can read (corrupt, truncated, or
    a pickle using opcodes the safe unpickler does not run); nothing in it was executed."""


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def safe_torch_load(path: str, mmap: bool = False) -> Any:
    """torch.load(map_location="cpu", weights_only=True) with argparse.Namespace allow-listed.
    ``mmap``: map the tensors' storage instead of reading it (reading the args and the dict's keys of
    a multi-GB shard then costs its pickle only).

    Raises UnsafeCheckpointError naming the global when the pickle needs arbitrary code, and
    UnreadableCheckpointError when the safe unpickler rejects the bytes for another reason (random
    bytes, a truncated pickle): a corrupt file must not be reported as an attack, nor vice versa."""
    try:
        with _allow_namespace():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        m = _GLOBAL_RE.search(str(e))
        if m is None:
            detail = next((ln.strip() for ln in str(e).split("WeightsUnpickler error:")[-1].splitlines() if ln.strip()),
                          type(e).__name__)
            raise UnreadableCheckpointError(
                f"{path}: not a readable torch checkpoint ({detail[:120]}); the file is corrupt or was not "
                f"written by torch.save") from None
        raise UnsafeCheckpointError(
            f"{path}: this checkpoint needs arbitrary code to unpickle ({m.group(1)}); hpcmeg refuses to load it. "
            f"Re-save it with plain tensors/containers and an argparse.Namespace args, or load it yourself "
            f"with weights_only=False if you trust its origin") from None
    except (RuntimeError, EOFError) as e:  # a truncated or damaged zip container, an empty file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
        raise UnreadableCheckpointError(f"{path}: not a readable torch checkpoint ({first}); the file is corrupt "
                                        f"or truncated") from None
    except Exception as e:
        # not a zip archive: torch.load falls back to its pre-1.6 reader, which on arbitrary bytes can
        # fail with KeyError, ValueError, struct.error, ... (the random-bytes test hit KeyError: 205).
        # A real zip checkpoint that fails this way is a bug worth its traceback, so only non-zips here.
        if zipfile.is_zipfile(path):
            raise
        raise UnreadableCheckpointError(f"{path}: not a readable torch checkpoint (not a zip archive; the legacy "
                                        f"reader failed with {type(e).__name__}); the file is corrupt or was not "
                                        f"written by torch.save") from None


def _allow_namespace():
    ser = torch.serialization
    if hasattr(ser, "safe_globals"):  # torch >= 2.5: scoped allow-list
        return ser.safe_globals([argparse.Namespace])
    ser.add_safe_globals([argparse.Namespace])  # torch 2.4: process-wide, harmless for Namespace
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------- RNG

def capture_rng_state(rng_tracker_states: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Megatron's per-rank rng_state entry. numpy's key array becomes an int64 tensor so the
    checkpoint stays weights_only-loadable; python's state is a tuple of ints (already safe)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": dict(rng_tracker_states or {}),
    }


def restore_rng_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of capture_rng_state; returns the rng_tracker_states for the TP RNG tracker."""
    random.setstate(_to_tuple(state["random_rng_state"]))
    kind, keys, pos, has_gauss, gauss = state["np_rng_state"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    return dict(state.get("rng_tracker_states") or {})


def _to_tuple(x: Any) -> Any:
    # random.setstate insists on tuples; a state that went through JSON or a list-based writer has lists
    return tuple(_to_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x
