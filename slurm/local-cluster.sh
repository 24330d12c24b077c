#!/usr/bin/env bash
# slurm/local-cluster.sh start|stop [--purge]|status
#
# A real, throw-away Slurm cluster on this one machine, for development, tests and CI.
# Debian 12 (bookworm): Slurm 22.05 + MUNGE (+ slurmdbd with a private MariaDB so `sacct` works).
# Two emulated compute nodes (node1, node2) are two slurmd processes on this host (Debian's slurmd
# is built with MULTIPLE_SLURMD), so `--nodes=2` jobs really run on two "nodes".
# `start` is idempotent: it installs what is missing (apt), (re)writes the config, starts only the
# daemons that are not running (restarting slurmctld/slurmd when the config changed), and waits
# until every node is idle and accounting answers. No systemd needed (daemons started directly).
#
# It runs as root and leaves munged, a private MariaDB, slurmdbd, slurmctld and one slurmd per node
# running until `stop`. What it is, how to stop it, how to work without root, and why the settings
# below are what they are: docs/guide.md, section 11 ("The local development cluster").
#
# Environment knobs (all optional):
#   SLURM_CI_ROOT        state/log/pid/db directory        [$TMPDIR/hpcmeg-slurm]
#   SLURM_CI_NODES       number of emulated nodes           [2]
#   SLURM_CI_CPUS        CPUs per emulated node             [$(nproc)]
#   SLURM_CI_MEM_MB      RealMemory per node (MB)           [4000]
#   SLURM_CI_GPUS        fake GPUs (gres/gpu) per node      [0]  (CUDA_VISIBLE_DEVICES only)
#   SLURM_CI_ACCOUNTING  1 = slurmdbd+MariaDB (sacct works), 0 = none   [1]
#   SLURM_CI_DB_PORT     private MariaDB TCP port on 127.0.0.1          [3399]
#   SLURM_CI_FRESH       1 = stop everything and wipe state first       [0]
#   SLURM_CI_TIMEOUT     seconds to wait for each readiness step        [60]
#   SLURM_CI_EXTRA_CONF  extra lines appended to slurm.conf             []
#   SLURM_CI_FAKE_PYXIS  1 = a no-op SPANK plugin accepting pyxis' --container-* options, so
#                        pyxis-style scripts run on the host (image exported as FAKE_PYXIS_IMAGE) [0]
set -euo pipefail

ROOT=${SLURM_CI_ROOT:-${TMPDIR:-/tmp}/hpcmeg-slurm}
NODES=${SLURM_CI_NODES:-2}
CPUS=${SLURM_CI_CPUS:-$(nproc)}
MEM=${SLURM_CI_MEM_MB:-4000}
GPUS=${SLURM_CI_GPUS:-0}
ACCT=${SLURM_CI_ACCOUNTING:-1}
DB_PORT=${SLURM_CI_DB_PORT:-3399}
TIMEOUT=${SLURM_CI_TIMEOUT:-60}
CLUSTER=ci
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
T_START=$(date +%s.%N)

