#!/usr/bin/env bash
# slurm/convert.sh: Megatron-layout checkpoints -> Hugging Face GPT-2 directories, one array task per
# iteration, for people who drive sbatch (`hpcmeg submit` generates the same stage for you).
#
#   sbatch --array=0-0 --dependency=afterok:<train job id> --kill-on-invalid-dep=yes \
#          --export=ALL,CKPT_DIR=/lustre/runs/gpt2/checkpoints,OUT_DIR=/lustre/runs/gpt2/hf slurm/convert.sh
#
# ITERATIONS picks what to convert, resolved when the task runs (so it works after a time-out, from
# whatever checkpoints exist): "last" (the tracker's iteration; one task), "all" (array task i converts
# the i-th committed iteration; tasks beyond the list exit 0), or "100,200" (task i converts the i-th).
# Output: OUT_DIR/iter_XXXXXXX/. Runs `hpcmeg convert` inside the container; CPU only. srun gets
# --cpus-per-task=$SLURM_CPUS_PER_TASK explicitly (Slurm 22.05+ does not pass it on to the step).
# That container / version-check / --cpus-per-task part is slurm/common.sh, shared with train.sh: keep
# it beside this file when you copy it, or set HPCMEG_ROOT=<the hpcmeg checkout>.
#
#SBATCH --job-name=hpcmeg-convert
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=4
#SBATCH --time=01:00:00
#SBATCH --open-mode=append
#SBATCH --output=hpcmeg-convert-%A_%a.out
set -euo pipefail

# ---- settings (override any of them with sbatch --export=ALL,NAME=value or the environment) ----
CKPT_DIR=${CKPT_DIR:-checkpoints}                    # holds latest_checkpointed_iteration.txt
OUT_DIR=${OUT_DIR:-hf}
ITERATIONS=${ITERATIONS:-last}                       # last | all | comma list
DTYPE=${DTYPE:-fp32}                                 # fp32 | bf16 | fp16
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-none}         # none | apptainer | pyxis
IMAGE=${IMAGE:-}
BINDS=${BINDS:-$(dirname "$CKPT_DIR")}               # comma list: apptainer --bind / pyxis --container-mounts
HPCMEG=${HPCMEG:-hpcmeg}                             # the command inside the container
VERSION_CHECK=${VERSION_CHECK:-1}                    # 0: skip the check against RUN_DIR/hpcmeg_version.json
RUN_DIR=${RUN_DIR:-$(dirname "$CKPT_DIR")}           # the run directory (hpcmeg_version.json)

log() { printf '[convert.sh %(%F %T)T] %s\n' -1 "$*"; }
die() { log "ERROR: $*"; exit 1; }
# slurm/common.sh (container_setup). sbatch runs a spool copy of this file, so it is looked up:
# $HPCMEG_ROOT/slurm when HPCMEG_ROOT is set, else beside this file, else beside the script sbatch was
# given (scontrol's Command=), else $SLURM_SUBMIT_DIR/slurm.
common_sh() {
  local c
  if [ -n "${HPCMEG_ROOT:-}" ]; then c=$HPCMEG_ROOT/slurm/common.sh
  else
    c=$(dirname "${BASH_SOURCE[0]}")/common.sh
    if [ ! -f "$c" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
      c=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=//p' | head -n 1)
      c=$(dirname "${c:-/nonexistent/x}")/common.sh
    fi
    [ -f "$c" ] || [ -z "${SLURM_SUBMIT_DIR:-}" ] || c=$SLURM_SUBMIT_DIR/slurm/common.sh
  fi
  [ -f "$c" ] && printf '%s\n' "$c"
}
common=$(common_sh) || die "slurm/common.sh not found (${HPCMEG_ROOT:+HPCMEG_ROOT=$HPCMEG_ROOT; }sbatch runs a copy of this script): set HPCMEG_ROOT=<the hpcmeg checkout> or keep common.sh beside the script you submit"
# shellcheck source=common.sh source-path=SCRIPTDIR
. "$common"

tracker="$CKPT_DIR/latest_checkpointed_iteration.txt"
[ -f "$tracker" ] || die "no checkpoint in $CKPT_DIR (no latest_checkpointed_iteration.txt)"
latest=$(cat "$tracker")
[ "$latest" = release ] && latest=0
case "$ITERATIONS" in
  last) its=("$latest") ;;
  all) its=()
       for d in "$CKPT_DIR"/iter_[0-9][0-9][0-9][0-9][0-9][0-9][0-9]; do
         [ -d "$d" ] || continue
         it=$((10#${d##*/iter_}))
         [ "$it" -le "$latest" ] && its+=("$it")   # newer than the tracker = an unfinished save
       done ;;
  *) IFS=, read -r -a its <<< "$ITERATIONS" ;;
esac
task=${SLURM_ARRAY_TASK_ID:-0}
if [ "$task" -ge "${#its[@]}" ]; then
  log "array task $task: only ${#its[@]} iteration(s) to convert (${its[*]:-none}); nothing to do"
  exit 0
fi
it=${its[$task]}
[[ "$it" =~ ^[0-9]+$ ]] || die "ITERATIONS=$ITERATIONS: '$it' is not an iteration number"
[ -d "$CKPT_DIR/$(printf 'iter_%07d' "$it")" ] || die "iteration $it has no checkpoint in $CKPT_DIR"

# shellcheck disable=SC2119  # no options: IMAGE is not checked here, no --nv (CPU only)
container_setup
out="$OUT_DIR/$(printf 'iter_%07d' "$it")"
log "array task $task: converting iteration $it -> $out"
srun --ntasks=1 "${cpus[@]}" "${srun_container[@]}" "${prefix[@]}" \
    "${hpcmeg_cmd[@]}" convert "$CKPT_DIR" "$out" --iteration "$it" --dtype "$DTYPE"
