#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for testing `prime-rl --slurm`: a controller
# and three node daemons (n1, n2, n3) that act as three nodes (Debian's slurm-wlm builds
# with multiple-slurmd support), no cgroups, no accounting database.
#   sudo bash scripts/slurm_local.sh start [STATE_DIR]   install (apt) if needed, start, wait until idle
#   sudo bash scripts/slurm_local.sh stop  [STATE_DIR]   stop every daemon it started
# Then `sbatch`, `squeue`, `scancel` work as on a cluster (SLURM_CONF is not needed: the
# config goes to /etc/slurm/slurm.conf). docs/machine_facts.md has the recipe's origins.
set -euo pipefail
ACTION=${1:?usage: slurm_local.sh start|stop [STATE_DIR]}
STATE=${2:-/tmp/prime-rl-slurm}
CPUS=$(nproc)

stop() {
    for pidfile in "$STATE"/*.pid; do
        [ -f "$pidfile" ] || continue
        kill "$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
    done
}

if [ "$ACTION" = stop ]; then
    stop
    exit 0
fi
[ "$ACTION" = start ] || { echo "slurm_local.sh: unknown action $ACTION (start|stop)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "slurm_local.sh: run as root (it installs packages and starts daemons)" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; }
fi
stop
mkdir -p "$STATE"/{ctld,n1,n2,n3,log} /run/munge /etc/munge /etc/slurm
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
chown munge:munge /etc/munge/munge.key /run/munge && chmod 400 /etc/munge/munge.key
if ! pgrep -x munged >/dev/null; then
    su -s /bin/sh munge -c "munged" && pgrep -x munged >"$STATE/munged.pid"
fi

HOST=$(hostname -s)
cat >/etc/slurm/slurm.conf <<EOF
ClusterName=prime-rl-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmctldPort=6817
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$STATE/ctld/slurmctld.pid
SlurmdPidFile=$STATE/%n/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
KillWait=30
SchedulerType=sched/builtin
SelectType=select/linear
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=$CPUS State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=$CPUS State=UNKNOWN
NodeName=n3 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17003 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=n1,n2,n3 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

slurmctld -D -i >"$STATE/log/slurmctld.out" 2>&1 &
echo $! >"$STATE/slurmctld.pid"
for node in n1 n2 n3; do
    slurmd -D -N "$node" >"$STATE/log/slurmd-$node.out" 2>&1 &
    echo $! >"$STATE/slurmd-$node.pid"
done
for _ in $(seq 60); do
    if [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u | tr -d '\n')" = "idle" ]; then
        echo "slurm_local: nodes n1, n2, n3 idle (state in $STATE)"
        exit 0
    fi
    sleep 0.5
done
echo "slurm_local: nodes did not come up; see $STATE/log/" >&2
sinfo >&2 || true
exit 1