log() { printf '[local-cluster %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
  log "ERROR: $*"
  for f in "$ROOT"/log/*.log; do [ -f "$f" ] && { echo "----- tail $f" >&2; tail -n 15 "$f" >&2; }; done
  exit 1
}
# alive PIDFILE: true if the pid in the file is a live (non-zombie) process whose name is the pid
# file's daemon (slurmd-node1.pid -> slurmd); a stale pid file whose pid was reused by something
# else is never mistaken for (or killed as) ours. Never test liveness by process name: this VM's
# PID 1 reaps late, so zombies linger.
alive() {
  local pid st comm want
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -r "/proc/$pid/stat" ] || return 1
  st=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ "$st" != Z ] || return 1
  want=$(basename "$1" .pid); want=${want%%-*}; [ "$want" = mysqld ] && want=mariadbd
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [ "$comm" = "$want" ]
}
# wait_for SECONDS WHAT CMD... : poll CMD every 0.2 s
wait_for() {
  local t=$1 what=$2; shift 2
  local end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || die "timed out after ${t}s waiting for $what"
    sleep 0.2
  done
}
dead() { ! alive "$1"; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# stop_pidfile PIDFILE [SECONDS]: wait for exit, then TERM, then KILL (by pid only)
stop_pidfile() {
  local pf=$1 t=${2:-10} i
  for sig in NONE TERM KILL; do
    if [ $sig != NONE ] && alive "$pf"; then kill -s $sig "$(cat "$pf")" 2>/dev/null || true; fi
    for ((i = 0; i < t * 5; i++)); do alive "$pf" || { rm -f "$pf"; return 0; }; sleep 0.2; done
  done
  log "WARNING: $(cat "$pf") from $pf still alive"
}


do_stop() {
  local purge=${1:-0}
if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q 'is UP'; then
  mapfile -t jobs < <(squeue -h -o %A 2>/dev/null | sort -u)
  if [ ${#jobs[@]} -gt 0 ]; then
    log "cancelling jobs: ${jobs[*]}"
    scancel "${jobs[@]}" 2>/dev/null || true
    for _ in $(seq 1 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  log "scontrol shutdown (slurmctld + all slurmd)"
  scontrol shutdown >/dev/null 2>&1 || true
fi
for pf in "$ROOT"/run/slurmctld.pid "$ROOT"/run/slurmd-*.pid "$ROOT"/run/slurmdbd.pid; do
  [ -e "$pf" ] || continue
  # scontrol shutdown already stopped ctld/slurmd; slurmdbd gets a TERM
  case $pf in *slurmdbd.pid) alive "$pf" && kill "$(cat "$pf")" 2>/dev/null ;; esac
  stop_pidfile "$pf" 10
done
if [ -e "$ROOT/run/mysqld.pid" ]; then
  log "stopping MariaDB"
  mariadb-admin --no-defaults -S "$ROOT/run/mysqld.sock" -uroot shutdown >/dev/null 2>&1 || true
  stop_pidfile "$ROOT/run/mysqld.pid" 20
fi
if alive /run/munge/munged.pid; then
  log "stopping munged"
  kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
  stop_pidfile /run/munge/munged.pid 10
fi
if [ "$purge" = 1 ]; then
  log "purging $ROOT"
  rm -rf "$ROOT"
  rm -f /etc/slurm/plugstack.conf.d/fake_pyxis.conf
fi
log "stopped"
}

do_start() {

if [ "${SLURM_CI_FRESH:-0}" = 1 ]; then
  do_stop 1
fi
mkdir -p "$ROOT"/{ctld,spool,log,run}

# ---------------------------------------------------------------- 1. install
pkgs=(slurm-wlm munge); bins=(slurmctld slurmd sbatch srun sacct munged)
if [ "$ACCT" = 1 ]; then pkgs+=(slurmdbd mariadb-server); bins+=(slurmdbd mariadbd mariadb-install-db); fi
FAKE_PYXIS=${SLURM_CI_FAKE_PYXIS:-0}
if [ "$FAKE_PYXIS" = 1 ]; then pkgs+=(libslurm-dev gcc libc6-dev); bins+=(gcc); fi
missing=()
for b in "${bins[@]}"; do command -v "$b" >/dev/null 2>&1 || missing+=("$b"); done
if [ "$FAKE_PYXIS" = 1 ] && [ ! -e /usr/include/slurm/spank.h ]; then missing+=(spank.h); fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${pkgs[*]} (missing: ${missing[*]})"
  t0=$(date +%s)
  export DEBIAN_FRONTEND=noninteractive
  # Without systemd, package postinst scripts would try to start munge/slurm/mariadb
  # through /etc/init.d; a policy-rc.d that says "no" keeps them quiet.
  added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; added_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  if ! apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${pkgs[@]}" >"$ROOT/log/apt.log" 2>&1; then
    log "apt-get install failed, running apt-get update and retrying"
    apt-get -o DPkg::Lock::Timeout=600 update -q >>"$ROOT/log/apt.log" 2>&1 || die "apt-get update failed (see $ROOT/log/apt.log)"
    apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${pkgs[@]}" >>"$ROOT/log/apt.log" 2>&1 \
      || die "apt-get install failed (see $ROOT/log/apt.log)"
  fi
  if [ $added_policy = 1 ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
  log "installed in $(( $(date +%s) - t0 ))s"
fi

# ---------------------------------------------------------------- 2. fake node names -> 127.0.0.1
NODE_NAMES=(); for i in $(seq 1 "$NODES"); do NODE_NAMES+=("node$i"); done
add_hosts=()
for n in "${NODE_NAMES[@]}"; do
  ip=$(getent hosts "$n" | awk '{print $1; exit}') || true
  if [ -z "$ip" ]; then add_hosts+=("$n")
  elif [[ "$ip" != 127.* ]]; then die "$n resolves to $ip, not loopback; pick other node names"; fi
done
if [ ${#add_hosts[@]} -gt 0 ]; then
  echo "127.0.0.1 ${add_hosts[*]}   # slurm-ci fake nodes" >> /etc/hosts
fi

# ---------------------------------------------------------------- 3. munge
if [ ! -s /etc/munge/munge.key ]; then mungekey -c -k /etc/munge/munge.key; fi
chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
if ! (munge -n | unmunge) >/dev/null 2>&1; then
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged || die "munged failed to start"
  wait_for "$TIMEOUT" munged sh -c 'munge -n | unmunge'
fi

# ---------------------------------------------------------------- 4. private MariaDB for slurmdbd
DBSOCK=$ROOT/run/mysqld.sock
if [ "$ACCT" = 1 ]; then
  if [ ! -d "$ROOT/mysql/mysql" ]; then
    log "initialising MariaDB datadir"
    mariadb-install-db --no-defaults --user=root --datadir="$ROOT/mysql" \
      --auth-root-authentication-method=normal --skip-test-db >"$ROOT/log/mariadb-install.log" 2>&1 \
      || die "mariadb-install-db failed"
  fi
  if ! mariadb-admin --no-defaults -S "$DBSOCK" -uroot ping >/dev/null 2>&1; then
    log "starting MariaDB on 127.0.0.1:$DB_PORT"
    setsid /usr/sbin/mariadbd --no-defaults --user=root --datadir="$ROOT/mysql" --socket="$DBSOCK" \
      --pid-file="$ROOT/run/mysqld.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
      --innodb-buffer-pool-size=64M --log-error="$ROOT/log/mariadb.log" </dev/null >/dev/null 2>&1 &
    wait_for "$TIMEOUT" MariaDB mariadb-admin --no-defaults -S "$DBSOCK" -uroot ping
  fi
  mariadb --no-defaults -S "$DBSOCK" -uroot -e "
    CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "MariaDB user/db setup failed"
fi

# ---------------------------------------------------------------- 5. config
mkdir -p /etc/slurm
if [ "$ACCT" = 1 ]; then
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux"
else
  ACCT_LINES="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
NEW_CONF=$(cat <<EOF
# generated by start_slurm.sh - single-host CI cluster
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
# requeued jobs wait cred_expire+1 s before they may start again (default 120 s)
AuthInfo=cred_expire=5
StateSaveLocation=$ROOT/ctld
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldPort=6817
# no cgroups in containers/VMs: track processes by /proc, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# trust the CPUs/RealMemory below even if the host has fewer (N fake nodes on one host)
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
$ACCT_LINES
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
# schedule immediately instead of every 3 s / 60 s / 30 s
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
# No DependencyParameters=kill_invalid_depend on purpose: many sites do not set it, so hpcmeg passes
# --kill-on-invalid-dep=yes on every dependent job itself and the test suite checks that on a cluster
# configured like those sites (a failed parent must cancel its children, not leave them pending).
KillWait=5
MinJobAge=300
# real preemption: a job in partition "urgent" requeues jobs in "debug"; the job's
# --signal (submitit: USR2) is sent at preemption time, then GraceTime seconds to exit
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
EOF
)
NODE_GRES=""; NEW_GRES=""
if [ "$GPUS" -gt 0 ]; then
  # fake GPUs: slurmd only stat()s the device files; char devices (a copy of
  # /dev/null) make Slurm also export CUDA_VISIBLE_DEVICES to the job
  mkdir -p "$ROOT/fakegpu"
  for ((g = 0; g < GPUS; g++)); do
    f=$ROOT/fakegpu/nvidia$g
    [ -c "$f" ] || { rm -f "$f"; mknod "$f" c 1 3 2>/dev/null || touch "$f"; }
  done
  NEW_CONF+=$'\n'"GresTypes=gpu"
  NODE_GRES=" Gres=gpu:$GPUS"
  NEW_GRES="Name=gpu File=$ROOT/fakegpu/nvidia[0-$((GPUS - 1))]"
fi
for i in "${!NODE_NAMES[@]}"; do
  NEW_CONF+=$'\n'"NodeName=${NODE_NAMES[$i]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((17001 + i)) CPUs=$CPUS RealMemory=$MEM$NODE_GRES State=UNKNOWN"
done
NEW_CONF+=$'\n'"PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=10"
NEW_CONF+=$'\n'"PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF"
if [ -n "${SLURM_CI_EXTRA_CONF:-}" ]; then NEW_CONF+=$'\n'"$SLURM_CI_EXTRA_CONF"; fi

conf_changed=0
if [ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$NEW_CONF" ]; then
  printf '%s\n' "$NEW_CONF" > /etc/slurm/slurm.conf; conf_changed=1
fi
if [ "$(cat /etc/slurm/gres.conf 2>/dev/null)" != "$NEW_GRES" ]; then
  if [ -n "$NEW_GRES" ]; then printf '%s\n' "$NEW_GRES" > /etc/slurm/gres.conf; else rm -f /etc/slurm/gres.conf; fi
  conf_changed=1
fi
if [ "$ACCT" = 1 ]; then
  cat > /etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
LogFile=$ROOT/log/slurmdbd.log
PidFile=$ROOT/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurm
EOF
  chmod 600 /etc/slurm/slurmdbd.conf   # slurmdbd refuses a world-readable file
fi

# ---------------------------------------------------------------- 5b. fake pyxis (optional)
mkdir -p /etc/slurm/plugstack.conf.d
if [ "$FAKE_PYXIS" = 1 ]; then
  if [ ! -s "$ROOT/fake_pyxis.so" ]; then
    cat > "$ROOT/fake_pyxis.c" <<'EOF'
/* CI-only SPANK plugin: accept pyxis' options, run the command on the host. */
#include <string.h>
#include <slurm/spank.h>
SPANK_PLUGIN(pyxis, 1);
static char image[4096] = "";
static int opt_str(int val, const char *optarg, int remote) {
    if (val == 1 && optarg) strncpy(image, optarg, sizeof(image) - 1);
    return 0;
}
static int opt_flag(int val, const char *optarg, int remote) { return 0; }
static struct spank_option opts[] = {
    {"container-image", "IMAGE", "[fake pyxis] image (ignored in CI)", 1, 1, opt_str},
    {"container-mounts", "SRC:DST[,...]", "[fake pyxis] (ignored)", 1, 2, opt_str},
    {"container-workdir", "PATH", "[fake pyxis] (ignored)", 1, 3, opt_str},
    {"container-name", "NAME", "[fake pyxis] (ignored)", 1, 4, opt_str},
    {"container-save", "PATH", "[fake pyxis] (ignored)", 1, 5, opt_str},
    {"container-env", "NAME[,...]", "[fake pyxis] (ignored)", 1, 6, opt_str},
    {"container-mount-home", NULL, "[fake pyxis] (ignored)", 0, 7, opt_flag},
    {"no-container-mount-home", NULL, "[fake pyxis] (ignored)", 0, 8, opt_flag},
    {"container-remap-root", NULL, "[fake pyxis] (ignored)", 0, 9, opt_flag},
    {"no-container-remap-root", NULL, "[fake pyxis] (ignored)", 0, 10, opt_flag},
    {"container-entrypoint", NULL, "[fake pyxis] (ignored)", 0, 11, opt_flag},
    {"no-container-entrypoint", NULL, "[fake pyxis] (ignored)", 0, 12, opt_flag},
    {"container-writable", NULL, "[fake pyxis] (ignored)", 0, 13, opt_flag},
    {"container-readonly", NULL, "[fake pyxis] (ignored)", 0, 14, opt_flag},
    SPANK_OPTIONS_TABLE_END
};
/* register in every context: srun (local), sbatch/salloc (allocator), slurmstepd (remote) */
int slurm_spank_init(spank_t sp, int ac, char **av) {
    for (struct spank_option *o = opts; o->name; o++)
        if (spank_option_register(sp, o) != ESPANK_SUCCESS) return -1;
    return 0;
}
int slurm_spank_task_init(spank_t sp, int ac, char **av) {
    if (image[0]) spank_setenv(sp, "FAKE_PYXIS_IMAGE", image, 1);
    return 0;
}
EOF
    gcc -shared -fPIC -O2 -o "$ROOT/fake_pyxis.so" "$ROOT/fake_pyxis.c" || die "building fake_pyxis.so failed"
  fi
  # "optional": a missing .so must not break every srun/sbatch
  echo "optional $ROOT/fake_pyxis.so" > /etc/slurm/plugstack.conf.d/fake_pyxis.conf
else
  rm -f /etc/slurm/plugstack.conf.d/fake_pyxis.conf
fi

# ---------------------------------------------------------------- 6. daemons
if [ "$ACCT" = 1 ] && ! alive "$ROOT/run/slurmdbd.pid"; then
  log "starting slurmdbd"
  slurmdbd || die "slurmdbd failed to start"
  wait_for "$TIMEOUT" "slurmdbd port 6819" port_open 6819
fi

ctld_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
if [ $conf_changed = 1 ]; then
  for pf in "$ROOT"/run/slurmctld.pid "$ROOT"/run/slurmd-*.pid; do
    if alive "$pf"; then
      log "slurm config changed: stopping $(basename "$pf" .pid) to restart it"
      kill "$(cat "$pf")" 2>/dev/null || true
      wait_for 30 "$(basename "$pf") to exit" dead "$pf"
    fi
  done
fi
if ! alive "$ROOT/run/slurmctld.pid"; then
  log "starting slurmctld"
  slurmctld || die "slurmctld failed to start"
fi
wait_for "$TIMEOUT" slurmctld ctld_up
for n in "${NODE_NAMES[@]}"; do
  if ! alive "$ROOT/run/slurmd-$n.pid"; then
    log "starting slurmd $n"
    slurmd -N "$n" || die "slurmd -N $n failed to start"
  fi
done

all_idle() {
  local states
  states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u)
  # a node left drained/down by an earlier run: bring it back
  while read -r n; do
    [ -n "$n" ] && { scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true; }
  done < <(awk '$2 ~ /^(down|drain|drained|draining|fail|inval)/ {print $1}' <<<"$states")
  [ "$(awk '$2 == "idle" || $2 == "mixed" || $2 == "allocated"' <<<"$states" | wc -l)" -eq "$NODES" ]
}
wait_for "$TIMEOUT" "$NODES node(s) to be idle" all_idle

