#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for perdure's sweep tests and docs (Debian 12, SLURM 22.05).
#
#   scripts/slurm-local-cluster.sh install        install the Debian packages if missing (root, apt)
#   scripts/slurm-local-cluster.sh start [DIR]    start munged + slurmctld + slurmd with all state under DIR
#   scripts/slurm-local-cluster.sh stop [DIR]     cancel every job, then stop exactly the daemons start recorded
#
# DIR defaults to /tmp/perdure-slurm. After `start`, point the SLURM commands at the cluster with
#   export SLURM_CONF=DIR/slurm.conf          (start prints this line; DIR/env holds it too)
# Everything is private to the cluster: its own munged (socket in /tmp/perdure-munge.*, named in DIR/munge.dir),
# its own ports (the first free pair from 6817 up), its own state, so two clusters (two test sessions) can run side
# by side and `stop` never touches a daemon it did not start. Needs root (slurmd runs jobs as their user) and no systemd: the daemons run in the
# foreground (-F / -D) in their own sessions, and their PIDs are recorded and checked before they are signalled.
#
# Tuned so that requeue and preemption take seconds, not minutes (measured in /work/shared/slurm-local-cluster.md):
# cred_expire=5 (a requeued job waits that long before it may start again), a 1 s scheduler interval, KillWait=5.
# Two partitions: `debug` (default, preemptable: PreemptMode=REQUEUE, GraceTime=10) and `urgent`, whose jobs
# preempt `debug` jobs; the victim first gets its --signal (preempt_send_user_signal), SIGTERM after GraceTime.
# SLURM_LOCAL_CPUS=N advertises N CPUs (more than the cores: oversubscribed) so several jobs can run at once.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
cmd=${1:-}
D=${2:-/tmp/perdure-slurm}

have_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
    command -v munged >/dev/null
}

# $1 = daemon name: its PID if the recorded pidfile points at a live process of that name
recorded_pid() {
  local pid
  pid=$(cat "$D/$1.bgpid" 2>/dev/null) || return 0
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && echo "$pid"
  return 0
}

do_install() {
  if have_packages; then return 0; fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "SLURM is not installed and this is not root with apt-get: install ${PACKAGES[*]} by hand" >&2
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
  have_packages
}

do_stop() {
  export SLURM_CONF="$D/slurm.conf"
  if [ -n "$(recorded_pid slurmctld)" ] && [ -f "$SLURM_CONF" ]; then
    # cancel first, so that no slurmstepd (they daemonize) outlives the cluster
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    [ -n "${jobs// /}" ] && scancel $jobs 2>/dev/null
    for _ in $(seq 1 150); do
      [ -z "$(squeue -h -t R,CG,S -o %A 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  for name in slurmd slurmctld munged; do
    pid=$(recorded_pid "$name")
    if [ -n "$pid" ]; then
      kill -TERM "$pid"
      for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$D/$name.bgpid"
  done
  mdir=$(cat "$D/munge.dir" 2>/dev/null) || true
  case "$mdir" in /tmp/perdure-munge.*) rm -rf "$mdir" ;; esac
  rm -f "$D/munge.dir"
  return 0
}

port_free() { ! ss -ltnH "( sport = :$1 )" | grep -q .; }

