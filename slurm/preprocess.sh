#!/usr/bin/env bash
# slurm/preprocess.sh: sharded `hpcmeg preprocess` on Slurm, then one merged dataset.
#
#   sbatch slurm/preprocess.sh                       # variables below edited, or:
#   sbatch --export=ALL,INPUT_GLOB='/data/shards/*.jsonl.gz',OUTPUT_PREFIX=/data/out/codeparrot slurm/preprocess.sh
#   bash slurm/preprocess.sh                         # same, submitting straight from the login node
#
# hpcmeg: the one this checkout comes with, found before anything is submitted (slurm/common.sh
# find_hpcmeg): HPCMEG if set (e.g. HPCMEG=/path/to/venv/bin/hpcmeg), else <checkout>/.venv/bin/hpcmeg
# (the checkout: HPCMEG_ROOT, or the directory above slurm/), else hpcmeg on PATH, else a python that
# imports hpcmeg from the checkout; none found: one line, exit 2, nothing submitted or written. The
# shard and merge jobs run the one the launch found. Keep slurm/common.sh beside this file.
# Files: everything goes beside OUTPUT_PREFIX: the shard list, the datasets, and the logs
# preprocess-launch-<jobid>.out (the launch job's, when launched with sbatch), preprocess-<array>_<i>.out
# and preprocess-merge-<jobid>.out. A launch job's log starts where Slurm opens it before the script runs
# (#SBATCH --output: hpcmeg-preprocess-<jobid>.out in the submit directory; it cannot name OUTPUT_PREFIX's
# directory); the launch moves its output beside OUTPUT_PREFIX at once and removes that empty file, so
# it stays only when the launch refused before that (its one line is then there).
#
# What happens (three modes of this one file, chosen by MODE):
#   launch (default)  lists the shards matching INPUT_GLOB (sorted, written to <OUTPUT_PREFIX>.shards.txt),
#                     submits this script as an array job (MODE=shard, one task per shard) and a merge
#                     job (MODE=merge) with --dependency=afterok on the whole array; prints both ids.
#   shard             task i runs `hpcmeg preprocess` on shard i -> <OUTPUT_PREFIX>_shard<i>_<key>_<level>
#   merge             `hpcmeg merge-datasets` of the shard datasets in shard order -> <OUTPUT_PREFIX>_<key>_<level>,
#                     then deletes the shard datasets (KEEP_SHARDS=1 keeps them).
# The merged dataset equals one `hpcmeg preprocess` over all shards in sorted order. Every step writes
# under temporary names and renames at the end, so a failed or preempted task leaves nothing that
# looks finished; rerunning the script redoes the work.
# Resources: CPUS_PER_TASK (also the number of tokenizer workers) is sized from `sinfo` when unset:
# the smallest node of the partition, at most 8. Before submitting, `sbatch --test-only` asks Slurm
# whether it could ever run the shard tasks; if not, launch stops with Slurm's reason instead of
# leaving an array pending forever. The merge job has --kill-on-invalid-dep=yes: a failed shard
# cancels it (also on clusters without DependencyParameters=kill_invalid_depend). In pyxis mode srun
# gets --cpus-per-task explicitly (Slurm 22.05+ does not pass the job's value on to a step).
#
#SBATCH --job-name=hpcmeg-preprocess
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --output=hpcmeg-preprocess-%j.out
set -euo pipefail

