# shellcheck shell=bash
# slurm/common.sh: what slurm/preprocess.sh, slurm/train.sh and slurm/convert.sh share, sourced by them
# (never run itself): which `hpcmeg` command they run (find_hpcmeg), where a batch job's own log goes
# (move_slurm_log), how the command is started (on the node, in an apptainer image, or through pyxis),
# the check that it is the hpcmeg that wrote the run, and the --cpus-per-task every srun must pass.
# sbatch copies only the submitted script to its spool directory, so the scripts find this file
# themselves: $HPCMEG_ROOT/slurm when HPCMEG_ROOT is set, else beside the script they were started as
# (for a batch job: the file sbatch was given, scontrol's Command=), else $SLURM_SUBMIT_DIR/slurm.
# Keep it beside the three scripts when you copy them.

# find_hpcmeg
#   reads the caller's CONTAINER_RUNTIME and HPCMEG and uses its die.
#   In a container HPCMEG is the command inside the image (default hpcmeg). On the host
#   (CONTAINER_RUNTIME=none) the first of: HPCMEG as given (its first word must be a command here); the
#   checkout's .venv/bin/hpcmeg, the checkout being HPCMEG_ROOT or the directory above this file's slurm/;
#   hpcmeg on PATH; <checkout>/.venv/bin/python, then python3 on PATH, as "python -m hpcmeg.cli" when it
#   imports hpcmeg from the checkout (PYTHONPATH gets the checkout). None: one line through die.
#   Sets and exports HPCMEG (an absolute path where it searched), so the jobs a script submits and the
#   ranks it starts run the same one; sets hpcmeg_from (a few words on where it came from).
# shellcheck disable=SC2034  # hpcmeg_from is the caller's
find_hpcmeg() {
  local root w py where
  if [ "$CONTAINER_RUNTIME" != none ]; then
    HPCMEG=${HPCMEG:-hpcmeg}; hpcmeg_from="the command in the $CONTAINER_RUNTIME image"; export HPCMEG; return 0
  fi
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)   # the checkout this file is in (HPCMEG_ROOT if set)
  if [ -n "${HPCMEG:-}" ]; then
    read -r -a w <<< "$HPCMEG"
    if ! command -v "${w[0]:-}" > /dev/null 2>&1; then
      where=""; [ -x "$root/.venv/bin/hpcmeg" ] && where=" (or leave it unset: $root/.venv/bin/hpcmeg)"
      die "HPCMEG='$HPCMEG': '${w[0]:-}' is not a command here; set HPCMEG=/path/to/venv/bin/hpcmeg$where"
    fi
    hpcmeg_from="HPCMEG"
  elif [ -x "$root/.venv/bin/hpcmeg" ]; then
    HPCMEG=$root/.venv/bin/hpcmeg; hpcmeg_from="the checkout's .venv"
  elif where=$(command -v hpcmeg); then
    HPCMEG=$where; hpcmeg_from="PATH"
  else
    for py in "$root/.venv/bin/python" python3; do
      py=$(command -v "$py") || continue
      # the checkout itself must be what imports (not another hpcmeg installed for that python)
      where=$(PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} "$py" -c \
              'import os, hpcmeg.cli; print(os.path.dirname(os.path.dirname(os.path.realpath(hpcmeg.__file__))))' \
              2> /dev/null) || continue
      [ "$where" = "$root" ] || continue
      HPCMEG="$py -m hpcmeg.cli"; hpcmeg_from="$py importing $root"
      export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
      break
    done
    [ -n "${HPCMEG:-}" ] || die "no hpcmeg found: not $root/.venv/bin/hpcmeg, not on PATH, and no python imports it from $root; set HPCMEG=/path/to/venv/bin/hpcmeg (or HPCMEG_ROOT=<an hpcmeg checkout with its .venv>), e.g. sbatch --export=ALL,HPCMEG=/path/to/venv/bin/hpcmeg"
  fi
  export HPCMEG
}

