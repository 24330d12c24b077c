#!/usr/bin/env bash
# slurm/train.sh: `hpcmeg train RECIPE` as a requeueable multi-node job, for people who drive sbatch.
#
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 \
#          --export=ALL,RECIPE=/lustre/runs/gpt2/recipe.yaml,CONTAINER_RUNTIME=apptainer,IMAGE=/lustre/hpcmeg.sif \
#          slurm/train.sh
#
# On GPU nodes add --gpus-per-node=G with --ntasks-per-node=G (one task per GPU).
# (`hpcmeg submit` generates the same job for you, plus preprocessing and conversion; this file is the
# hand-driven equivalent.) One task per GPU (or per CPU rank): each runs `hpcmeg train RECIPE` inside
# the container and takes its rank from SLURM_PROCID / SLURM_NTASKS (hpcmeg.procenv). Resuming from
# the latest checkpoint is automatic.
#
# Preemption and time limits: Slurm sends SIGTERM to every rank SIGNAL_LEAD seconds before the end
# (--signal without "B:" reaches the job steps, not this batch shell). The ranks agree, save the same
# iteration and exit 3. This script (on the host, where scontrol exists) then requeues the job under
# the SAME job id (an `afterok` conversion job keeps waiting) when SLURM_RESTART_COUNT < MAX_REQUEUES
# and the checkpointed iteration advanced during this run; otherwise it fails with a clear line. When
# Slurm itself ends the job (scancel, scontrol requeue, preemption) this shell gets SIGTERM too: it
# waits for the ranks' save and leaves the requeue decision to Slurm.
# Logs, all under LOG_DIR (RUN_DIR/logs/train): train.<jobid>.r<restart>.<task>.log per rank and restart,
# and this batch shell's own lines in train.<jobid>.out, appended, never truncated. Slurm opens the
# #SBATCH --output default (hpcmeg-train-<jobid>.out in the submit directory, which cannot name RUN_DIR)
# before the script runs; the script moves its output to LOG_DIR at once and removes that empty file,
# so it stays only when the job refused before (no RECIPE, no hpcmeg: its one line is then there).
# An --output given to sbatch is left where it is.
# hpcmeg (CONTAINER_RUNTIME=none): HPCMEG if set, else <checkout>/.venv/bin/hpcmeg (the checkout:
# HPCMEG_ROOT, or the directory above slurm/), else hpcmeg on PATH, else a python that imports hpcmeg
# from the checkout; none found: one line, exit 1, before any rank starts (slurm/common.sh find_hpcmeg).
# Cores: srun gets --cpus-per-task=$SLURM_CPUS_PER_TASK explicitly (Slurm 22.05+ no longer passes the
# job's value on to a step, so on sites with CPU binding each rank would get one core).
# Version check: when RUN_DIR holds hpcmeg_version.json (written by `hpcmeg submit`, also --dry-run),
# every rank checks that its hpcmeg is the one that wrote the run (VERSION_CHECK=0 skips it).
# Finding hpcmeg, moving the log, the container / version-check / --cpus-per-task part: slurm/common.sh,
# shared with preprocess.sh and convert.sh: keep it beside this file when you copy it, or set
# HPCMEG_ROOT=<the hpcmeg checkout>.
#
#SBATCH --job-name=hpcmeg-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=TERM@120
#SBATCH --open-mode=append
#SBATCH --output=hpcmeg-train-%j.out
set -uo pipefail