# ---- settings (override any of them with sbatch --export=ALL,NAME=value or the environment) ----
INPUT_GLOB=${INPUT_GLOB:-data/shards/*.jsonl}        # one array task per matching file (.jsonl or .jsonl.gz)
OUTPUT_PREFIX=${OUTPUT_PREFIX:-data/codeparrot}      # -> ${OUTPUT_PREFIX}_${key}_document.{bin,idx}
JSON_KEYS=${JSON_KEYS:-text}                         # space-separated
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}   # or HuggingFaceTokenizer (then TOKENIZER_MODEL=dir)
VOCAB_FILE=${VOCAB_FILE:-}                           # empty: the GPT-2 files shipped with hpcmeg
MERGE_FILE=${MERGE_FILE:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
APPEND_EOD=${APPEND_EOD:-1}
SPLIT_SENTENCES=${SPLIT_SENTENCES:-0}
EXTRA_ARGS=${EXTRA_ARGS:-}                           # more `hpcmeg preprocess` flags, e.g. --skip-bad-lines
CPUS_PER_TASK=${CPUS_PER_TASK:-}                     # per shard task = tokenizer workers; empty: from sinfo (<= 8)
SHARD_TIME=${SHARD_TIME:-02:00:00}
SHARD_MEM=${SHARD_MEM:-}                             # e.g. 16G; empty = cluster default
MAX_PARALLEL=${MAX_PARALLEL:-}                       # e.g. 32: at most that many shard tasks at once
MERGE_TIME=${MERGE_TIME:-02:00:00}
PARTITION=${PARTITION:-}                             # empty = cluster default
ACCOUNT=${ACCOUNT:-}
KEEP_SHARDS=${KEEP_SHARDS:-0}
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-none}         # none | apptainer | pyxis
IMAGE=${IMAGE:-}                                     # apptainer .sif path or pyxis/enroot image
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-$PWD}           # pyxis --container-mounts / apptainer --bind
HPCMEG=${HPCMEG:-}                                   # the command; empty: found (above); in a container: hpcmeg
MODE=${MODE:-launch}

log() { printf '[preprocess.sh %s] %s\n' "$MODE" "$*" >&2; }
die() { log "$*"; exit 2; }
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
level=document; [ "$SPLIT_SENTENCES" = 1 ] && level=sentence
shard_list="${OUTPUT_PREFIX}.shards.txt"
shard_prefix() { printf '%s_shard%05d' "$OUTPUT_PREFIX" "$1"; }

# run CMD... directly or inside the container
in_container() {
  case "$CONTAINER_RUNTIME" in
    none) "$@" ;;
    apptainer) apptainer exec --bind "$CONTAINER_MOUNTS" "$IMAGE" "$@" ;;
    pyxis) srun --ntasks=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --container-image="$IMAGE" \
             --container-mounts="$CONTAINER_MOUNTS" --container-workdir="$PWD" "$@" ;;
  esac
}
case "$CONTAINER_RUNTIME" in
  none|apptainer|pyxis) ;;
  *) die "CONTAINER_RUNTIME must be none, apptainer or pyxis (got '$CONTAINER_RUNTIME')" ;;
esac
if [ "$CONTAINER_RUNTIME" != none ] && [ -z "$IMAGE" ]; then
  die "CONTAINER_RUNTIME=$CONTAINER_RUNTIME needs IMAGE=..."
fi
find_hpcmeg
if [ "$CONTAINER_RUNTIME" != none ]; then
  unset PYTHONPATH PYTHONHOME VIRTUAL_ENV   # the host's Python paths must not shadow the image's packages
fi
read -r -a json_keys <<< "$JSON_KEYS"

# size_cpus: CPUS_PER_TASK from the smallest node of PARTITION (or the default partition), at most 8
size_cpus() {
  local part cpus best=""
  while read -r part cpus; do
    cpus=${cpus%+}
    if [ -n "$PARTITION" ]; then [ "${part%\*}" = "$PARTITION" ] || continue
    else [ "${part: -1}" = "*" ] || continue; fi
    [[ "$cpus" =~ ^[0-9]+$ ]] || continue
    if [ -z "$best" ] || [ "$cpus" -lt "$best" ]; then best=$cpus; fi
  done < <(sinfo -h -o '%P %c' 2>/dev/null)
  if [ -z "$best" ]; then
    CPUS_PER_TASK=8; log "CPUS_PER_TASK=8 (sinfo gave no CPU count for ${PARTITION:-the default partition})"
  else
    CPUS_PER_TASK=$(( best < 8 ? best : 8 ))
    log "CPUS_PER_TASK=$CPUS_PER_TASK (sized from sinfo: nodes of ${PARTITION:-the default partition} have $best CPUs; at most 8)"
  fi
}

case "$MODE" in
launch)
  # sorted, one path per line; compgen keeps paths with spaces intact and reports no match as empty
  inputs=$(LC_ALL=C compgen -G "$INPUT_GLOB" | LC_ALL=C sort) || true
  [ -n "$inputs" ] || die "INPUT_GLOB='$INPUT_GLOB' matches no file"
  n=$(printf '%s\n' "$inputs" | wc -l)
  logdir=$(dirname "$OUTPUT_PREFIX")
  mkdir -p "$logdir" || die "cannot create $logdir (the directory of OUTPUT_PREFIX=$OUTPUT_PREFIX)"
  move_slurm_log "hpcmeg-preprocess-${SLURM_JOB_ID:-}.out" "$logdir/preprocess-launch-${SLURM_JOB_ID:-}.out"
  log "hpcmeg: $HPCMEG (from $hpcmeg_from)"
  [ -n "$CPUS_PER_TASK" ] || size_cpus
  opts=(--parsable --job-name="${SLURM_JOB_NAME:-hpcmeg-preprocess}")
  [ -n "$PARTITION" ] && opts+=(--partition="$PARTITION")
  [ -n "$ACCOUNT" ] && opts+=(--account="$ACCOUNT")
  array="0-$((n - 1))"; [ -n "$MAX_PARALLEL" ] && array+="%$MAX_PARALLEL"
  shard_args=(--array="$array" --cpus-per-task="$CPUS_PER_TASK" --time="$SHARD_TIME"
              --output="$logdir/preprocess-%A_%a.out" "--export=ALL,MODE=shard")
  [ -n "$SHARD_MEM" ] && shard_args+=(--mem="$SHARD_MEM")
  # would Slurm ever run it? (a request no node can satisfy would otherwise pend forever, silently)
  if ! why=$(sbatch --test-only "${opts[@]}" "${shard_args[@]}" "$self" 2>&1); then
    log "Slurm would not run the shard tasks (CPUS_PER_TASK=$CPUS_PER_TASK, SHARD_TIME=$SHARD_TIME${SHARD_MEM:+, SHARD_MEM=$SHARD_MEM}${PARTITION:+, PARTITION=$PARTITION}): $(echo "$why" | tr '\n' ' ')"
    log "lower CPUS_PER_TASK / SHARD_TIME / SHARD_MEM or choose another PARTITION; nothing was submitted"
    exit 2
  fi
  printf '%s\n' "$inputs" > "$shard_list.tmp" && mv "$shard_list.tmp" "$shard_list"
  # the jobs run the original file (not a spool copy), so they find common.sh beside it; they inherit
  # HPCMEG (and PYTHONPATH) as found above through --export=ALL
  array_id=$(sbatch "${opts[@]}" "${shard_args[@]}" "$self") || die "sbatch of the shard array failed; nothing was submitted"
  array_id=${array_id%%;*}
  if ! merge_id=$(sbatch "${opts[@]}" --dependency=afterok:"$array_id" --kill-on-invalid-dep=yes --cpus-per-task=1 \
                  --time="$MERGE_TIME" --output="$logdir/preprocess-merge-%j.out" \
                  "--export=ALL,MODE=merge,NUM_SHARDS=$n" "$self"); then
    scancel "$array_id" || true
    die "sbatch of the merge job failed: shard array $array_id cancelled, nothing left queued"
  fi
  merge_id=${merge_id%%;*}
  log "$n shards: array job $array_id, merge job $merge_id (afterok)"
  echo "ARRAY_JOB_ID=$array_id MERGE_JOB_ID=$merge_id"
  ;;
shard)
  i=${SLURM_ARRAY_TASK_ID:?MODE=shard runs as an array task}
  input=$(sed -n "$((i + 1))p" "$shard_list")
  [ -n "$input" ] || { log "no shard $i in $shard_list"; exit 2; }
  args=(--input "$input" --output-prefix "$(shard_prefix "$i")" --json-keys "${json_keys[@]}"
        --tokenizer-type "$TOKENIZER_TYPE" --workers "${SLURM_CPUS_PER_TASK:-${CPUS_PER_TASK:-1}}")
  [ -n "$VOCAB_FILE" ] && args+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
  [ -n "$TOKENIZER_MODEL" ] && args+=(--tokenizer-model "$TOKENIZER_MODEL")
  [ "$APPEND_EOD" = 1 ] && args+=(--append-eod)
  [ "$SPLIT_SENTENCES" = 1 ] && args+=(--split-sentences)
  log "shard $i: $input"
  # shellcheck disable=SC2086  # HPCMEG and EXTRA_ARGS are word lists on purpose
  in_container $HPCMEG preprocess "${args[@]}" $EXTRA_ARGS
  ;;
merge)
  n=${NUM_SHARDS:-$(wc -l < "$shard_list")}
  for key in "${json_keys[@]}"; do
    parts=()
    for ((i = 0; i < n; i++)); do parts+=("$(shard_prefix "$i")_${key}_${level}"); done
    log "merging $n shards of '$key' -> ${OUTPUT_PREFIX}_${key}_${level}"
    # shellcheck disable=SC2086
    in_container $HPCMEG merge-datasets --input "${parts[@]}" --output-prefix "${OUTPUT_PREFIX}_${key}_${level}"
    if [ "$KEEP_SHARDS" != 1 ]; then
      for p in "${parts[@]}"; do rm -f "$p.bin" "$p.idx"; done
    fi
  done
  log "done: ${OUTPUT_PREFIX}_{$(IFS=,; echo "${json_keys[*]}")}_${level}.{bin,idx}"
  ;;
*)
  log "MODE must be launch, shard or merge (got '$MODE')"; exit 2 ;;
esac