# move_slurm_log NAME DEST
#   When this batch job writes to the script's own #SBATCH --output default (NAME, a file Slurm opened in
#   the job's working directory before the script ran, where no variable can be used), stdout and stderr
#   go to DEST (appended) from here on and NAME is removed while still empty, so nothing stays in the
#   submit directory. A log that sbatch --output/--error placed elsewhere is left alone. Uses the
#   caller's die.
move_slurm_log() {
  local from=$PWD/$1 to=$2
  [ -n "${SLURM_JOB_ID:-}" ] && [ -f "$from" ] && [ "$from" -ef /dev/stdout ] || return 0
  mkdir -p "$(dirname "$to")" || die "cannot create $(dirname "$to") for this job's log"
  if [ "$from" -ef /dev/stderr ]; then exec >> "$to" 2>&1; else exec >> "$to"; fi
  [ -s "$from" ] || rm -f "$from"
}

# container_setup [--require-image] [--nv]
#   reads the caller's CONTAINER_RUNTIME, IMAGE, BINDS, HPCMEG, VERSION_CHECK, RUN_DIR and uses its die;
#   --require-image: apptainer and pyxis stop at once when IMAGE is empty;
#   --nv: apptainer gets --nv when the job has GPUs (SLURM_GPUS_ON_NODE / SLURM_JOB_GPUS).
#   Sets hpcmeg_cmd (HPCMEG as words), srun_container (srun's pyxis options), prefix (the apptainer exec
#   prefix) and cpus (--cpus-per-task=$SLURM_CPUS_PER_TASK: Slurm 22.05+ does not pass it on to a step),
#   and exports HPCMEG_VERSION_FILE / HPCMEG_VERSION_SIDE when RUN_DIR holds hpcmeg_version.json.
# shellcheck disable=SC2034  # the arrays are the caller's
container_setup() {
  local require_image=0 gpu=0 a nv=()
  for a in "$@"; do
    case "$a" in
      --require-image) require_image=1 ;;
      --nv) gpu=1 ;;
      *) die "container_setup: unknown option $a" ;;
    esac
  done
  read -r -a hpcmeg_cmd <<< "$HPCMEG"
  srun_container=()
  prefix=()
  case "$CONTAINER_RUNTIME" in
    none) ;;
    apptainer) [ "$require_image" = 0 ] || [ -n "$IMAGE" ] || die "CONTAINER_RUNTIME=apptainer needs IMAGE=/path/image.sif"
               [ "$gpu" = 1 ] && [ -n "${SLURM_GPUS_ON_NODE:-}${SLURM_JOB_GPUS:-}" ] && nv=(--nv)
               prefix=(apptainer exec "${nv[@]}" --bind "$BINDS" "$IMAGE") ;;
    pyxis) [ "$require_image" = 0 ] || [ -n "$IMAGE" ] || die "CONTAINER_RUNTIME=pyxis needs IMAGE=registry#image:tag or /path/image.sqsh"
           srun_container=(--container-image="$IMAGE" --container-mounts="$BINDS" --no-container-mount-home) ;;
    *) die "CONTAINER_RUNTIME=$CONTAINER_RUNTIME: use none, apptainer or pyxis" ;;
  esac
  if [ "$CONTAINER_RUNTIME" != none ]; then
    unset PYTHONPATH PYTHONHOME VIRTUAL_ENV   # the host's Python paths must not shadow the image's packages
  fi
  if [ "$VERSION_CHECK" = 1 ] && [ -f "$RUN_DIR/hpcmeg_version.json" ]; then
    export HPCMEG_VERSION_FILE="$RUN_DIR/hpcmeg_version.json"
    if [ "$CONTAINER_RUNTIME" = none ]; then export HPCMEG_VERSION_SIDE="the command '$HPCMEG' on the node"
    else export HPCMEG_VERSION_SIDE="the $CONTAINER_RUNTIME image $IMAGE"; fi
  fi
  cpus=(); [ -n "${SLURM_CPUS_PER_TASK:-}" ] && cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
  return 0
}
