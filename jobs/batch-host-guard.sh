#!/bin/bash
# Watches the node that runs a job's batch script, as a job of its own on another node
# (jobs/slurm.sbatch submits it). The batch script runs the restart loop; when its node fails,
# nothing is left to restart anything (Slurm kills every step the script started), and with
# --no-kill the allocation stays up on the other nodes, empty, until its time limit. This
# requeues the job instead (the same job id, so the requeued job finds the node-local
# directories of the nodes that survive and restarts from what they and the PFS hold), or,
# where Slurm refuses a requeue, cancels it so the allocation ends at once. It ends when the
# job is no longer running; its output is the job's own output file.
#
#   batch-host-guard.sh BATCH_NODE JOB_ID      (GUARD_INTERVAL: seconds between looks, default 5)
#SBATCH --ntasks=1
set -u
batch_node=${1:?usage: batch-host-guard.sh BATCH_NODE JOB_ID}
job=${2:?usage: batch-host-guard.sh BATCH_NODE JOB_ID}
interval=${GUARD_INTERVAL:-5}

job_field() { scontrol show job -o "$job" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1; }
say() { echo "hpcckpt-job: $(date '+%F %T') $* (guard job ${SLURM_JOB_ID:-} on $(hostname))"; }

batch_node_failed() {
    # Failed: Slurm no longer counts it in the job, or marks it down, failing or not responding.
    local nodes state
    nodes=$(job_field NodeList)
    [ -n "$nodes" ] || return 1   # slurmctld did not answer: look again, never act on silence
    if ! scontrol show hostnames "$nodes" | grep -qxF -- "$batch_node"; then
        return 0
    fi
    state=$(sinfo -h -N -n "$batch_node" -o %t 2>/dev/null | head -n 1)
    case $state in
        down*|fail*|*'*') return 0 ;;
    esac
    return 1
}

while sleep "$interval"; do
    case $(job_field JobState) in
        RUNNING) ;;
        "") continue ;;
        *) exit 0 ;;   # completing, requeued, cancelled: nothing left to guard
    esac
    batch_node_failed || continue
    say "the node running the batch script ($batch_node) failed: requeueing job $job, which restarts from the surviving checkpoint levels"
    if refused=$(scontrol requeue "$job" 2>&1); then
        exit 0
    fi
    say "Slurm refused to requeue job $job (${refused:0:300}): cancelling it, so the allocation ends now; submit it again to resume from the surviving levels"
    scancel "$job"
    exit 1
done
