"""The pre-buffer training step (commit cdff461: TrainStep + MasterWeightAdamW, gradients gathered
into a flat buffer after backward), loaded as modules for same-run comparisons with the buffer path.

`python bench/legacy.py` writes bench/legacy_cdff461/{optim,step}.py from git (run it before a GPU
call: the device copy has no .git; the folder is git-ignored, never committed). `optim()` / `step()`
import them: legacy step.py's `from hpcmeg.train.optim import ...` is pointed at legacy optim.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

COMMIT = "cdff461"
HERE = os.path.dirname(os.path.abspath(__file__))
DIR = os.path.join(HERE, f"legacy_{COMMIT}")


def extract() -> None:
    os.makedirs(DIR, exist_ok=True)
    for name in ("optim", "step"):
        text = subprocess.run(["git", "show", f"{COMMIT}:hpcmeg/train/{name}.py"], cwd=HERE, check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("from hpcmeg.train.optim import", "from legacy_optim import")
        with open(os.path.join(DIR, f"{name}.py"), "w") as f:
            f.write(text)
    print(f"wrote {DIR}")


def _load(name: str):
    mod = f"legacy_{name}"
    if mod not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod, os.path.join(DIR, f"{name}.py"))
        m = importlib.util.module_from_spec(spec)
        sys.modules[mod] = m
        spec.loader.exec_module(m)
    return sys.modules[mod]


def optim():
    return _load("optim")


def step():
    optim()
    return _load("step")


if __name__ == "__main__":
    extract()
