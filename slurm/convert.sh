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
# Logs: this job's lines go to LOG_DIR/convert.<jobid>.out (LOG_DIR: RUN_DIR/logs/convert; for an array
# task <array id>_<task>). Slurm opens the #SBATCH --output default (hpcmeg-convert-<jobid>.out in the
# submit directory, which cannot name RUN_DIR) before the script runs; the script moves its output to
# LOG_DIR as soon as it has found hpcmeg and the checkpoints and removes that empty file, so it stays
# only when the job refused before (its one line is then there). An --output given to sbatch is left alone.
# hpcmeg (CONTAINER_RUNTIME=none): HPCMEG if set, else <checkout>/.venv/bin/hpcmeg (the checkout:
# HPCMEG_ROOT, or the directory above slurm/), else hpcmeg on PATH, else a python that imports hpcmeg
# from the checkout; none found: one line, exit 1 (slurm/common.sh find_hpcmeg).
# Finding hpcmeg, moving the log, the container / version-check / --cpus-per-task part: slurm/common.sh,
# shared with preprocess.sh and train.sh: keep it beside this file when you copy it, or set
# HPCMEG_ROOT=<the hpcmeg checkout>.
#
#SBATCH --job-name=hpcmeg-convert
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=4
#SBATCH --time=01:00:00
#SBATCH --open-mode=append
#SBATCH --output=hpcmeg-convert-%j.out
set -euo pipefail

# ---- settings (override any of them with sbatch --export=ALL,NAME=value or the environment) ----
CKPT_DIR=${CKPT_DIR:-checkpoints}                    # holds latest_checkpointed_iteration.txt
OUT_DIR=${OUT_DIR:-hf}
ITERATIONS=${ITERATIONS:-last}                       # last | all | comma list
DTYPE=${DTYPE:-fp32}                                 # fp32 | bf16 | fp16
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-none}         # none | apptainer | pyxis
IMAGE=${IMAGE:-}
BINDS=${BINDS:-$(dirname "$CKPT_DIR")}               # comma list: apptainer --bind / pyxis --container-mounts
HPCMEG=${HPCMEG:-}                                   # the command; empty: found (above); in a container: hpcmeg
VERSION_CHECK=${VERSION_CHECK:-1}                    # 0: skip the check against RUN_DIR/hpcmeg_version.json
RUN_DIR=${RUN_DIR:-$(dirname "$CKPT_DIR")}           # the run directory (hpcmeg_version.json)
LOG_DIR=${LOG_DIR:-$RUN_DIR/logs/convert}

log() { printf '[convert.sh %(%F %T)T] %s\n' -1 "$*"; }
die() { log "ERROR: $*"; exit 1; }
# this script as started: under sbatch bash runs a spool copy with no common.sh beside it, and
# scontrol's Command= names the file sbatch was given (as typed, relative to the submit directory,
# followed by the script's arguments)
origin() {
  local c=${BASH_SOURCE[0]}
  if [ -n "${SLURM_JOB_ID:-}" ] && [ ! -f "$(dirname "$c")/common.sh" ]; then
    c=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=//p' | head -n 1)
    [[ $c == /* ]] || c=${SLURM_SUBMIT_DIR:-$PWD}/$c
    while [ ! -f "$c" ] && [[ $c == *" "* ]]; do c=${c% *}; done
  fi
  readlink -f "$c" || printf '%s\n' "$c"
}
# slurm/common.sh: $HPCMEG_ROOT/slurm when HPCMEG_ROOT is set, else beside this script, else $SLURM_SUBMIT_DIR/slurm
common_sh() {
  local c
  if [ -n "${HPCMEG_ROOT:-}" ]; then c=$HPCMEG_ROOT/slurm/common.sh
  else c=$(dirname "$self")/common.sh
       [ -f "$c" ] || [ -z "${SLURM_SUBMIT_DIR:-}" ] || c=$SLURM_SUBMIT_DIR/slurm/common.sh; fi
  [ -f "$c" ] && readlink -f "$c"
}
self=$(origin)
common=$(common_sh) || die "slurm/common.sh not found beside ${self:-this script}${HPCMEG_ROOT:+ (HPCMEG_ROOT=$HPCMEG_ROOT)}: keep it beside the script you submit, or set HPCMEG_ROOT=<the hpcmeg checkout>"
# shellcheck source=common.sh source-path=SCRIPTDIR
. "$common"

find_hpcmeg
tracker="$CKPT_DIR/latest_checkpointed_iteration.txt"
[ -f "$tracker" ] || die "no checkpoint in $CKPT_DIR (no latest_checkpointed_iteration.txt)"
tag=${SLURM_JOB_ID:-}; [ -n "${SLURM_ARRAY_TASK_ID:-}" ] && tag=${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID
move_slurm_log "hpcmeg-convert-${SLURM_JOB_ID:-}.out" "$LOG_DIR/convert.$tag.out"
log "hpcmeg: $HPCMEG (from $hpcmeg_from)"
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
