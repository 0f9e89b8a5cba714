#!/usr/bin/env bash
# A real Slurm cluster on this one machine: NODES slurmd daemons (default 4), each in its own
# UTS namespace so its node's processes see their own host name (n1..nN) and MPI treats them
# as distinct hosts. Debian's slurm-wlm 22.05 and munge; root; no cgroups, no accounting.
# Idempotent: a second run restarts the daemons. Stop with down.sh beside this file.
# (The test suite owns this copy of the team's ../shared/slurm scripts, so CI needs nothing outside
# the repository; tests/test_slurm_jobs.py drives it.)
#
#   bash tests/slurm/up.sh [NODES]           # then: sinfo; sbatch --ntasks-per-node=1 jobs/slurm.sbatch
#
# Failure domains: SWITCH_SIZE=K groups the nodes under leaf switches of K nodes (s1, s2, ...)
# below one top switch (topology/tree), so each task gets SLURM_TOPOLOGY_ADDR (top.s2.n3):
#   SWITCH_SIZE=2 bash tests/slurm/up.sh 8
#
# Node failure, as a real one looks to the job (its step is killed, the node leaves a --no-kill
# allocation, and it stays down until brought back):
#   bash tests/slurm/fail-node.sh n3      # kill slurmd n3 and its job processes, mark it down
#   bash tests/slurm/up.sh                  # everything back up
set -eu
NODES=${1:-${SLURM_TEST_NODES:-4}}
RUN=/run/hpcckpt-slurm
mkdir -p "$RUN"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
bash "$(dirname "$0")/down.sh" >/dev/null 2>&1 || true

host=$(hostname)
mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm /run/munge /var/log/munge /var/lib/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=hpcckpt-test
SlurmctldHost=$host
AuthType=auth/munge
# How long a job step's credential lives; also how long a requeued job waits before it starts
# again (CRED_EXPIRE: Slurm's default 120 s unless a test needs a quicker requeue).
AuthInfo=cred_expire=${CRED_EXPIRE:-120}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
ReturnToService=2
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd/%n
StateSaveLocation=/var/spool/slurmctld
SlurmUser=root
SlurmdUser=root
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=20
InactiveLimit=0
KillWait=5
MinJobAge=600
# Job ids keep growing across restarts of this test cluster (its state is wiped), so
# per-job node-local directories (hpcckpt-{job}) of earlier runs are never taken for this one's.
FirstJobId=$(( ($(date +%s) % 6000000) * 10 + 1 ))
NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-$((17000 + NODES))] CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=batch Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
rm -f /etc/slurm/topology.conf
if [ -n "${SWITCH_SIZE:-}" ]; then
    echo "TopologyPlugin=topology/tree" >> /etc/slurm/slurm.conf
    leaves=$(( (NODES + SWITCH_SIZE - 1) / SWITCH_SIZE ))
    for s in $(seq 1 "$leaves"); do
        first=$(( (s - 1) * SWITCH_SIZE + 1 )); last=$(( s * SWITCH_SIZE < NODES ? s * SWITCH_SIZE : NODES ))
        echo "SwitchName=s$s Nodes=n[$first-$last]"
    done > /etc/slurm/topology.conf
    echo "SwitchName=top Switches=s[1-$leaves]" >> /etc/slurm/topology.conf
fi
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 2>/dev/null; }
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
chmod 600 /etc/munge/munge.key
munged --force --pid-file="$RUN/munged.pid" 2>/dev/null || munged --force
rm -rf /var/spool/slurmctld/*
slurmctld
# shellcheck source=tests/slurm/common.sh
. "$(dirname "$0")/common.sh"
for n in $(seq 1 "$NODES"); do
    mkdir -p "/var/spool/slurmd/n$n"
    start_slurmd "n$n"
done
# Every node idle, or exit 1 saying why: a cluster short of a node would leave jobs pending
# until their tests time out.
if wait_nodes_idle "$NODES" 60 1; then
    sinfo
    exit 0
fi
sinfo -N; sinfo -R
echo "up.sh: not all $NODES nodes idle after 60 s (sinfo above)" >&2
exit 1
