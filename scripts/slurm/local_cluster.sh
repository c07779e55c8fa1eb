#!/usr/bin/env bash
# A one-node Slurm on this machine (slurmctld + slurmd + munged), as tests/test_slurm.py uses it. Idempotent: what
# already runs with the same config is left alone. Needs root and Debian's slurm-wlm (installed when missing).
#
#   sudo bash scripts/slurm/local_cluster.sh          # install if needed, write the config, start the daemons
#   sudo bash scripts/slurm/local_cluster.sh --stop   # stop the daemons this script started (by their pid files)
#
# The node is this host as `slurmd -C` sees it (CPUs, memory; no GPUs), in one partition `debug`. No accounting
# database: job states come from `scontrol show job` (finished jobs are kept an hour, MinJobAge).
set -euo pipefail
CONF=/etc/slurm/slurm.conf
PIDS=(/run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid)

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [ "${1:-}" = --stop ]; then
  for pidfile in "${PIDS[@]}"; do
    if running "$pidfile"; then kill "$(cat "$pidfile")"; echo "stopped $(basename "$pidfile" .pid)"; fi
  done
  exit 0
fi

if ! command -v slurmctld >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm >/dev/null
fi

# munge: the key (the package usually creates it) and the daemon, run as the munge user
if [ ! -s /etc/munge/munge.key ]; then mungekey --create --keyfile=/etc/munge/munge.key; fi
chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then runuser -u munge -- /usr/sbin/munged; fi

# the config: this host as slurmd detects it; plugins that need no cgroups (containers, gVisor)
node=$(slurmd -C | head -n 1)
host=$(hostname -s)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
new=$(cat <<CONF
# written by polyturn scripts/slurm/local_cluster.sh: a one-node test cluster
ClusterName=polyturn-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MinJobAge=3600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
$node State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
)
changed=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$new" ]; then printf '%s\n' "$new" > "$CONF"; changed=1; fi

if scontrol ping 2>/dev/null | grep -q UP; then
  if [ "$changed" = 1 ]; then scontrol reconfigure; fi
else
  slurmctld
fi
running /run/slurmd.pid || slurmd

# wait until the node takes jobs (a node left down by an earlier run is resumed)
for _ in $(seq 60); do
  state=$(sinfo -h -N -n "$host" -o %T 2>/dev/null || true)
  case "$state" in
    idle*|mixed*|allocated*|completing*) echo "slurm: node $host $state ($node)"; exit 0 ;;
    down*|drain*) scontrol update NodeName="$host" State=RESUME || true ;;
  esac
  sleep 1
done
echo "slurm: node $host did not come up (state: ${state:-none}); see /var/log/slurm/" >&2
exit 1