if [ "$ACCT" = 1 ]; then
  # slurmctld registers the cluster in slurmdbd by itself; sacct must answer
  wait_for "$TIMEOUT" "cluster registration in slurmdbd" \
    bash -c "sacctmgr -n -P list cluster format=cluster | grep -qx $CLUSTER && sacct -n -X -j 1 -o JobID"
fi

log "Slurm is up: $(sinfo -h -o '%P %a %D nodes %T' | tr '\n' ' ')(accounting=$ACCT) in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $T_START}")s"
}

do_status() {
  local rc=0
  for pf in "$ROOT"/run/slurmctld.pid "$ROOT"/run/slurmd-*.pid "$ROOT"/run/slurmdbd.pid "$ROOT"/run/mysqld.pid; do
    [ -e "$pf" ] || continue
    if alive "$pf"; then echo "$(basename "$pf" .pid): running (pid $(cat "$pf"))"; else echo "$(basename "$pf" .pid): not running"; rc=1; fi
  done
  if scontrol ping 2>/dev/null | grep -q 'is UP'; then sinfo -N -o '%N %P %T %c' ; else echo "slurmctld: down"; rc=1; fi
  return $rc
}

case "${1:-}" in
  start) do_start ;;
  stop) if [ "${2:-}" = --purge ]; then do_stop 1; else do_stop 0; fi ;;
  status) do_status ;;
  *) echo "usage: $0 start|stop [--purge]|status   (knobs: see the header of this script)" >&2; exit 2 ;;
esac