# ---- settings (override any of them with sbatch --export=ALL,NAME=value or the environment) ----
RECIPE=${RECIPE:-recipe.yaml}                        # the recipe every rank trains (resolved paths preferred)
RUN_DIR=${RUN_DIR:-$(dirname "$RECIPE")}             # <run.output_root>/<run.name>: train_status.json lives here
CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}           # checkpoint.dir of the recipe (progress check)
LOG_DIR=${LOG_DIR:-$RUN_DIR/logs/train}
MAX_REQUEUES=${MAX_REQUEUES:-3}                      # restarts allowed (SLURM_RESTART_COUNT)
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-none}         # none | apptainer | pyxis
IMAGE=${IMAGE:-}                                     # apptainer .sif path or pyxis/enroot image
BINDS=${BINDS:-$RUN_DIR}                             # comma list: apptainer --bind / pyxis --container-mounts
HPCMEG=${HPCMEG:-}                                   # the command, e.g. "python3 -m hpcmeg.cli"; empty: found (above); in a container: hpcmeg
VERSION_CHECK=${VERSION_CHECK:-1}                    # 0: run even if the hpcmeg differs from the run's
EXIT_REQUEUE=3                                       # hpcmeg train: "saved, requeue me"

log() { printf '[train.sh %(%F %T)T] %s\n' -1 "$*"; }
die() { log "ERROR: $*"; exit 1; }
iteration() { local t; t=$(cat "$CKPT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null) || t=-1; [ "$t" = release ] && t=0; echo "$t"; }
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

[ -f "$RECIPE" ] || die "RECIPE=$RECIPE: no such file (sbatch --export=ALL,RECIPE=/path/recipe.yaml)"
find_hpcmeg
container_setup --require-image --nv
restart=${SLURM_RESTART_COUNT:-0}
mkdir -p "$LOG_DIR" || die "cannot create LOG_DIR=$LOG_DIR"
move_slurm_log "hpcmeg-train-${SLURM_JOB_ID:-}.out" "$LOG_DIR/train.${SLURM_JOB_ID:-}.out"
log "hpcmeg: $HPCMEG (from $hpcmeg_from)"
before=$(iteration)
log "job ${SLURM_JOB_ID:-?} restart $restart: $RECIPE, checkpointed iteration $before"
ended=0
trap 'ended=1; log "SIGTERM: Slurm is ending this job; waiting for the ranks to save"' TERM
start=$(date +%s)
srun "${cpus[@]}" --kill-on-bad-exit=1 --open-mode=append --output="$LOG_DIR/train.%j.r${restart}.%t.log" \
    "${srun_container[@]}" "${prefix[@]}" "${hpcmeg_cmd[@]}" train "$RECIPE" &
pid=$!
rc=0; wait "$pid" || rc=$?
while kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" || rc=$?; done  # a trapped signal interrupts wait
after=$(iteration)
# srun --kill-on-bad-exit may report a killed straggler (143) when rank 0 exited 3: rank 0's status
# file (written during this run) says what really happened
if [ "$rc" -ne 0 ] && [ "$rc" -ne "$EXIT_REQUEUE" ] && [ -f "$RUN_DIR/train_status.json" ] \
   && [ "$(stat -c %Y "$RUN_DIR/train_status.json")" -ge "$start" ] \
   && grep -q '"status": "preempted"' "$RUN_DIR/train_status.json"; then
  rc=$EXIT_REQUEUE
fi
log "training step exit code $rc; checkpointed iteration $before -> $after"
if [ "$ended" = 1 ]; then
  log "Slurm ended the job (requeue, preemption, cancel or time limit): it decides whether the job runs again"
  exit 0
fi
[ "$rc" -eq 0 ] && { log "finished"; exit 0; }
[ "$rc" -eq "$EXIT_REQUEUE" ] || die "training failed with exit code $rc (see $LOG_DIR)"
[ "$restart" -lt "$MAX_REQUEUES" ] || die "stopped at iteration $after: restart cap reached ($restart >= MAX_REQUEUES=$MAX_REQUEUES)"
[ "$after" -gt "$before" ] || die "stopped at iteration $after without progress since this run started: not requeueing (loop guard)"
log "requeueing job $SLURM_JOB_ID (restart $((restart + 1))/$MAX_REQUEUES)"
scontrol requeue "$SLURM_JOB_ID" || die "scontrol requeue $SLURM_JOB_ID failed"
exit 0