do_start() {
  if [ "$(id -u)" != 0 ]; then echo "start needs root (slurmd runs jobs as their users)" >&2; return 1; fi
  if ! have_packages; then echo "SLURM is not installed: run '$0 install' first" >&2; return 1; fi
  local host port cpus hw mem nodecpu overrides socket
  host=$(hostname -s)
  mkdir -p "$D/state/ctld" "$D/state/d" "$D/log"
  D=$(cd "$D" && pwd)
  [ -e "$D/slurmctld.bgpid" ] && do_stop # a cluster left over under the same DIR
  getent hosts "$host" >/dev/null || echo "127.0.0.1 $host" >>/etc/hosts # slurmd looks itself up by NodeName

  port=6817
  while ! { port_free "$port" && port_free $((port + 1)); }; do
    port=$((port + 2))
    [ "$port" -gt 6999 ] && { echo "no two free ports between 6817 and 7000" >&2; return 1; }
  done

  # munge: a private daemon and socket, so stopping this cluster never stops someone else's munged. Its
  # directory lives under /tmp (DIR may sit under a 0700 directory the munge user cannot enter), recorded in
  # DIR/munge.dir so that stop removes it.
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  mdir=$(mktemp -d /tmp/perdure-munge.XXXXXX)
  echo "$mdir" >"$D/munge.dir"
  chown munge:munge "$mdir"
  chmod 755 "$mdir" # munged wants the socket dir executable by all
  socket="$mdir/munge.socket"
  # setpriv execs munged, so $! is munged's own PID (-F: foreground)
  setsid setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F --socket="$socket" \
    --pid-file="$mdir/munged.pid" --seed-file="$mdir/munged.seed" --log-file="$mdir/munged.log" \
    >"$D/log/munged.out" 2>&1 </dev/null &
  echo $! >"$D/munged.bgpid"
  for _ in $(seq 1 100); do
    munge -S "$socket" -n 2>/dev/null | unmunge -S "$socket" >/dev/null 2>&1 && break
    [ -n "$(recorded_pid munged)" ] || break # it died: no point waiting
    sleep 0.1
  done
  if ! munge -S "$socket" -n | unmunge -S "$socket" >/dev/null; then
    echo "munged did not start:" >&2
    cat "$D/log/munged.out" >&2
    do_stop
    return 1
  fi

  cpus=${SLURM_LOCAL_CPUS:-$(nproc)}
  hw=$(slurmd -C | head -1) # NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 ... RealMemory=24105
  mem=$(($(echo "$hw" | sed 's/.*RealMemory=\([0-9]*\).*/\1/') * 3 / 4)) # above what slurmd detects, the node drains
  if [ "$cpus" = "$(nproc)" ]; then
    nodecpu=$(echo "$hw" | sed 's/^NodeName=[^ ]* //; s/ RealMemory=.*//')
    overrides=""
  else
    nodecpu="CPUs=$cpus"
    overrides="SlurmdParameters=config_overrides"
  fi
  cat >"$D/slurm.conf" <<CONF
ClusterName=perdure
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (min 5, default 120) is also how long a requeued job waits before it may start again
AuthInfo=socket=${socket},cred_expire=5
SlurmctldPort=${port}
SlurmdPort=$((port + 1))
StateSaveLocation=${D}/state/ctld
SlurmdSpoolDir=${D}/state/d
SlurmctldPidFile=${D}/slurmctld.pid
SlurmdPidFile=${D}/slurmd.pid
SlurmctldLogFile=${D}/log/slurmctld.log
SlurmdLogFile=${D}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=60
${overrides}
NodeName=${host} NodeAddr=127.0.0.1 ${nodecpu} RealMemory=${mem} State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=10
PartitionName=urgent Nodes=${host} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
CONF
  echo "export SLURM_CONF=$D/slurm.conf" >"$D/env"
  export SLURM_CONF="$D/slurm.conf"

  # -c: a fresh controller state every start; -i: ignore errors in the (wiped) state files
  setsid /usr/sbin/slurmctld -D -c -i -f "$SLURM_CONF" >"$D/log/slurmctld.out" 2>&1 </dev/null &
  echo $! >"$D/slurmctld.bgpid"
  setsid /usr/sbin/slurmd -D -f "$SLURM_CONF" >"$D/log/slurmd.out" 2>&1 </dev/null &
  echo $! >"$D/slurmd.bgpid"
  for _ in $(seq 1 300); do
    if [ "$(sinfo -h -n "$host" -p debug -o '%T' 2>/dev/null)" = idle ]; then
      echo "slurm up on $host ports $port,$((port + 1)) with $cpus CPUs; state in $D"
      echo "export SLURM_CONF=$D/slurm.conf"
      return 0
    fi
    sleep 0.1
  done
  echo "SLURM did not come up:" >&2
  sinfo >&2 || true
  tail -n 20 "$D/log/slurmctld.log" "$D/log/slurmd.log" >&2 || true
  do_stop
  return 1
}

case "$cmd" in
install) do_install ;;
start) do_start ;;
stop) do_stop ;;
*)
  echo "usage: $0 install | start [DIR] | stop [DIR]" >&2
  exit 2
  ;;
esac
