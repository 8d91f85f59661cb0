#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the integration tests and CI (root only).
#
#   .ci/slurm_cluster.sh start    # install slurm-wlm + munge if missing, configure, start, wait idle
#   .ci/slurm_cluster.sh stop     # stop the daemons this script started, by PID
#   .ci/slurm_cluster.sh status   # exit 0 when the node answers and is usable
#
# The node advertises 4 CPUs whatever the machine has (SlurmdParameters=config_overrides), so a
# 4-task job starts on a 2-core machine. No GRES (GPUs) and no node features are configured.
# `start` leaves a running cluster alone and prints "already running"; then `stop` is a no-op,
# so a test never stops a cluster it did not start.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
STATE=/run/slurm-local-cluster.started   # written when this script started the daemons
WAIT_S=${SLURM_CLUSTER_WAIT_S:-60}

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

usable() {
    command -v sinfo >/dev/null 2>&1 || return 1
    local states
    states=$(timeout 10 sinfo -h -o %T 2>/dev/null) || return 1
    grep -qxE 'idle|mixed|allocated' <<<"$states"
}

install() {
    command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && return
    [[ $(id -u) == 0 ]] || die "Slurm is not installed and installing it needs root"
    echo "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_conf() {
    local host cpus
    host=$(hostname -s)
    cpus=$(( $(nproc) > 4 ? $(nproc) : 4 ))
    mkdir -p /etc/slurm
    cat >"$CONF" <<CONF
# Written by .ci/slurm_cluster.sh: a one-node test cluster.
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
CryptoType=crypto/munge
SlurmUser=slurm
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
NodeName=$host CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
    if usable; then
        echo "already running"
        return
    fi
    [[ $(id -u) == 0 ]] || die "starting the Slurm daemons needs root"
    install
    # Keep a configuration someone else wrote; write ours when there is none (or it is ours).
    if [[ ! -s $CONF ]] || head -n 1 "$CONF" | grep -q 'slurm_cluster.sh'; then
        write_conf
    fi
    local started=()
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
    [[ -s /etc/munge/munge.key ]] || mungekey --create --force
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    if ! alive /run/munge/munged.pid; then
        runuser -u munge -- /usr/sbin/munged
        started+=(munged)
    fi
    munge -n | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"
    mkdir -p /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
    chown slurm:slurm /var/lib/slurm/slurmctld /var/log/slurm
    if ! alive /run/slurmctld.pid; then /usr/sbin/slurmctld; started+=(slurmctld); fi
    if ! alive /run/slurmd.pid; then /usr/sbin/slurmd; started+=(slurmd); fi
    printf '%s\n' "${started[@]}" >"$STATE"
    local deadline=$((SECONDS + WAIT_S))
    until usable; do
        if ((SECONDS > deadline)); then
            tail -n 5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
            die "the node did not become idle within ${WAIT_S}s"
        fi
        sleep 0.5
    done
    echo "started (${started[*]:-nothing new})"
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM by PID, wait up to 10 s for it to go
    local name=$1 pidfile=$2 pid
    alive "$pidfile" || return 0
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    echo "slurm_cluster.sh: $name (pid $pid) still running after 10 s" >&2
}

stop() {
    if [[ ! -f $STATE ]]; then
        echo "not started by this script: left alone"
        return
    fi
    local started
    started=$(cat "$STATE")
    grep -qx slurmd <<<"$started" && stop_pid slurmd /run/slurmd.pid
    grep -qx slurmctld <<<"$started" && stop_pid slurmctld /run/slurmctld.pid
    grep -qx munged <<<"$started" && stop_pid munged /run/munge/munged.pid
    rm -f "$STATE"
    echo "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) usable ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
