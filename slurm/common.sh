# shellcheck shell=bash
# slurm/common.sh: what slurm/train.sh and slurm/convert.sh share, sourced by both (never run itself):
# how the `hpcmeg` command is started (on the node, in an apptainer image, or through pyxis), the check
# that it is the hpcmeg that wrote the run, and the --cpus-per-task every srun must pass.
# sbatch copies only the submitted script to its spool directory, so the scripts find this file
# themselves: $HPCMEG_ROOT/slurm when HPCMEG_ROOT is set, else beside the running script (bash
# slurm/train.sh), else beside the script sbatch was given (scontrol's Command=), else
# $SLURM_SUBMIT_DIR/slurm. Keep it beside train.sh and convert.sh when you copy them.

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
