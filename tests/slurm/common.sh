# shellcheck shell=bash
# Sourced by up.sh and revive.sh: what both do to a node of the test cluster.

# slurmd for node $1 in a UTS namespace of its own, so its processes see their own host name.
start_slurmd() {
    unshare --uts bash -c "hostname $1; exec slurmd -N $1"
}

# 0 once all $1 nodes are idle (not idle+drain, which `sinfo -t idle` counts), polling $2 times
# $3 s apart; nodes Slurm drained meanwhile (a job step that would not die, "Kill task failed")
# are resumed. 1 if they never all were.
wait_nodes_idle() {
    local nodes=$1 tries=$2 pause=$3 idle node
    for _ in $(seq 1 "$tries"); do
        idle=$(sinfo -h -N -o %t 2>/dev/null | grep -cx idle || true)
        [ "$idle" -ge "$nodes" ] && return 0
        for node in $(sinfo -h -N -t drain -o %N 2>/dev/null); do
            scontrol update nodename="$node" state=resume 2>/dev/null || true
        done
        sleep "$pause"
    done
    return 1
}
